//! Command-line front end. Each subcommand lives in its own function; errors
//! print as `strata <cmd>: <message>` and exit with status 1.

use std::path::{Path, PathBuf};

use clap::{Parser, Subcommand, ValueEnum};

use strata::model::Arch;
use strata::pack::convert::{self, ConvertOptions, DenseFormat};
use strata::pack::synth::{self, SynthOptions};
use strata::pack::Pack;
use strata::Result;

mod bench;
mod cache_args;
mod generate;
mod profile;
mod progress;
mod sampling_args;
mod split_args;

#[derive(Parser)]
#[command(name = "strata", version, about = "Run Mixture-of-Experts models from Strata packs")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Clone, Copy, ValueEnum)]
enum ArchArg {
    #[value(name = "qwen3_moe")]
    Qwen3Moe,
    #[value(name = "qwen3_next")]
    Qwen3Next,
}

#[derive(Clone, Copy, ValueEnum)]
enum DenseArg {
    Bf16,
    Nvfp4,
}

#[derive(Subcommand)]
enum Cmd {
    /// Convert a Hugging Face checkpoint directory (config.json + safetensors) into a pack.
    Pack {
        /// The checkpoint directory.
        #[arg(long)]
        from: PathBuf,
        /// The pack directory to write.
        #[arg(long)]
        out: PathBuf,
        /// Storage of dense projection weights (experts are always NVFP4).
        #[arg(long, value_enum, default_value = "bf16")]
        dense: DenseArg,
        /// Replace an existing pack at --out, or write into a folder that is
        /// not empty (never the checkpoint's own).
        #[arg(long)]
        force: bool,
    },
    /// Write a pack of a real model geometry with random weights.
    Synth {
        #[arg(long, value_enum, default_value = "qwen3_moe")]
        arch: ArchArg,
        /// Geometry: tiny (tests), 30b-a3b (Qwen3-30B-A3B) or, with --arch
        /// qwen3_next, 80b-a3b (Qwen3-Next-80B-A3B).
        #[arg(long)]
        preset: String,
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Zipf exponent of expert popularity (0 = uniform routing).
        #[arg(long, default_value_t = 0.0)]
        zipf: f64,
        /// Embeddings 1000x larger, so that routing stays spread over the
        /// experts at every depth (random weights otherwise route every
        /// token to a few experts after a few layers); for cache benches.
        #[arg(long)]
        spread_routing: bool,
        /// Keep only the first N layers of the preset's geometry (qwen3_next:
        /// at least one full-attention layer).
        #[arg(long)]
        layers: Option<usize>,
        #[arg(long)]
        force: bool,
    },
    /// Summarize a pack.
    Inspect {
        pack: PathBuf,
        /// Also recompute every checksum.
        #[arg(long)]
        verify: bool,
    },
    /// Generate tokens from a prompt.
    Generate(generate::GenerateArgs),
    /// Prefill and decode speed on a device, against the floors measured there.
    Bench(bench::BenchArgs),
    /// Run prompts on the CPU and write per-layer expert use counts (an expert profile).
    Profile(profile::ProfileArgs),
}

pub fn main() -> i32 {
    let cli = Cli::parse();
    let (name, res) = match cli.cmd {
        Cmd::Pack { from, out, dense, force } => ("pack", cmd_pack(from, out, dense, force)),
        Cmd::Synth { arch, preset, out, seed, zipf, spread_routing, layers, force } => {
            let opts = SynthOptions { seed, zipf, spread_routing, overwrite: force, progress: true, layers };
            ("synth", cmd_synth(arch, &preset, out, &opts))
        }
        Cmd::Inspect { pack, verify } => ("inspect", cmd_inspect(pack, verify)),
        Cmd::Generate(args) => ("generate", generate::run(args)),
        Cmd::Bench(args) => ("bench", bench::run(args)),
        Cmd::Profile(args) => ("profile", profile::run(args)),
    };
    match res {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("strata {name}: {e}");
            1
        }
    }
}

