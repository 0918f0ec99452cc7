//! `strata generate`: prefill a prompt, then sample tokens, printing the
//! tokens (and text, when the pack has a tokenizer) and the speeds.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use clap::Args;

use super::cache_args::{stats_line, tiers_line, ExpertCacheArgs};
use super::sampling_args::SamplingArgs;
use super::split_args::{split_line, KvArg, PrecisionArg, SplitArgs};
use strata::session::SessionOptions;
use strata::tokenizer::Tokenizer;
use strata::{Error, Result};

#[derive(Args)]
pub struct GenerateArgs {
    /// The pack directory.
    #[arg(long)]
    pack: PathBuf,
    /// Prompt as comma-separated token ids.
    #[arg(long, value_delimiter = ',', conflicts_with = "prompt", required_unless_present = "prompt")]
    tokens: Vec<u32>,
    /// Prompt text (needs a pack with tokenizer.json).
    #[arg(long)]
    prompt: Option<String>,
    /// Number of tokens to generate (fewer when an end-of-generation token
    /// comes first).
    #[arg(short = 'n', long, default_value_t = 32)]
    n: usize,
    /// Generate all N tokens even past the pack's end-of-generation tokens.
    #[arg(long)]
    ignore_eos: bool,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Prompt chunk size in tokens (0 = the whole prompt in one forward).
    #[arg(long, default_value_t = 0)]
    chunk: usize,
    /// Context size of the session (0 = the model's maximum).
    #[arg(long, default_value_t = 0)]
    context: usize,
    /// CPU threads (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
    /// KV cache type (auto: f32 on the CPU, int8 on CUDA; bf16 and int8 on
    /// the CPU emulate the GPU's caches).
    #[arg(long, value_enum, default_value = "auto")]
    kv: KvArg,
    /// Activation precision of the GPU's tensor-core products (prefill).
    #[arg(long, value_enum, default_value = "accurate")]
    precision: PrecisionArg,
    /// Devices, comma-separated: cpu, cuda or cuda:N (CUDA needs a build
    /// with feature cuda); several devices split the layers into stages:
    /// cpu,cpu; cuda:0,cuda:1; cuda:0,cuda:0 (two logical devices on one
    /// GPU).
    #[arg(long, value_delimiter = ',', default_value = "cpu")]
    device: Vec<String>,
    #[command(flatten)]
    cache: ExpertCacheArgs,
    #[command(flatten)]
    split: SplitArgs,
}

pub fn run(a: GenerateArgs) -> Result<()> {
    // Bad arguments fail before the model loads.
    a.cache.check()?;
    let mut sampler = a.sampling.sampler()?;
    if a.prompt.is_some() && strata::pack::Pack::open(&a.pack)?.tokenizer_path().is_none() {
        return Err(no_tokenizer(&a.pack));
    }
    let t_load = Instant::now();
    let engine = super::load_engine(&a.pack, &a.split.engine_options(a.threads, &a.device, &a.cache, a.precision))?;
    let tokenizer = match engine.pack().tokenizer_path() {
        Some(p) => Some(Tokenizer::from_file(&p)?),
        None => None,
    };
    let prompt = match (&a.prompt, &tokenizer) {
        (Some(text), Some(tok)) => tok.encode(text)?,
        (Some(_), None) => return Err(no_tokenizer(&a.pack)),
        (None, _) => a.tokens.clone(),
    };
    let mut session = engine.new_session(&SessionOptions {
        context_size: a.context,
        prefill_chunk: a.chunk,
        kv_type: a.kv.kv_type(),
        ..Default::default()
    })?;
    eprintln!("strata generate: loaded {} in {:.2} s", a.pack.display(), t_load.elapsed().as_secs_f64());
    if let Some(line) = tiers_line(&engine.expert_tiers()) {
        eprintln!("strata generate: {line}");
    }

    let t = Instant::now();
    session.prefill(&prompt)?;
    let prefill_s = t.elapsed().as_secs_f64();

    // Each step adds a token: at most what the context leaves after the prompt.
    let room = session.capacity().saturating_sub(session.len());
    if a.n > room {
        eprintln!(
            "strata generate: the context of {} tokens leaves room for {room} after the prompt's {}: generating {room}, \
             not {}",
            session.capacity(),
            session.len(),
            a.n
        );
    }
    let mut out = Vec::with_capacity(a.n.min(room));
    let stdout = std::io::stdout();
    let eos = if a.ignore_eos { &[][..] } else { engine.eos_token_ids() };
    let mut stopped = None;
    // (A closed pipe ends the process quietly: main restores SIGPIPE. Another write error is an error.)
    let stdout_err = |e| Error::io("stdout", e);
    let t = Instant::now();
    for _ in 0..a.n.min(room) {
        let tok = session.step(&mut sampler)?;
        if eos.contains(&tok) {
            stopped = Some(tok);
            break;
        }
        out.push(tok);
        let mut s = stdout.lock();
        write!(s, "{tok} ").and_then(|()| s.flush()).map_err(stdout_err)?;
    }
    let decode_s = t.elapsed().as_secs_f64();
    writeln!(stdout.lock()).map_err(stdout_err)?;
    // Steps run, the end-of-generation token's included.
    let steps = out.len() + usize::from(stopped.is_some());
    if let Some(tok) = stopped {
        eprintln!("strata generate: stopped at end-of-generation token {tok} after {} tokens", out.len());
    }
    if let Some(tok) = &tokenizer {
        writeln!(stdout.lock(), "{}", tok.decode(&out)?).map_err(stdout_err)?;
    }
    eprintln!(
        "strata generate: prefill {} tokens in {:.3} s ({:.1} tok/s), decode {} tokens in {:.3} s ({:.1} tok/s)",
        prompt.len(),
        prefill_s,
        prompt.len() as f64 / prefill_s.max(1e-9),
        steps,
        decode_s,
        steps as f64 / decode_s.max(1e-9)
    );
    if let Some(stats) = engine.expert_stats() {
        eprintln!("strata generate: {}", stats_line(&stats));
    }
    if let Some(stats) = engine.split_stats() {
        eprintln!("strata generate: {}", split_line(&stats));
    }
    Ok(())
}

fn no_tokenizer(pack: &std::path::Path) -> Error {
    Error::Tokenizer(format!("{} has no tokenizer.json; pass --tokens instead of --prompt", pack.display()))
}
