//! `strata bench`: prefill and decode speed of a pack on a device, each
//! printed next to its floor (performance model in docs/performance.md):
//!
//! - decode is memory-bound: the floor is the bytes one token must read
//!   (dense weights, the routed experts' blobs, KV and recurrent state)
//!   over the HBM bandwidth measured in the same run;
//! - prefill is compute-bound: the floor is the FLOPs of the prompt
//!   (projections, experts, causal attention, the delta rule) over the BF16
//!   tensor-core rate measured in the same run.
//!
//! Prefill: the median of `--repeats` runs, each in a fresh session.
//! Decode: the median of every step of every run, each step timed on its
//! own (steady state: a session's first step, which captures the CUDA
//! graph, and a step that grows the KV and recaptures are outliers there);
//! the mean step of a run, those included, is printed too.

use std::path::PathBuf;
use std::time::Instant;

use clap::Args;

use strata::engine::layer_state_bytes;
use strata::experts::ExpertStats;
use strata::model::weights::{model_tensor_name, Role};
use strata::model::ModelConfig;
use strata::pack::{Pack, TensorData};
use strata::rng::Rng;
use strata::session::{KvType, SessionOptions};
use strata::{Error, Result};

use super::cache_args::{stats_line, tiers_line, ExpertCacheArgs};
use super::sampling_args::SamplingArgs;
use super::split_args::{split_line, KvArg, PrecisionArg, SplitArgs};

#[derive(Args)]
pub struct BenchArgs {
    /// The pack directory.
    #[arg(long)]
    pack: PathBuf,
    /// Prompt length in tokens (random ids).
    #[arg(long, default_value_t = 4096)]
    prompt_len: usize,
    /// Tokens generated after the prompt (greedy unless --temperature:
    /// then each step also pays for its draw, on the GPU on a CUDA engine,
    /// and on the host for the first step and on the CPU engine).
    #[arg(long, default_value_t = 64)]
    gen: usize,
    /// Runs of prefill + decode; the medians are printed.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Devices, comma-separated: cpu, cuda or cuda:N (CUDA needs a build
    /// with feature cuda); several devices split the layers into stages:
    /// cpu,cpu; cuda:0,cuda:1; cuda:0,cuda:0 (two logical devices on one
    /// GPU).
    #[arg(long, value_delimiter = ',', default_value = "cuda")]
    device: Vec<String>,
    /// KV cache type on CUDA (auto: int8; the CPU keeps f32).
    #[arg(long, value_enum, default_value = "int8")]
    kv: KvArg,
    /// Prefill chunk in tokens (0 = the whole prompt in one forward).
    #[arg(long, default_value_t = 0)]
    chunk: usize,
    /// CPU threads (cpu device).
    #[arg(long)]
    threads: Option<usize>,
    /// Activation precision of the GPU's tensor-core products (prefill).
    #[arg(long, value_enum, default_value = "accurate")]
    precision: PrecisionArg,
    #[command(flatten)]
    cache: ExpertCacheArgs,
    #[command(flatten)]
    split: SplitArgs,
    #[command(flatten)]
    sampling: SamplingArgs,
}

/// Bytes a decode step reads at context `ctx`, by part.
struct DecodeBytes {
    dense: f64,
    experts: f64,
    cache: f64,
}

/// Bytes of the dense weights a token reads on the device: every dense
/// matrix in BF16 (the embedding contributes one row unless tied to the
/// head), norms and small tensors in f32, NVFP4 tensors as stored.
fn dense_bytes(pack: &Pack) -> Result<f64> {
    let c = pack.config();
    let mut total = 0.0;
    let embedding = model_tensor_name(Role::Embedding);
    for t in &pack.manifest().tensors {
        if t.name.starts_with("mtp.") {
            continue; // The MTP head does not run in plain decode.
        }
        let v = pack.tensor(&t.name)?;
        let numel = v.numel() as f64;
        total += match v.data {
            _ if t.name == embedding && !c.tie_word_embeddings => 2.0 * c.hidden_size as f64,
            TensorData::Nvfp4(_) => numel * (0.5 + 1.0 / 16.0),
            _ if v.shape.len() >= 2 => 2.0 * numel,
            _ => 4.0 * numel,
        };
    }
    Ok(total)
}