fn cmd_pack(from: PathBuf, out: PathBuf, dense: DenseArg, force: bool) -> Result<()> {
    let opts = ConvertOptions {
        dense: match dense {
            DenseArg::Bf16 => DenseFormat::Bf16,
            DenseArg::Nvfp4 => DenseFormat::Nvfp4,
        },
        overwrite: force,
        progress: true,
    };
    let t = std::time::Instant::now();
    let m = convert::convert(&from, &out, &opts)?;
    eprintln!(
        "strata pack: wrote {} ({} dense tensors, {} expert blobs) in {:.1} s",
        out.display(),
        m.tensors.len(),
        m.experts.entries.len(),
        t.elapsed().as_secs_f64()
    );
    Ok(())
}

fn cmd_synth(arch: ArchArg, preset: &str, out: PathBuf, opts: &SynthOptions) -> Result<()> {
    let arch = match arch {
        ArchArg::Qwen3Moe => Arch::Qwen3Moe,
        ArchArg::Qwen3Next => Arch::Qwen3Next,
    };
    let config = synth::preset(arch, preset)?;
    let t = std::time::Instant::now();
    let m = synth::synth(&config, &out, opts)?;
    let bytes: u64 = m.files.iter().map(|f| f.size).sum();
    eprintln!(
        "strata synth: wrote {} ({}, {:.2} GB) in {:.1} s",
        out.display(),
        preset,
        bytes as f64 / 1e9,
        t.elapsed().as_secs_f64()
    );
    Ok(())
}

fn gib(b: u64) -> String {
    if b >= 1 << 30 {
        format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
    } else {
        format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64)
    }
}

/// `Engine::load` with its progress on stderr (progress::Progress).
fn load_engine(pack: &Path, opts: &strata::engine::EngineOptions) -> Result<strata::engine::Engine> {
    let mut p = progress::Progress::new(format!("loading {}", pack.display()));
    let engine = strata::engine::Engine::load_with_progress(pack, opts, &mut |f| {
        p.set(f64::from(f));
        true
    });
    p.finish();
    engine
}

fn cmd_inspect(path: PathBuf, verify: bool) -> Result<()> {
    let pack = Pack::open(&path)?;
    let m = pack.manifest();
    let c = &m.config;
    println!("pack        {}", path.display());
    println!("format      {} v{}", m.format, m.version);
    println!("source      {}", m.source);
    println!("arch        {}", c.arch.name());
    println!(
        "geometry    {} layers, hidden {}, {} q / {} kv heads of {}, vocab {}",
        c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.vocab_size
    );
    println!(
        "experts     {} per layer, top {}, intermediate {}, norm_topk_prob {}",
        c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.norm_topk_prob
    );
    let rope = match &c.rope_scaling {
        Some(y) => format!("theta {}, yarn x{} from {}", c.rope_theta, y.factor, y.original_max_position_embeddings),
        None => format!("theta {}", c.rope_theta),
    };
    println!("rope        {rope}, max positions {}", c.max_position_embeddings);
    println!("tied        {}", c.tie_word_embeddings);
    if !m.eos_token_ids.is_empty() {
        let ids: Vec<String> = m.eos_token_ids.iter().map(u32::to_string).collect();
        println!("eos         {}", ids.join(", "));
    }
    let mut by_dtype = std::collections::BTreeMap::new();
    for t in &m.tensors {
        let e = by_dtype.entry(format!("{:?}", t.dtype).to_lowercase()).or_insert((0usize, 0u64));
        e.0 += 1;
        e.1 += t.nbytes;
    }
    for (d, (n, b)) in by_dtype {
        println!("dense       {n} tensors in {d}, {}", gib(b));
    }
    let l = pack.layout();
    let n = m.experts.entries.len() as u64;
    println!("expert blob {} bytes used, stride {} ({} blobs, {})", l.used_len(), l.stride, n, gib(n * l.stride));
    let x = pack.expert(0, 0)?;
    println!(
        "layer 0 expert 0 global scales: gate {:e}, up {:e}, down {:e}",
        x.gate.global_scale, x.up.global_scale, x.down.global_scale
    );
    for f in &m.files {
        println!("file        {} ({})", f.name, gib(f.size));
    }
    if verify {
        let t = std::time::Instant::now();
        let mut p = progress::Progress::new(format!("verifying {}", path.display()));
        pack.verify(|done, total| p.set(done as f64 / total.max(1) as f64))?;
        p.finish();
        println!("checksums   all match ({:.1} s)", t.elapsed().as_secs_f64());
    }
    Ok(())
}
