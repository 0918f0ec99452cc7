//! `strata profile`: runs prompts on the CPU engine and writes how many
//! tokens each (layer, expert) was routed to: an expert profile, for the
//! expert cache's initial placement (docs/expert-cache.md).

use std::path::PathBuf;

use clap::Args;

use strata::engine::EngineOptions;
use strata::experts::ExpertCacheOptions;
use strata::pack::Pack;
use strata::sampling::SamplingParams;
use strata::session::SessionOptions;
use strata::tokenizer::Tokenizer;
use strata::{Error, Result};

#[derive(Args)]
pub struct ProfileArgs {
    /// The pack directory.
    #[arg(long)]
    pack: PathBuf,
    /// A file of prompts, one a line: comma-separated token ids, or text
    /// (needs a pack with tokenizer.json). Empty lines are skipped.
    #[arg(long, conflicts_with = "tokens", required_unless_present = "tokens")]
    prompts: Option<PathBuf>,
    /// One prompt as comma-separated token ids.
    #[arg(long, value_delimiter = ',')]
    tokens: Vec<u32>,
    /// Greedy tokens generated after each prompt (decode routing counts too).
    #[arg(short = 'n', long, default_value_t = 16)]
    gen: usize,
    /// Prompt chunk size in tokens (0 = the whole prompt in one forward).
    #[arg(long, default_value_t = 0)]
    chunk: usize,
    /// CPU threads (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
    /// The profile to write (JSON).
    #[arg(long)]
    out: PathBuf,
}

fn read_prompts(a: &ProfileArgs, tokenizer: Option<&Tokenizer>) -> Result<Vec<Vec<u32>>> {
    let Some(path) = &a.prompts else { return Ok(vec![a.tokens.clone()]) };
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    let mut prompts = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let ids = line.chars().all(|c| c.is_ascii_digit() || c == ',' || c.is_whitespace());
        prompts.push(match (ids, tokenizer) {
            (true, _) => line
                .split(',')
                .map(|t| t.trim().parse::<u32>())
                .collect::<std::result::Result<Vec<_>, _>>()
                .map_err(|e| Error::InvalidArgument(format!("{} line {}: {e}", path.display(), i + 1)))?,
            (false, Some(tok)) => tok.encode(line)?,
            (false, None) => {
                return Err(Error::Tokenizer(format!(
                    "{} line {} is text and {} has no tokenizer.json",
                    path.display(),
                    i + 1,
                    a.pack.display()
                )))
            }
        });
    }
    if prompts.is_empty() {
        return Err(Error::InvalidArgument(format!("{} holds no prompt", path.display())));
    }
    Ok(prompts)
}

pub fn run(a: ProfileArgs) -> Result<()> {
    // The prompts and the output's folder are checked before the model loads.
    let pack = Pack::open(&a.pack)?;
    let tokenizer = match pack.tokenizer_path() {
        Some(p) => Some(Tokenizer::from_file(&p)?),
        None => None,
    };
    let prompts = read_prompts(&a, tokenizer.as_ref())?;
    let folder = a.out.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(std::path::Path::new("."));
    if !folder.is_dir() {
        return Err(Error::InvalidArgument(format!(
            "--out {}: no folder {} to write it in",
            a.out.display(),
            folder.display()
        )));
    }
    // The smallest cache records the routing; placement does not change logits.
    let top_k = pack.config().num_experts_per_tok;
    drop(pack);
    let opts = EngineOptions {
        threads: a.threads,
        expert_cache: ExpertCacheOptions { slots: Some(top_k), adapt_every: 0, ..Default::default() },
        ..Default::default()
    };
    let engine = super::load_engine(&a.pack, &opts)?;
    for (i, prompt) in prompts.iter().enumerate() {
        eprintln!("strata profile: prompt {} of {} ({} tokens)", i + 1, prompts.len(), prompt.len());
        let mut s = engine.new_session(&SessionOptions { prefill_chunk: a.chunk, ..Default::default() })?;
        s.prefill(prompt)?;
        for _ in 0..a.gen.min(s.capacity().saturating_sub(prompt.len())) {
            s.step_with(&SamplingParams::default())?;
        }
    }
    let profile = engine.expert_profile().expect("the engine has a cache");
    profile.save(&a.out)?;
    eprintln!(
        "strata profile: {} prompts, {} tokens, {} layers x {} experts -> {}",
        prompts.len(),
        profile.tokens,
        profile.num_layers,
        profile.num_experts,
        a.out.display()
    );
    Ok(())
}