fn decode_bytes(pack: &Pack, ctx: usize, kv_value_bytes: f64) -> Result<DecodeBytes> {
    let c = pack.config();
    let l = pack.layout();
    let per_expert = 3.0 * (l.codes_len() + l.scales_len()) as f64;
    let experts = (c.num_hidden_layers * c.num_experts_per_tok) as f64 * per_expert;
    // K and V of every position are read once (int8 with its scales); a
    // Gated DeltaNet layer's recurrent and conv state is read and written.
    let cache = (0..c.num_hidden_layers)
        .map(|l| {
            let passes = if c.is_full_attention(l) { 1.0 } else { 2.0 };
            passes * layer_state_bytes(c, l, ctx, kv_value_bytes) as f64
        })
        .sum();
    Ok(DecodeBytes { dense: dense_bytes(pack)?, experts, cache })
}

/// FLOPs of a prefill of `n` tokens from an empty session.
fn prefill_flops(pack: &Pack, n: usize) -> Result<f64> {
    let c = pack.config();
    let n = n as f64;
    let mut per_token = 0.0;
    for t in &pack.manifest().tensors {
        let v = pack.tensor(&t.name)?;
        let is_matrix = v.shape.len() >= 2 && !t.name.starts_with("mtp.");
        let is_edge = t.name.contains("embed_tokens") || t.name.contains("lm_head");
        if is_matrix && !is_edge && !t.name.contains("conv1d") {
            per_token += 2.0 * v.numel() as f64;
        }
    }
    let (h, i) = (c.hidden_size as f64, c.moe_intermediate_size as f64);
    per_token += 2.0 * 3.0 * h * i * (c.num_experts_per_tok * c.num_hidden_layers) as f64;
    let mut total = per_token * n + 2.0 * (c.vocab_size * c.hidden_size) as f64;
    for layer in 0..c.num_hidden_layers {
        if c.is_full_attention(layer) {
            // QK^T and PV over the causal triangle.
            total += 2.0 * 2.0 * (c.num_attention_heads * c.head_dim) as f64 * n * (n + 1.0) / 2.0;
        } else if let Some(s) = c.linear_attn() {
            // The delta rule: a few dk x dv products per token and head.
            total += 6.0 * (s.num_value_heads * s.key_head_dim * s.value_head_dim) as f64 * n;
        }
    }
    Ok(total)
}

/// The median (of an even count, the mean of the middle two).
fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 0 {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    } else {
        v[n / 2]
    }
}

/// `STRATA_PROFILE_DECODE=1`: the decode steps of the last repeat are marked
/// for a profiler started with collection off (`ncu --profile-from-start off`).
fn profile_decode() -> bool {
    std::env::var("STRATA_PROFILE_DECODE").is_ok_and(|v| v == "1")
}

#[cfg(feature = "cuda")]
fn profiler_collect(on: bool) -> Result<()> {
    strata::backend::cuda::profiler_collect(on)
}

#[cfg(not(feature = "cuda"))]
fn profiler_collect(_on: bool) -> Result<()> {
    Ok(())
}

/// The expert cache's counters over one phase (prefill or decode) of the
/// runs: bytes over the host link (copied, or read in place by mapped
/// decode), lookups, streamed experts, seconds.
#[derive(Default)]
struct CachePhase {
    bytes: u64,
    hits: u64,
    misses: u64,
    streamed: u64,
    prefetched: u64,
    seconds: f64,
    /// Each run's bytes over the host link per second.
    rates: Vec<f64>,
    /// Bytes copied (not read in place) and the link's time copying them
    /// (`ExpertStats::copy_ns`).
    copied: u64,
    copy_s: f64,
    /// Bytes read in place from page-locked host memory (mapped decode).
    mapped: u64,
}

impl CachePhase {
    fn add(&mut self, before: Option<ExpertStats>, after: Option<ExpertStats>, seconds: f64) {
        if let (Some(b), Some(a)) = (before, after) {
            self.bytes += (a.bytes_copied - b.bytes_copied) + (a.bytes_mapped - b.bytes_mapped);
            self.hits += a.hits - b.hits;
            self.misses += a.misses - b.misses;
            self.streamed += a.streamed - b.streamed;
            self.prefetched += a.prefetched - b.prefetched;
            self.seconds += seconds;
            let bytes = (a.bytes_copied - b.bytes_copied) + (a.bytes_mapped - b.bytes_mapped);
            self.rates.push(bytes as f64 / seconds);
            self.copied += a.bytes_copied - b.bytes_copied;
            self.copy_s += (a.copy_ns - b.copy_ns) as f64 / 1e9;
            self.mapped += a.bytes_mapped - b.bytes_mapped;
        }
    }

    fn hit_pct(&self) -> f64 {
        100.0 * self.hits as f64 / (self.hits + self.misses).max(1) as f64
    }
}

/// The measured ceilings of the device, when it is a GPU.
struct Ceilings {
    hbm: f64,
    bf16: f64,
    /// Page-locked host-to-device bandwidth, measured when the expert
    /// cache is on (the floor of what it copies).
    h2d: Option<f64>,
    /// Reads in place from page-locked host memory, measured with it (what
    /// mapped decode's kernels do with the experts in no slot).
    in_place: Option<f64>,
}

#[cfg(feature = "cuda")]
fn ceilings(device: &str, cache: bool) -> Result<Option<Ceilings>> {
    use strata::backend::cuda::{ceilings, Gpu};
    let ordinal = match strata::engine::Device::parse(device)? {
        strata::engine::Device::Cuda(n) => n as usize,
        strata::engine::Device::Cpu => return Ok(None),
    };
    let gpu = Gpu::open(ordinal)?;
    let hbm = ceilings::hbm_bandwidth(&gpu)?;
    let bf16 = ceilings::bf16_tensor_rate(&gpu)?;
    let (h2d, in_place) = if cache {
        (Some(ceilings::h2d_pinned_bandwidth(&gpu)?), Some(ceilings::host_read_in_place_bandwidth(&gpu)?))
    } else {
        (None, None)
    };
    let host = match (h2d, in_place) {
        (Some(c), Some(r)) => {
            format!(", pinned host-to-device {:.1} GB/s (copy), {:.1} GB/s (read in place)", c / 1e9, r / 1e9)
        }
        _ => String::new(),
    };
    eprintln!(
        "strata bench: {} measured: HBM copy {:.2} TB/s, BF16 tensor GEMM {:.0} TFLOP/s{host}",
        gpu.name(),
        hbm / 1e12,
        bf16 / 1e12,
    );
    Ok(Some(Ceilings { hbm, bf16, h2d, in_place }))
}

#[cfg(not(feature = "cuda"))]
fn ceilings(_device: &str, _cache: bool) -> Result<Option<Ceilings>> {
    Ok(None)
}

pub fn run(a: BenchArgs) -> Result<()> {
    if a.prompt_len == 0 || a.repeats == 0 {
        return Err(Error::InvalidArgument("--prompt-len and --repeats must be at least 1".into()));
    }
    #[cfg(all(feature = "test-hooks", feature = "cuda"))]
    if let Ok(skip) = std::env::var("STRATA_DECODE_SKIP") {
        let known = strata::engine::DECODE_SKIP_NAMES;
        if let Some(bad) = skip.split(',').find(|n| !n.is_empty() && !known.contains(n)) {
            return Err(Error::InvalidArgument(format!("STRATA_DECODE_SKIP: no kernel {bad:?} (one of {known:?})")));
        }
        eprintln!("strata bench: STRATA_DECODE_SKIP={skip}: decode steps leave those kernels out (timing only)");
    }
    // Bad arguments fail before the ceilings are measured and the model loads.
    a.cache.check()?;
    let sampler = a.sampling.sampler()?;
    let ceil = ceilings(a.device.first().map_or("cpu", String::as_str), a.cache.options().enabled())?;
    let t = Instant::now();
    let opts = a.split.engine_options(a.threads, &a.device, &a.cache, a.precision);
    let engine = super::load_engine(&a.pack, &opts)?;
    let c: ModelConfig = engine.config().clone();
    eprintln!(
        "strata bench: loaded {} on {} in {:.1} s",
        a.pack.display(),
        engine.backend_name(),
        t.elapsed().as_secs_f64()
    );
    if let Some(line) = tiers_line(&engine.expert_tiers()) {
        eprintln!("strata bench: {line}");
    }
    // The CPU keeps f32 (its int8 and bf16 caches emulate the GPU's, for tests).
    let cpu = engine.backend_name() == "cpu";
    let kv = if cpu {
        KvArg::F32
    } else if a.kv == KvArg::Auto {
        KvArg::Int8
    } else {
        a.kv
    };
    let kv_bytes = match kv {
        KvArg::Int8 | KvArg::Auto => 1.0,
        KvArg::Bf16 => 2.0,
        KvArg::F32 => 4.0,
    };
    let kv_type = if cpu { KvType::Auto } else { kv.kv_type() };
    let sopts = SessionOptions {
        prefill_chunk: a.chunk,
        context_size: (a.prompt_len + a.gen + 1).min(c.max_position_embeddings),
        kv_type,
        ..Default::default()
    };
    let mut rng = Rng::new(7);
    let prompt: Vec<u32> = (0..a.prompt_len).map(|_| (rng.next_u64() % c.vocab_size as u64) as u32).collect();
    let (mut prefill_s, mut step_s, mut mean_s) = (Vec::new(), Vec::new(), Vec::new());
    // The expert cache's counters over each phase, summed over the runs.
    let (mut prefill_cache, mut decode_cache) = (CachePhase::default(), CachePhase::default());
    for r in 0..a.repeats {
        let mut s = engine.new_session(&sopts)?;
        let before = engine.expert_stats();
        let t = Instant::now();
        s.prefill(&prompt)?;
        let p = t.elapsed().as_secs_f64();
        prefill_cache.add(before, engine.expert_stats(), p);
        let before = engine.expert_stats();
        let mut sampler = sampler.clone();
        let profile = profile_decode() && r + 1 == a.repeats;
        if profile {
            profiler_collect(true)?;
        }
        let t = Instant::now();
        for _ in 0..a.gen {
            let ts = Instant::now();
            s.step(&mut sampler)?;
            step_s.push(ts.elapsed().as_secs_f64());
        }
        let d = t.elapsed().as_secs_f64();
        decode_cache.add(before, engine.expert_stats(), d);
        if profile {
            profiler_collect(false)?;
        }
        eprintln!(
            "strata bench: run {}: prefill {:.3} s ({:.0} tok/s), decode {} tokens {:.3} s ({:.1} tok/s; {} drawn \
             on the device)",
            r + 1,
            p,
            a.prompt_len as f64 / p,
            a.gen,
            d,
            a.gen as f64 / d.max(1e-9),
            s.device_draws()
        );
        prefill_s.push(p);
        if a.gen > 0 {
            mean_s.push(d / a.gen as f64);
        }
    }
    let prefill = median(&mut prefill_s);
    let flops = prefill_flops(engine.pack(), a.prompt_len)?;
    let mut line = format!(
        "prefill {} tokens: {:.0} tok/s ({:.3} s, median of {}), {:.2} TFLOP",
        a.prompt_len,
        a.prompt_len as f64 / prefill,
        prefill,
        a.repeats,
        flops / 1e12
    );
    if let Some(cl) = &ceil {
        let floor = flops / cl.bf16;
        line += &format!(
            "; floor {:.3} s ({:.0} tok/s at {:.0} TFLOP/s measured): {:.1}% of the floor, {:.0} TFLOP/s achieved",
            floor,
            a.prompt_len as f64 / floor,
            cl.bf16 / 1e12,
            100.0 * floor / prefill,
            flops / prefill / 1e12
        );
    }
    println!("{line}");
    if let (Some(h2d), true) = (ceil.as_ref().and_then(|c| c.h2d), prefill_cache.bytes > 0) {
        // A run's copies over its prefill's time; the median run's, as for
        // the prefill time (the first run's also holds one-time costs).
        let rate = median(&mut prefill_cache.rates.clone());
        let mean = prefill_cache.bytes as f64 / prefill_cache.seconds;
        println!(
            "prefill expert copies: {:.1} MB per prefill, {:.1} GB/s over the prefill (median of {}; {:.1}% of \
             {:.1} GB/s measured pinned host-to-device; all runs together {:.1} GB/s); {:.1}% hits, {} streamed \
             ({} prefetched)",
            prefill_cache.bytes as f64 / 1e6 / a.repeats as f64,
            rate / 1e9,
            prefill_cache.rates.len(),
            100.0 * rate / h2d,
            h2d / 1e9,
            mean / 1e9,
            prefill_cache.hit_pct(),
            prefill_cache.streamed / a.repeats as u64,
            prefill_cache.prefetched / a.repeats as u64
        );
        if prefill_cache.copy_s > 0.0 {
            // The link's rate while it streams: the copies' bytes over the time it spent on them.
            let rate = prefill_cache.copied as f64 / prefill_cache.copy_s;
            println!(
                "prefill expert copies while streaming: {:.1} GB/s ({:.1}% of the measured {:.1} GB/s), the link \
                 busy {:.0}% of the prefill",
                rate / 1e9,
                100.0 * rate / h2d,
                h2d / 1e9,
                100.0 * prefill_cache.copy_s / prefill_cache.seconds
            );
        }
    }
    if !step_s.is_empty() {
        let step = median(&mut step_s);
        let mean = median(&mut mean_s);
        let ctx = a.prompt_len + a.gen / 2;
        let b = decode_bytes(engine.pack(), ctx, kv_bytes)?;
        let bytes = b.dense + b.experts + b.cache;
        let mut line = format!(
            "decode at batch 1: {:.1} tok/s ({:.2} ms/token, median of {} x {} steps; a run's mean step, its \
             first (CUDA-graph capture) included, {:.2} ms), {:.1} MB/token (dense {:.1}, experts {:.1}, KV/state {:.1} at context {ctx})",
            1.0 / step,
            step * 1e3,
            a.repeats,
            a.gen,
            mean * 1e3,
            bytes / 1e6,
            b.dense / 1e6,
            b.experts / 1e6,
            b.cache / 1e6
        );
        if let Some(cl) = &ceil {
            let floor = bytes / cl.hbm;
            line += &format!(
                "; floor {:.3} ms ({:.0} tok/s at {:.2} TB/s measured): {:.1}% of the floor, {:.2} TB/s achieved",
                floor * 1e3,
                1.0 / floor,
                cl.hbm / 1e12,
                100.0 * floor / step,
                bytes / step / 1e12
            );
        }
        let p = a.sampling.params();
        if !p.is_greedy() {
            line += &format!(
                "; sampled (temperature {}, top-k {}, top-p {}, min-p {})",
                p.temperature, p.top_k, p.top_p, p.min_p
            );
        }
        println!("{line}");
        if let (Some(cl), Some(h2d), Some(_)) = (&ceil, ceil.as_ref().and_then(|c| c.h2d), engine.expert_stats()) {
            // Floor with the cache: what was resident read at HBM speed,
            // what was missed copied at the pinned host-to-device rate.
            let tokens = (a.gen * a.repeats) as f64;
            let missed = decode_cache.bytes as f64 / tokens;
            let floor = (bytes - missed.min(b.experts)) / cl.hbm + missed / h2d;
            let mut line = format!(
                "decode with the expert cache: {:.1}% hits, {:.1} MB missed per token; floor {:.3} ms (resident \
                 bytes at {:.2} TB/s + missed bytes at {:.1} GB/s): {:.2}x the floor",
                decode_cache.hit_pct(),
                missed / 1e6,
                floor * 1e3,
                cl.hbm / 1e12,
                h2d / 1e9,
                step / floor
            );
            if let (Some(r), true) = (cl.in_place, decode_cache.mapped > 0) {
                // Mapped decode reads its misses in place: the same floor at the measured rate of that.
                let read = decode_cache.mapped as f64 / tokens;
                let at = floor - read.min(missed) / h2d + read.min(missed) / r;
                line += &format!(
                    "; {:.1} MB a token read in place: at {:.1} GB/s measured in place, {:.3} ms, {:.2}x",
                    read / 1e6,
                    r / 1e9,
                    at * 1e3,
                    step / at
                );
            }
            println!("{line}");
        }
    }
    if let Some(stats) = engine.expert_stats() {
        println!("{}", stats_line(&stats));
    }
    if let Some(stats) = engine.split_stats() {
        println!("{} (all {} runs)", split_line(&stats), a.repeats);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::median;

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        // Two runs: their mean, not the slower one.
        assert_eq!(median(&mut [0.5, 0.25]), 0.375);
        assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), 2.5);
    }
}
