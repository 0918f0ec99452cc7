//! The engine: a loaded pack, its dense weights decoded for the backend, and
//! the forward pass of qwen3_moe (transformers `Qwen3MoeForCausalLM`):
//!
//! ```text
//! x = embed[token]
//! per layer:  h = rmsnorm(x);  q, k, v = proj(h);  q, k = per-head rmsnorm
//!             rope(q, k);  append k, v to the KV cache;  x += o_proj(attention)
//!             h = rmsnorm(x);  x += moe(h)
//! logits = lm_head(rmsnorm(x))
//! ```
//!
//! qwen3_next (`Qwen3NextForCausalLM`) runs in the same forward, branching
//! per layer: zero-centered norms (`1 + w`, folded into the weights at load),
//! gated full attention (q_proj emits `[q | gate]` per head, partial rotary,
//! `o_proj(attn * sigmoid(gate))`) or a Gated DeltaNet whose state lives in
//! the session's cache, and the shared expert
//! `sigmoid(h . shared_expert_gate) * shared_expert(h)` added to the routed
//! experts. MTP weights are not used.
//!
//! Every op goes through the `Backend`; the MoE block is `moe::forward`.
//! `Engine` is a cheap handle (an `Arc`); sessions hold one each.

#[cfg(feature = "cuda")]
pub(crate) mod gpu;
mod host_logits;
#[cfg(feature = "cuda")]
pub use gpu::DECODE_SKIP_NAMES;
#[cfg(test)]
pub(crate) mod test_pack;

use std::ops::Range;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Instant;

use rayon::prelude::*;

use crate::backend::cpu::next_ops::{sigmoid, split_q_gate};
use crate::backend::cpu::ops::silu;
use crate::backend::{
    AttentionShape, Backend, CpuBackend, DeltaNetShape, ExpertRows, GatedDeltaNetWeights, Matrix, Rope,
};
use crate::error::{Error, Result};
use crate::experts::{CpuExpertCache, ExpertCacheOptions, ExpertProfile, ExpertStats};
use crate::model::weights::{layer_tensor_name, model_tensor_name, Role};
use crate::model::ModelConfig;
use crate::moe::{self, MoeLayer};
use crate::pack::{ExpertView, Pack, TensorData};
use crate::sampling::DrawAhead;
use crate::session::kv::{Cache, KvCache, KvRounding, StageKv};
use crate::session::{KvType, Session, SessionOptions};
pub(crate) use host_logits::HostLogits;

#[derive(Clone, Debug, Default)]
pub struct EngineOptions {
    /// Threads of a dedicated pool for this engine's work; `None` shares
    /// rayon's global pool.
    pub threads: Option<usize>,
    /// Devices to run on, as `Device::parse` reads them; empty = `["cpu"]`.
    /// Several devices split the layers into stages, one per device, in
    /// list order (docs/layer-split.md), all CPU or all CUDA:
    /// `["cpu", "cpu"]` = two CPU stages, each with its own thread pool,
    /// `threads` divided between them; `["cuda:0", "cuda:1"]` = two GPUs;
    /// `["cuda:0", "cuda:0"]` = two logical devices on one GPU (a stream
    /// each).
    pub devices: Vec<String>,
    /// With several devices: the first layer of each stage after the first
    /// (`[2]` on two devices = layers `0..2` and `2..`); strictly
    /// increasing, inside `1..num_hidden_layers`, one per extra device.
    /// `None` divides the layers evenly (earlier stages take the remainder).
    pub layer_split: Option<Vec<usize>>,
    /// With several devices and no `layer_split`: each device's memory
    /// budget in bytes, one per device; the split is chosen so that every
    /// stage's layers fit its budget, as evenly filled as they can be
    /// (`stage_layers_by_budget`). On CPU devices (one host memory) the
    /// budgets only choose the split.
    pub stage_memory: Option<Vec<u64>>,
    /// With `stage_memory`: each stage's budget also holds one session's
    /// KV cache of its attention layers for this many tokens (at the
    /// device's default KV: int8 with its scales on CUDA, f32 on the CPU)
    /// and its Gated DeltaNet layers' recurrent and conv states
    /// (`layer_state_bytes`); 0 (default): the weights alone.
    pub stage_memory_context: usize,
    /// Whether an idle stage helps with the expert rows of the active
    /// stage's MoE layers during prefill (needs several devices).
    pub prefill_help: Help,
    /// Recompute every checksum of the pack while loading (`Pack::verify`).
    pub verify_checksums: bool,
    /// How a CUDA device rounds activations in its tensor-core products.
    pub gpu_precision: GpuPrecision,
    /// Expert slots, host buffers and the prefill ring (docs/expert-cache.md);
    /// the default is off: every expert read from the mapped pack. CPU only
    /// for now.
    pub expert_cache: ExpertCacheOptions,
}

/// Prefill help: an idle stage computes a share of the active layer's
/// expert rows through the same MoE pipeline (`moe::HelpedCompute`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Help {
    /// Help when a forward has at least `HELP_AUTO_MIN_ROWS` rows (a
    /// prefill chunk, not a decode step) and there is another stage idle:
    /// a prefill of one piece (several pieces on CPU stages run pipelined,
    /// every stage busy, unhelped).
    #[default]
    Auto,
    /// Help on every forward of a split engine, whatever its rows (and no
    /// pipelined windows: help needs an idle stage).
    On,
    /// Never help.
    Off,
}

/// The rows from which `Help::Auto` helps: below it the hand-over costs
/// more than the rows it moves (a decode step has one row per sequence).
pub const HELP_AUTO_MIN_ROWS: usize = 64;

impl Help {
    /// `"auto"`, `"on"` or `"off"`.
    pub fn parse(s: &str) -> Result<Help> {
        match s {
            "auto" => Ok(Help::Auto),
            "on" => Ok(Help::On),
            "off" => Ok(Help::Off),
            _ => Err(Error::InvalidArgument(format!("prefill help {s:?} is not one of auto, on, off"))),
        }
    }

    /// Whether a forward of `rows` rows on an engine of `stages` stages is helped.
    pub fn applies(self, stages: usize, rows: usize) -> bool {
        stages > 1
            && match self {
                Help::Auto => rows >= HELP_AUTO_MIN_ROWS,
                Help::On => true,
                Help::Off => false,
            }
    }
}

/// The layers of each stage: `split` holds the first layer of every stage
/// after the first (`None`: the layers divided evenly, earlier stages
/// taking the remainder). Refuses with `Error::InvalidArgument` a split
/// that is not one point per extra stage, strictly increasing, inside
/// `1..layers`.
pub fn stage_layers(layers: usize, stages: usize, split: Option<&[usize]>) -> Result<Vec<Range<usize>>> {
    assert!(stages >= 1, "stage_layers: no stage");
    if stages > layers {
        return Err(Error::InvalidArgument(format!("{stages} devices for {layers} layers: a stage needs a layer")));
    }
    let starts: Vec<usize> = match split {
        None => {
            let (base, extra) = (layers / stages, layers % stages);
            (1..stages).map(|s| s * base + s.min(extra)).collect()
        }
        Some(points) => {
            if points.len() != stages - 1 {
                return Err(Error::InvalidArgument(format!(
                    "layer split {points:?}: {} point(s) for {stages} device(s), one per device after the first",
                    points.len()
                )));
            }
            let mut prev = 0;
            for &p in points {
                if p <= prev || p >= layers {
                    return Err(Error::InvalidArgument(format!(
                        "layer split {points:?}: each point must be a layer in 1..{layers}, strictly increasing"
                    )));
                }
                prev = p;
            }
            points.to_vec()
        }
    };
    let mut bounds = vec![0];
    bounds.extend(starts);
    bounds.push(layers);
    Ok(bounds.windows(2).map(|w| w[0]..w[1]).collect())
}

/// What a stage holds, in bytes as the pack stores it: per layer its dense
/// tensors and all its experts' blobs (every expert resident); then what
/// the first stage adds (the embedding) and the last (final norm, LM head).
pub fn stage_bytes(pack: &Pack) -> Result<(Vec<u64>, u64, u64)> {
    let c = pack.config();
    let mut layers = vec![0u64; c.num_hidden_layers];
    let (mut first, mut last) = (0u64, 0u64);
    let embed = crate::model::weights::model_tensor_name(crate::model::weights::Role::Embedding);
    for t in &pack.manifest().tensors {
        // NVFP4: the codes, and one E4M3 scale per 16 values.
        let bytes = t.nbytes + if t.scales_offset.is_some() { t.numel() / 16 } else { 0 };
        let layer = t
            .name
            .strip_prefix("model.layers.")
            .and_then(|rest| rest.split('.').next())
            .and_then(|l| l.parse::<usize>().ok());
        match layer {
            Some(l) if l < layers.len() => layers[l] += bytes,
            Some(_) => {}
            None if t.name.starts_with("mtp.") => {} // the MTP head (speculative decoding) is not staged yet
            None if t.name == embed => {
                first += bytes;
                if c.tie_word_embeddings {
                    last += bytes; // the head reads it too
                }
            }
            None => last += bytes,
        }
    }
    for (l, b) in layers.iter_mut().enumerate() {
        *b += pack.expert_layer_bytes(l)?.len() as u64;
    }
    Ok((layers, first, last))
}

/// Bytes of one session's state of `layer` at `context` tokens: an
/// attention layer's K and V (`value_bytes` per value; below 2, int8, with
/// one f32 scale per position and head), a Gated DeltaNet layer's recurrent
/// state and conv state (f32, whatever the context). 0 at context 0.
pub fn layer_state_bytes(c: &ModelConfig, layer: usize, context: usize, value_bytes: f64) -> u64 {
    if context == 0 {
        return 0;
    }
    if c.is_full_attention(layer) {
        let scale = if value_bytes < 2.0 { 4.0 / c.head_dim as f64 } else { 0.0 };
        (2.0 * (context * c.kv_dim()) as f64 * (value_bytes + scale)).ceil() as u64
    } else if let Some(s) = c.linear_attn() {
        let state = s.num_value_heads * s.key_head_dim * s.value_head_dim;
        4 * (state + (s.conv_kernel - 1) * s.conv_dim()) as u64
    } else {
        0
    }
}

/// Each stage's memory budget less its expert cache's device memory (the
/// VRAM budget, or the slots and the ring), refusing a budget below it.
fn cache_left(pack: &Pack, o: &crate::experts::ExpertCacheOptions, budgets: &[u64]) -> Result<Vec<u64>> {
    let stride = pack.layout().stride;
    let c = pack.config();
    let slots = o.slots.unwrap_or(0);
    // The ring of the whole model's cache: no stage's (fewer pairs) is larger.
    let ring = o.ring_slots.unwrap_or_else(|| {
        let pairs = c.num_hidden_layers * c.num_experts;
        crate::experts::default_ring(c.num_experts, pairs, c.num_experts_per_tok, Some(slots), None)
    });
    let need = o.vram_budget.unwrap_or((slots + ring) as u64 * stride);
    budgets
        .iter()
        .map(|&b| {
            b.checked_sub(need).ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "stage_memory: a budget of {:.1} MiB is below the expert cache's {:.1} MiB on each device",
                    b as f64 / 1048576.0,
                    need as f64 / 1048576.0
                ))
            })
        })
        .collect()
}

/// The layers of each stage from per-device memory budgets: contiguous
/// ranges, at least one layer each, every stage's bytes (its layers, plus
/// `first` on the first stage and `last` on the last) within its budget,
/// minimizing the fullest stage's fraction of its budget (ties: the earlier
/// cut). Refuses with `Error::InvalidArgument` naming the budgets and the
/// need when no split fits.
pub fn stage_layers_by_budget(
    layer_bytes: &[u64],
    first: u64,
    last: u64,
    budgets: &[u64],
) -> Result<Vec<Range<usize>>> {
    let (n, stages) = (layer_bytes.len(), budgets.len());
    if stages == 0 || stages > n {
        return Err(Error::InvalidArgument(format!(
            "{stages} memory budget(s) for {n} layers: one per device, a stage needs a layer"
        )));
    }
    let mut prefix = vec![0u64; n + 1];
    for (i, b) in layer_bytes.iter().enumerate() {
        prefix[i + 1] = prefix[i] + b;
    }
    let fill = |s: usize, a: usize, b: usize| {
        let extra = if s == 0 { first } else { 0 } + if s + 1 == stages { last } else { 0 };
        (prefix[b] - prefix[a] + extra) as f64 / budgets[s].max(1) as f64
    };
    // best[s][e]: the lowest fullest fraction of stages 0..=s over layers 0..e, and the start of stage s.
    let mut best = vec![vec![(f64::INFINITY, 0usize); n + 1]; stages];
    for (e, b) in best[0].iter_mut().enumerate().skip(1) {
        *b = (fill(0, 0, e), 0);
    }
    for s in 1..stages {
        for e in s + 1..=n {
            for a in s..e {
                let v = best[s - 1][a].0.max(fill(s, a, e));
                if v < best[s][e].0 {
                    best[s][e] = (v, a);
                }
            }
        }
    }
    let mut bounds = vec![n];
    for s in (1..stages).rev() {
        bounds.push(best[s][*bounds.last().expect("pushed")].1);
    }
    bounds.push(0);
    bounds.reverse();
    let ranges: Vec<Range<usize>> = bounds.windows(2).map(|w| w[0]..w[1]).collect();
    if best[stages - 1][n].0 > 1.0 {
        let need: Vec<String> = ranges
            .iter()
            .enumerate()
            .map(|(s, r)| format!("{:.1} MiB", fill(s, r.start, r.end) * budgets[s] as f64 / 1048576.0))
            .collect();
        let have: Vec<String> = budgets.iter().map(|b| format!("{:.1} MiB", *b as f64 / 1048576.0)).collect();
        return Err(Error::InvalidArgument(format!(
            "memory budgets [{}] do not hold the model's {:.1} MiB of layers: the best split {:?} needs [{}]",
            have.join(", "),
            (prefix[n] + first + last) as f64 / 1048576.0,
            &bounds[1..stages],
            need.join(", ")
        )));
    }
    Ok(ranges)
}

/// How the GPU rounds activations in its tensor-core products (the
/// projections, experts and attention of rows beyond 8, i.e. prefill;
/// decode rows go through f32 GEMVs either way). Ignored on the CPU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GpuPrecision {
    /// Each activation as two bf16 (hi + lo), about 16 significant bits:
    /// what the GPU suite holds to the CPU reference.
    #[default]
    Accurate,
    /// Each activation rounded to one bf16: fewer tensor-core products
    /// (real models tolerate it; tiny random ones are too chaotic to
    /// compare).
    Fast,
}

/// A device the engine can be asked to run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    Cpu,
    /// `cuda` (device 0) or `cuda:N`.
    Cuda(u32),
}

impl Device {
    /// `"cpu"`, `"cuda"` or `"cuda:N"`; anything else is an invalid argument.
    pub fn parse(name: &str) -> Result<Device> {
        let bad = || Error::InvalidArgument(format!("device {name:?} is not one of \"cpu\", \"cuda\", \"cuda:N\""));
        match name {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            _ => {
                let n = name.strip_prefix("cuda:").ok_or_else(bad)?;
                if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
                    return Err(bad());
                }
                n.parse().map(Device::Cuda).map_err(|_| bad())
            }
        }
    }

    /// Parses a device list and checks that this build can run on it: the
    /// CPU (the default when the list is empty), or one or more devices of
    /// one kind (several: a layer split; a CUDA ordinal may repeat, two
    /// logical devices on one GPU). CPU and CUDA stages in one split are
    /// refused with `Error::Unsupported`. A CUDA device is probed (driver
    /// library, device count, ordinal, cuBLAS) and refused with `Error::NoCuda`
    /// naming the cause; a build without the `cuda` feature refuses every
    /// CUDA device so.
    pub fn parse_list(names: &[String]) -> Result<Vec<Device>> {
        let devices = names.iter().map(|n| Device::parse(n)).collect::<Result<Vec<_>>>()?;
        if devices.contains(&Device::Cpu) && devices.iter().any(|d| *d != Device::Cpu) {
            return Err(Error::Unsupported(format!(
                "devices {names:?}: a layer split runs on CPU devices or on CUDA devices, not both (a \
                 hand-off between the CPU and a GPU is not built)"
            )));
        }
        for d in &devices {
            if let Device::Cuda(ordinal) = *d {
                #[cfg(feature = "cuda")]
                crate::backend::cuda::probe(ordinal as usize)?;
                #[cfg(not(feature = "cuda"))]
                {
                    let _ = ordinal;
                    return Err(Error::NoCuda("this build has no CUDA support (feature cuda)".into()));
                }
            }
        }
        Ok(if devices.is_empty() { vec![Device::Cpu] } else { devices })
    }
}

/// One CPU stage per layer range. One stage keeps `threads` as given
/// (`None`: rayon's global pool); several divide `threads` (default: the
/// machine's cores) between dedicated pools, earlier stages taking the
/// remainder, at least one thread each.
fn cpu_stages(ranges: Vec<Range<usize>>, threads: Option<usize>) -> Result<Vec<CpuStage>> {
    if ranges.len() == 1 {
        let layers = ranges.into_iter().next().expect("one range");
        return Ok(vec![CpuStage { backend: CpuBackend::new(threads)?, layers }]);
    }
    let n = ranges.len();
    let total = match threads {
        Some(0) => return Err(Error::InvalidArgument("threads 0: a thread pool needs at least one thread".into())),
        Some(t) => t,
        None => std::thread::available_parallelism().map_or(1, |p| p.get()),
    };
    ranges
        .into_iter()
        .enumerate()
        .map(|(i, layers)| {
            let own = (total / n + usize::from(i < total % n)).max(1);
            Ok(CpuStage { backend: CpuBackend::new(Some(own))?, layers })
        })
        .collect()
}

/// The stage that helps stage `active` and the prior of the share of expert
/// rows it takes (`HelpRates` refines it from measured speeds): the other
/// stage with the most threads (the nearest after `active` on ties), its
/// share its fraction of the two stages' threads (CPU stages of one machine
/// run at about the same speed per thread).
fn helper_of(stages: &[CpuStage], active: usize) -> (usize, &dyn Backend, f64) {
    let n = stages.len();
    let helper = (1..n)
        .map(|d| (active + d) % n)
        .max_by_key(|&i| (stages[i].backend.threads(), std::cmp::Reverse((i + n - active) % n)))
        .expect("a split has another stage");
    let (a, h) = (stages[active].backend.threads() as f64, stages[helper].backend.threads() as f64);
    (helper, &stages[helper].backend, h / (a + h))
}

/// The engine's model of its stages' speeds for prefill help: the expert
/// rows per second each stage computed in helped MoE steps (its own part
/// as the active stage, or the rest as the helper), smoothed over steps.
/// Once both stages of a pair are measured, the helper's share is its
/// fraction of their summed speed, within HELP_SHARE_BOUNDS (so both keep
/// being measured); before that, the prior. The share decides only which
/// device computes a row, never its value: logits do not depend on it.
#[derive(Clone, Debug, Default)]
struct HelpRates {
    rates: Vec<Option<f64>>,
}

/// Weight of a new measurement in a stage's smoothed speed.
const HELP_RATE_SMOOTHING: f64 = 0.25;
/// Bounds of a measured share.
const HELP_SHARE_BOUNDS: (f64, f64) = (0.05, 0.95);
/// Fewest rows a side must compute for its time to count (fewer: fixed costs dominate).
const HELP_MIN_ROWS: usize = 16;

impl HelpRates {
    fn new(stages: usize) -> HelpRates {
        HelpRates { rates: vec![None; stages] }
    }

    /// Stage `stage` computed `rows` expert rows in `seconds`.
    fn observe(&mut self, stage: usize, rows: usize, seconds: f64) {
        if rows < HELP_MIN_ROWS || seconds <= 0.0 || !seconds.is_finite() {
            return;
        }
        let r = rows as f64 / seconds;
        let slot = &mut self.rates[stage];
        *slot = Some(match *slot {
            Some(old) => old + HELP_RATE_SMOOTHING * (r - old),
            None => r,
        });
    }

    /// The share of rows `helper` takes from `active`.
    fn share(&self, active: usize, helper: usize, prior: f64) -> f64 {
        match (self.rates[active], self.rates[helper]) {
            (Some(a), Some(h)) => (h / (a + h)).clamp(HELP_SHARE_BOUNDS.0, HELP_SHARE_BOUNDS.1),
            _ => prior,
        }
    }

    fn rate(&self, stage: usize) -> Option<f64> {
        self.rates[stage]
    }
}

/// Fractions of a load at which each phase ends; the rest is decoding the
/// dense weights (one step per layer, then the embedding and head).
const PROGRESS_OPENED: f32 = 0.05;
const PROGRESS_VERIFIED: f32 = 0.5;
/// The smallest progress step reported (callbacks may be slow).
const PROGRESS_STEP: f32 = 0.001;

/// Reports load progress to a callback, monotonically and not too often;
/// the callback returning false cancels the load.
struct LoadProgress<'a> {
    callback: &'a mut dyn FnMut(f32) -> bool,
    last: Option<f32>,
}

impl LoadProgress<'_> {
    fn report(&mut self, fraction: f32) -> Result<()> {
        let f = fraction.clamp(self.last.unwrap_or(0.0), 1.0);
        if self.last.is_some_and(|last| f < 1.0 && f - last < PROGRESS_STEP) {
            return Ok(());
        }
        self.last = Some(f);
        if (self.callback)(f) {
            Ok(())
        } else {
            Err(Error::Cancelled)
        }
    }
}

/// A loaded model. Clone is cheap and clones share everything.
#[derive(Clone)]
pub struct Engine {
    inner: Arc<Inner>,
}

struct Inner {
    pack: Pack,
    exec: Exec,
    rope: Rope,
    /// The CPU expert cache, when `EngineOptions::expert_cache` asks for one.
    experts: Option<parking_lot::Mutex<CpuExpertCache>>,
    prefill_help: Help,
    /// What the stages of a layer split did (`None` on one device).
    split: Option<parking_lot::Mutex<SplitStats>>,
    /// The stages' measured speeds for prefill help (a split only).
    help_rates: parking_lot::Mutex<HelpRates>,
    /// Tests: layers left to run before a forward fails.
    #[cfg(test)]
    fail_after_layers: std::sync::Mutex<Option<usize>>,
    /// Tests: `(layer, position)` whose hidden state gets a NaN at the end
    /// of that layer, once.
    #[cfg(any(test, feature = "test-hooks"))]
    nan_at: std::sync::Mutex<Option<(usize, usize)>>,
}

/// What runs the forward pass: the CPU reference (f32 weights decoded at
/// load, every op through `Backend`) on one or more stages, or one CUDA
/// device (`gpu::GpuModel`: weights resident in device memory, the same
/// math in kernels).
enum Exec {
    Cpu {
        /// One stage per device, in layer order; one stage without a split.
        stages: Vec<CpuStage>,
        weights: Weights,
    },
    #[cfg(feature = "cuda")]
    Cuda(Box<gpu::GpuModel>),
}

/// A stage of the CPU forward: its own backend (thread pool) runs its
/// layers. The layers' dense weights, KV and recurrent state are host
/// memory the stage reads by layer index; a GPU stage will hold only its
/// range in device memory.
struct CpuStage {
    backend: CpuBackend,
    layers: Range<usize>,
}

/// What a layer split did since load (`Engine::split_stats`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SplitStats {
    /// Per stage, in layer order.
    pub stages: Vec<StageStats>,
    /// Hidden-state hand-offs from one stage to the next (one per window
    /// per stage boundary), their bytes and the time they took.
    pub handoffs: u64,
    pub handoff_bytes: u64,
    pub handoff_seconds: f64,
    /// MoE layers computed with prefill help, and the expert rows the
    /// helping stage computed in them.
    pub helped_layers: u64,
    pub helper_rows: u64,
    /// Prompt pieces run with pipelined windows (stages overlapping on
    /// consecutive pieces).
    pub pipelined_windows: u64,
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct StageStats {
    pub layers: Range<usize>,
    /// The stage's CPU threads (0 for a CUDA stage).
    pub threads: usize,
    /// Time spent running this stage's layers (its own, not helping; on a
    /// CUDA stage the device time between events around them).
    pub seconds: f64,
    /// Expert rows per second this stage computed in helped MoE steps
    /// (smoothed; `None` until measured): the speeds prefill help's share
    /// follows.
    pub expert_rows_per_second: Option<f64>,
}

/// Dense weights in f32, decoded once at load. Experts stay in the pack.
struct Weights {
    embed: Matrix,
    layers: Vec<LayerWeights>,
    final_norm: Vec<f32>,
    /// `None` when tied to the embedding.
    lm_head: Option<Matrix>,
}

struct LayerWeights {
    /// Norm weights as applied: `1 + w` already for zero-centered norms.
    input_norm: Vec<f32>,
    mixer: Mixer,
    post_attn_norm: Vec<f32>,
    router: Matrix,
    /// qwen3_next's shared expert.
    shared: Option<SharedExpert>,
}

/// The token mixer of a layer: full attention (gated for qwen3_next) or a
/// Gated DeltaNet.
enum Mixer {
    Attention {
        q_proj: Matrix,
        k_proj: Matrix,
        v_proj: Matrix,
        o_proj: Matrix,
        q_norm: Vec<f32>,
        k_norm: Vec<f32>,
    },
    Linear {
        in_proj_qkvz: Matrix,
        in_proj_ba: Matrix,
        conv1d: Vec<f32>,
        dt_bias: Vec<f32>,
        a_log: Vec<f32>,
        norm: Vec<f32>,
        out_proj: Matrix,
    },
}

/// `sigmoid(x . gate) * mlp(x)`, added to the routed experts' output.
struct SharedExpert {
    /// `[1, hidden]`.
    gate: Matrix,
    mlp: SharedMlp,
}

enum SharedMlp {
    /// NVFP4 in the pack (the converter's layout): run by the experts' own
    /// `Backend::expert_ffn`, global scales included, from these tensors.
    Nvfp4 { gate: String, up: String, down: String },
    /// Stored dense (BF16/F32): decoded once.
    Dense { gate: Matrix, up: Matrix, down: Matrix },
}

/// A piece of a prompt for `Engine::forward_pieces`: its tokens and the
/// logits it needs.
pub(crate) struct Piece<'a> {
    pub tokens: &'a [u32],
    pub want: Logits,
}

impl Piece<'_> {
    /// Rows of logits this piece returns.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn rows(&self) -> usize {
        self.want.rows(self.tokens.len())
    }
}

/// Hidden states that may wait between two pipelined stages (a stage runs
/// at most this many pieces ahead of the next).
const PIPELINE_DEPTH: usize = 1;

/// What one stage's thread did in `forward_pipelined`.
#[derive(Default)]
struct StageRun {
    /// Pieces it completed (the last stage: pieces with logits).
    done: usize,
    /// The last stage: the logits of each completed piece.
    logits: Vec<Vec<f32>>,
    /// The piece that failed here, and why.
    error: Option<(usize, Error)>,
    seconds: f64,
    handoffs: u64,
    handoff_bytes: u64,
    handoff_seconds: f64,
}

/// Which rows of a forward need logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Logits {
    /// None (a prompt chunk that is not the last).
    Skip,
    Last,
    All,
}

impl Logits {
    /// Rows of logits of a forward of `t` rows (the last ones).
    pub(crate) fn rows(self, t: usize) -> usize {
        match self {
            Logits::Skip => 0,
            Logits::Last => 1,
            Logits::All => t,
        }
    }
}

fn load_matrix(pack: &Pack, name: &str, rows: usize, cols: usize) -> Result<Matrix> {
    let t = pack.tensor(name)?;
    if t.shape != [rows as u64, cols as u64] {
        return Err(Error::tensor(name, format!("shape {:?}, the engine needs [{rows}, {cols}]", t.shape)));
    }
    Ok(Matrix::new(rows, cols, t.to_f32()))
}

fn load_vector(pack: &Pack, name: &str, len: usize) -> Result<Vec<f32>> {
    let t = pack.tensor(name)?;
    if t.shape != [len as u64] {
        return Err(Error::tensor(name, format!("shape {:?}, the engine needs [{len}]", t.shape)));
    }
    Ok(t.to_f32())
}

impl LayerWeights {
    fn load(pack: &Pack, l: usize) -> Result<LayerWeights> {
        let c = pack.config();
        let h = c.hidden_size;
        let n = |role| layer_tensor_name(l, role);
        let norm = |role, len| -> Result<Vec<f32>> {
            let mut w = load_vector(pack, &n(role), len)?;
            if c.arch.zero_centered_norms() {
                w.iter_mut().for_each(|v| *v += 1.0);
            }
            Ok(w)
        };
        let mixer = if c.is_full_attention(l) {
            Mixer::Attention {
                q_proj: load_matrix(pack, &n(Role::QProj), c.q_proj_dim(), h)?,
                k_proj: load_matrix(pack, &n(Role::KProj), c.kv_dim(), h)?,
                v_proj: load_matrix(pack, &n(Role::VProj), c.kv_dim(), h)?,
                o_proj: load_matrix(pack, &n(Role::OProj), h, c.q_dim())?,
                q_norm: norm(Role::QNorm, c.head_dim)?,
                k_norm: norm(Role::KNorm, c.head_dim)?,
            }
        } else {
            let s = deltanet_shape(c);
            let conv_name = n(Role::LinearConv1d);
            let conv = pack.tensor(&conv_name)?;
            if conv.shape != [s.conv_dim() as u64, 1, s.conv_kernel as u64] {
                return Err(Error::tensor(
                    &conv_name,
                    format!("shape {:?}, the engine needs [{}, 1, {}]", conv.shape, s.conv_dim(), s.conv_kernel),
                ));
            }
            Mixer::Linear {
                in_proj_qkvz: load_matrix(pack, &n(Role::LinearInProjQkvz), s.qkvz_dim(), h)?,
                in_proj_ba: load_matrix(pack, &n(Role::LinearInProjBa), s.ba_dim(), h)?,
                conv1d: conv.to_f32(),
                dt_bias: load_vector(pack, &n(Role::LinearDtBias), s.value_heads)?,
                a_log: load_vector(pack, &n(Role::LinearALog), s.value_heads)?,
                norm: load_vector(pack, &n(Role::LinearNorm), s.value_head_dim)?,
                out_proj: load_matrix(pack, &n(Role::LinearOutProj), h, s.value_dim())?,
            }
        };
        let shared = match c.shared_expert_intermediate_size() {
            None => None,
            Some(is) => Some(SharedExpert {
                gate: load_matrix(pack, &n(Role::SharedExpertGate), 1, h)?,
                mlp: {
                    let names = [n(Role::SharedGateProj), n(Role::SharedUpProj), n(Role::SharedDownProj)];
                    let shapes = [[is, h], [is, h], [h, is]];
                    let mut nvfp4 = true;
                    for (name, [r, cols]) in names.iter().zip(shapes) {
                        let t = pack.tensor(name)?;
                        if t.shape != [r as u64, cols as u64] {
                            return Err(Error::tensor(
                                name,
                                format!("shape {:?}, the engine needs [{r}, {cols}]", t.shape),
                            ));
                        }
                        nvfp4 &= matches!(t.data, TensorData::Nvfp4(_));
                    }
                    let [gate, up, down] = names;
                    if nvfp4 {
                        SharedMlp::Nvfp4 { gate, up, down }
                    } else {
                        SharedMlp::Dense {
                            gate: load_matrix(pack, &gate, is, h)?,
                            up: load_matrix(pack, &up, is, h)?,
                            down: load_matrix(pack, &down, h, is)?,
                        }
                    }
                },
            }),
        };
        Ok(LayerWeights {
            input_norm: norm(Role::InputNorm, h)?,
            mixer,
            post_attn_norm: norm(Role::PostAttnNorm, h)?,
            router: load_matrix(pack, &n(Role::Router), c.num_experts, h)?,
            shared,
        })
    }
}

/// The Gated DeltaNet shape of a qwen3_next model (panics for qwen3_moe).
fn deltanet_shape(c: &ModelConfig) -> DeltaNetShape {
    let l = c.linear_attn().expect("a qwen3_next config");
    DeltaNetShape {
        key_heads: l.num_key_heads,
        value_heads: l.num_value_heads,
        key_head_dim: l.key_head_dim,
        value_head_dim: l.value_head_dim,
        conv_kernel: l.conv_kernel,
    }
}

/// Per layer, the Gated DeltaNet shape of linear layers (`None` for full
/// attention): what a session's cache holds.
pub(crate) fn linear_layers(c: &ModelConfig) -> Vec<Option<DeltaNetShape>> {
    (0..c.num_hidden_layers).map(|l| (!c.is_full_attention(l)).then(|| deltanet_shape(c))).collect()
}

impl Weights {
    /// Decodes the layers in parallel on `backend`'s pool while this thread
    /// reports progress (`done` of `total` steps: the layers, then the
    /// embedding and head), so a caller's callback always runs on the
    /// thread that called `load`. A false from `progress` cancels: layers
    /// not yet started are skipped and the load returns `Error::Cancelled`.
    fn load(
        pack: &Pack,
        backend: &CpuBackend,
        progress: &mut dyn FnMut(usize, usize) -> Result<()>,
    ) -> Result<Weights> {
        let c = pack.config();
        let (h, v) = (c.hidden_size, c.vocab_size);
        let total = c.num_hidden_layers + 1;
        let cancelled = AtomicBool::new(false);
        let (tx, rx) = mpsc::channel::<()>();
        let decode = || {
            let layers = (0..c.num_hidden_layers)
                .into_par_iter()
                .map_with(tx, |tx, l| {
                    if cancelled.load(Ordering::Relaxed) {
                        return Err(Error::Cancelled);
                    }
                    let w = LayerWeights::load(pack, l);
                    let _ = tx.send(());
                    w
                })
                .collect::<Result<Vec<_>>>()?;
            if cancelled.load(Ordering::Relaxed) {
                return Err(Error::Cancelled);
            }
            let lm_head = if c.tie_word_embeddings {
                None
            } else {
                Some(load_matrix(pack, model_tensor_name(Role::LmHead), v, h)?)
            };
            Ok(Weights {
                embed: load_matrix(pack, model_tensor_name(Role::Embedding), v, h)?,
                layers,
                final_norm: {
                    let mut w = load_vector(pack, model_tensor_name(Role::FinalNorm), h)?;
                    if c.arch.zero_centered_norms() {
                        w.iter_mut().for_each(|v| *v += 1.0);
                    }
                    w
                },
                lm_head,
            })
        };
        std::thread::scope(|scope| {
            let worker = scope.spawn(|| backend.install(decode));
            // Ends when every sender (one per rayon split) is dropped.
            let mut verdict = Ok(());
            for (done, ()) in rx.iter().enumerate() {
                if verdict.is_ok() {
                    verdict = progress(done + 1, total);
                    if verdict.is_err() {
                        cancelled.store(true, Ordering::Relaxed);
                    }
                }
            }
            let weights = match worker.join() {
                Ok(w) => w,
                Err(panic) => std::panic::resume_unwind(panic),
            };
            verdict?;
            let weights = weights?;
            progress(total, total)?;
            Ok(weights)
        })
    }

    fn lm_head(&self) -> &Matrix {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }
}

/// `Error::NonFinite` at the first NaN or infinity of `rows` (`[n, width]`,
/// row 0 at absolute position `first`), seen `place()` ("at layer 3"):
/// "NaN at layer 3, position 117".
fn check_finite(rows: &[f32], width: usize, first: usize, place: impl FnOnce() -> String) -> Result<()> {
    match rows.iter().position(|v| !v.is_finite()) {
        None => Ok(()),
        Some(i) => Err(Error::NonFinite(format!("{} {}, position {}", rows[i], place(), first + i / width))),
    }
}

impl Engine {
    /// Opens the pack in `pack_dir` and loads it.
    pub fn load(pack_dir: &Path, opts: &EngineOptions) -> Result<Engine> {
        Engine::load_with_progress(pack_dir, opts, &mut |_| true)
    }

    /// `load`, calling `progress` on this thread with the fraction done
    /// (0 to 1, non-decreasing): opening the pack ends at 0.05, verifying
    /// checksums (when asked) at 0.5, then each decoded layer advances it;
    /// the last call is 1. `progress` returning false cancels the load with
    /// `Error::Cancelled`.
    pub fn load_with_progress(
        pack_dir: &Path,
        opts: &EngineOptions,
        progress: &mut dyn FnMut(f32) -> bool,
    ) -> Result<Engine> {
        Device::parse_list(&opts.devices)?;
        let mut report = LoadProgress { callback: progress, last: None };
        report.report(0.0)?;
        let pack = Pack::open(pack_dir)?;
        report.report(PROGRESS_OPENED)?;
        let mut decode_from = PROGRESS_OPENED;
        if opts.verify_checksums {
            let span = PROGRESS_VERIFIED - PROGRESS_OPENED;
            let mut verdict = Ok(());
            let verified = pack.verify_with(|done, total| {
                verdict = report.report(PROGRESS_OPENED + span * (done as f64 / total.max(1) as f64) as f32);
                verdict.is_ok()
            });
            verdict?;
            verified?;
            decode_from = PROGRESS_VERIFIED;
        }
        Engine::build(pack, opts, &mut |done, total| {
            report.report(decode_from + (1.0 - decode_from) * done as f32 / total as f32)
        })
    }

    /// Decodes the dense weights of an open pack; experts stay mapped.
    pub fn from_pack(pack: Pack, opts: &EngineOptions) -> Result<Engine> {
        Device::parse_list(&opts.devices)?;
        Engine::build(pack, opts, &mut |_, _| Ok(()))
    }

    fn build(pack: Pack, opts: &EngineOptions, progress: &mut dyn FnMut(usize, usize) -> Result<()>) -> Result<Engine> {
        let c = pack.config();
        c.validate()?;
        let rope = Rope::new(c);
        let devices = Device::parse_list(&opts.devices)?;
        let device = devices[0];
        let ranges = match (&opts.layer_split, &opts.stage_memory) {
            (Some(_), Some(_)) => {
                return Err(Error::InvalidArgument(
                    "layer_split and stage_memory: give the split points or the budgets, not both".into(),
                ))
            }
            (None, Some(budgets)) => {
                if budgets.len() != devices.len() {
                    return Err(Error::InvalidArgument(format!(
                        "stage_memory: {} budget(s) for {} device(s), one per device",
                        budgets.len(),
                        devices.len()
                    )));
                }
                let (mut layers, first, last) = stage_bytes(&pack)?;
                let on_gpu = matches!(device, Device::Cuda(_));
                // With a cache on CUDA stages, experts live in each device's
                // slots (a fixed need per stage), not with their layers.
                let cached = on_gpu && opts.expert_cache.enabled();
                let value_bytes = if on_gpu { 1.0 } else { 4.0 };
                for (l, b) in layers.iter_mut().enumerate() {
                    if cached {
                        *b -= pack.expert_layer_bytes(l)?.len() as u64;
                    }
                    *b += layer_state_bytes(c, l, opts.stage_memory_context, value_bytes);
                }
                let budgets = if cached { cache_left(&pack, &opts.expert_cache, budgets)? } else { budgets.clone() };
                stage_layers_by_budget(&layers, first, last, &budgets)?
            }
            (split, None) => stage_layers(c.num_hidden_layers, devices.len(), split.as_deref())?,
        };
        let experts = match device {
            Device::Cpu => CpuExpertCache::load(&pack, &opts.expert_cache)?.map(parking_lot::Mutex::new),
            Device::Cuda(_) => None, // the GPU model holds its own
        };
        let n_stages = ranges.len();
        let split = (n_stages > 1).then(|| parking_lot::Mutex::new(SplitStats::default()));
        let exec = match device {
            Device::Cpu => {
                let stages = cpu_stages(ranges, opts.threads)?;
                let weights = Weights::load(&pack, &stages[0].backend, progress)?;
                if let Some(split) = &split {
                    split.lock().stages = stages
                        .iter()
                        .map(|s| StageStats {
                            layers: s.layers.clone(),
                            threads: s.backend.threads(),
                            seconds: 0.0,
                            expert_rows_per_second: None,
                        })
                        .collect();
                }
                Exec::Cpu { stages, weights }
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(_) => {
                // One `Gpu` (context and stream) per listed device: a
                // repeated ordinal gives two logical devices on one GPU.
                let gpus = devices
                    .iter()
                    .map(|d| match *d {
                        Device::Cuda(ordinal) => crate::backend::cuda::Gpu::open(ordinal as usize),
                        Device::Cpu => unreachable!("parse_list refuses mixed devices"),
                    })
                    .collect::<Result<Vec<_>>>()?;
                if let Some(split) = &split {
                    split.lock().stages =
                        ranges.iter().map(|r| StageStats { layers: r.clone(), ..Default::default() }).collect();
                }
                Exec::Cuda(Box::new(gpu::GpuModel::load(
                    &pack,
                    gpus,
                    ranges,
                    &rope,
                    opts.gpu_precision,
                    &opts.expert_cache,
                    progress,
                )?))
            }
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(_) => unreachable!("parse_list refuses CUDA devices without the cuda feature"),
        };
        Ok(Engine {
            inner: Arc::new(Inner {
                pack,
                exec,
                rope,
                experts,
                prefill_help: opts.prefill_help,
                help_rates: parking_lot::Mutex::new(HelpRates::new(n_stages)),
                split,
                #[cfg(test)]
                fail_after_layers: std::sync::Mutex::new(None),
                #[cfg(any(test, feature = "test-hooks"))]
                nan_at: std::sync::Mutex::new(None),
            }),
        })
    }

    /// Whether an idle stage helps with prefill (`EngineOptions::prefill_help`).
    #[cfg(feature = "cuda")]
    pub(crate) fn prefill_help(&self) -> Help {
        self.inner.prefill_help
    }

    /// Adds what a forward of a split did to `split_stats` (no-op without a split).
    #[cfg(feature = "cuda")]
    pub(crate) fn record_split(&self, f: impl FnOnce(&mut SplitStats)) {
        if let Some(split) = &self.inner.split {
            f(&mut split.lock());
        }
    }

    /// The CPU stages and the weights (the CPU forward's view of `exec`).
    fn cpu(&self) -> (&[CpuStage], &Weights) {
        match &self.inner.exec {
            Exec::Cpu { stages, weights } => (stages, weights),
            #[cfg(feature = "cuda")]
            Exec::Cuda(_) => unreachable!("the CPU forward on a CUDA engine"),
        }
    }

    /// What the stages of a layer split did since load (`None` on one device).
    pub fn split_stats(&self) -> Option<SplitStats> {
        let mut stats = self.inner.split.as_ref().map(|s| s.lock().clone())?;
        let rates = self.inner.help_rates.lock();
        for (i, st) in stats.stages.iter_mut().enumerate() {
            st.expert_rows_per_second = rates.rate(i);
        }
        Some(stats)
    }

    /// Tests: a forward fails (`Error::Cancelled`) once `layers` more layers
    /// have run (counted across forwards), with the cache and recurrent
    /// states already advanced. (Pipelined stages share the count: which
    /// piece fails is then a matter of timing.)
    #[cfg(test)]
    pub(crate) fn fail_next_forward_after(&self, layers: usize) {
        *self.inner.fail_after_layers.lock().unwrap() = Some(layers);
    }

    /// Tests: the next forward that runs absolute position `position`
    /// writes a NaN into its hidden state at the end of layer `layer`
    /// (once), as a numerical blow-up would. (Feature `test-hooks` makes
    /// it available to the GPU suite.)
    #[cfg(any(test, feature = "test-hooks"))]
    #[doc(hidden)]
    pub fn inject_nan_at(&self, layer: usize, position: usize) {
        *self.inner.nan_at.lock().unwrap() = Some((layer, position));
    }

    /// Whether a NaN injection is pending.
    #[cfg(all(feature = "cuda", any(test, feature = "test-hooks")))]
    pub(crate) fn nan_pending(&self) -> bool {
        self.inner.nan_at.lock().unwrap().is_some()
    }

    /// Takes the pending NaN injection if it falls in `layer` and rows
    /// `start..start + rows`: the row to poison.
    #[cfg(any(test, feature = "test-hooks"))]
    pub(crate) fn take_nan(&self, layer: usize, start: usize, rows: usize) -> Option<usize> {
        let mut nan = self.inner.nan_at.lock().unwrap();
        match *nan {
            Some((l, pos)) if l == layer && (start..start + rows).contains(&pos) => {
                *nan = None;
                Some(pos - start)
            }
            _ => None,
        }
    }

    pub fn config(&self) -> &ModelConfig {
        self.inner.pack.config()
    }

    pub fn pack(&self) -> &Pack {
        &self.inner.pack
    }

    /// The tokens that end generation (the pack's `eos_token_ids`; empty
    /// when the checkpoint named none). `step` does not stop by itself: a
    /// caller stops when a sampled token is one of these.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.inner.pack.manifest().eos_token_ids
    }

    /// The tiers each expert cache was planned with (one per stage on a
    /// split over CUDA devices; empty without a cache): slots, ring slots
    /// (sized from the cache unless `ring_slots` was given), host buffers.
    pub fn expert_tiers(&self) -> Vec<crate::experts::Capacity> {
        #[cfg(feature = "cuda")]
        if let Exec::Cuda(m) = &self.inner.exec {
            return m.expert_tiers();
        }
        self.inner.experts.iter().map(|c| c.lock().planner().capacity()).collect()
    }

    /// What the expert cache did since load (`None` without a cache).
    pub fn expert_stats(&self) -> Option<ExpertStats> {
        #[cfg(feature = "cuda")]
        if let Exec::Cuda(m) = &self.inner.exec {
            return m.expert_stats();
        }
        self.inner.experts.as_ref().map(|c| c.lock().stats())
    }

    /// The tokens routed to each (layer, expert) since load, as a profile
    /// (`None` without a cache).
    pub fn expert_profile(&self) -> Option<ExpertProfile> {
        let profile = |stats: ExpertStats, p: &crate::experts::Planner| {
            ExpertProfile::new(self.config(), stats.tokens, p.routed_counts())
        };
        #[cfg(feature = "cuda")]
        if let Exec::Cuda(m) = &self.inner.exec {
            return m.expert_routed().map(|(stats, counts)| ExpertProfile::new(self.config(), stats.tokens, counts));
        }
        self.inner.experts.as_ref().map(|c| {
            let c = c.lock();
            profile(c.stats(), c.planner())
        })
    }

    /// The name of the backend that runs the forward pass ("cpu" or "cuda").
    pub fn backend_name(&self) -> &'static str {
        match &self.inner.exec {
            Exec::Cpu { stages, .. } => stages[0].backend.name(),
            #[cfg(feature = "cuda")]
            Exec::Cuda(_) => "cuda",
        }
    }

    /// A new session cache for this engine's device: the host KV of the
    /// CPU backend (f32) or device memory (int8 by default, or bf16).
    pub(crate) fn new_cache(&self, kv_type: KvType) -> Result<Cache> {
        let c = self.config();
        match &self.inner.exec {
            Exec::Cpu { .. } => {
                // bf16 and int8 are emulated: values rounded as the CUDA
                // cache rounds them, kept in f32.
                let rounding = match kv_type {
                    KvType::Auto | KvType::F32 => KvRounding::None,
                    KvType::Bf16 => KvRounding::Bf16,
                    KvType::Int8 => KvRounding::Int8 { head_dim: c.head_dim },
                };
                Ok(Cache::Host(KvCache::new_hybrid(c.kv_dim(), &linear_layers(c)).with_rounding(rounding)))
            }
            #[cfg(feature = "cuda")]
            Exec::Cuda(m) => Ok(Cache::Device(Box::new(m.new_cache(kv_type)?))),
        }
    }

    pub fn new_session(&self, opts: &SessionOptions) -> Result<Session> {
        Session::new(self.clone(), opts)
    }

    /// Runs `tokens` at positions `kv.len()..`, appending their keys and
    /// values (and advancing the Gated DeltaNet states of a hybrid), and
    /// returns the requested logits (`[rows, vocab]`). On error the cache is
    /// back where it was before the call, recurrent states included.
    ///
    /// Non-finite guard: the hidden state of these rows is checked at the
    /// end of every layer, and the logits computed; the first NaN or
    /// infinity fails the forward with `Error::NonFinite` naming the layer
    /// (or the logits) and the absolute position where it was seen.
    pub(crate) fn forward(&self, cache: &mut Cache, tokens: &[u32], logits: Logits) -> Result<HostLogits> {
        self.forward_drawing(cache, tokens, logits, None)
    }

    /// `forward`, and on a CUDA engine, for a decode step (one row, the
    /// last logits), the next token drawn on the device from the logits
    /// as `draw` asks (`HostLogits::drawn`), so that the next step need
    /// not draw on the host. Elsewhere `draw` is ignored.
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    pub(crate) fn forward_drawing(
        &self,
        cache: &mut Cache,
        tokens: &[u32],
        logits: Logits,
        draw: Option<&DrawAhead>,
    ) -> Result<HostLogits> {
        assert!(!tokens.is_empty(), "forward: no tokens (the session rejects empty prompts)");
        match cache {
            Cache::Host(kv) => self.forward_host(kv, tokens, logits).map(HostLogits::from),
            #[cfg(feature = "cuda")]
            Cache::Device(d) => match &self.inner.exec {
                Exec::Cuda(m) => m.forward(self, d, tokens, logits, draw),
                Exec::Cpu { .. } => unreachable!("a device cache on a CPU engine"),
            },
        }
    }

    /// Runs `pieces` in order as `forward` runs each one, and returns the
    /// logits of the pieces that completed (in order) and the error of the
    /// first that failed; the cache then holds exactly the completed
    /// pieces, recurrent states included. Without `keep_completed` (the
    /// caller undoes the whole run on failure) a failed pipelined run may
    /// instead return no logits with the cache back at its start.
    ///
    /// On a split, several pieces are pipelined (windows in flight: CPU
    /// stages `forward_pipelined`, CUDA stages `gpu::GpuModel::
    /// forward_pipelined`) unless prefill help is forced on (help needs an
    /// idle stage) or the expert cache is on (its planner follows one
    /// forward at a time). Logits are the same bits either way.
    pub(crate) fn forward_pieces(
        &self,
        cache: &mut Cache,
        pieces: &[Piece<'_>],
        keep_completed: bool,
    ) -> (Vec<HostLogits>, Option<Error>) {
        match cache {
            Cache::Host(kv) if self.pipelines(pieces.len()) => {
                let (logits, err) = self.forward_pipelined(kv, pieces, keep_completed);
                return (logits.into_iter().map(HostLogits::from).collect(), err);
            }
            #[cfg(feature = "cuda")]
            Cache::Device(d) => {
                if let Exec::Cuda(m) = &self.inner.exec {
                    if m.pipelines(self, pieces) {
                        return m.forward_pipelined(self, d, pieces, keep_completed);
                    }
                }
            }
            _ => {}
        }
        let mut out = Vec::with_capacity(pieces.len());
        for p in pieces {
            match self.forward(cache, p.tokens, p.want) {
                Ok(l) => out.push(l),
                Err(e) => return (out, Some(e)),
            }
        }
        (out, None)
    }

    /// Whether `forward_pieces` pipelines a run of `pieces` pieces.
    fn pipelines(&self, pieces: usize) -> bool {
        let stages = match &self.inner.exec {
            Exec::Cpu { stages, .. } => stages.len(),
            #[cfg(feature = "cuda")]
            Exec::Cuda(_) => 1,
        };
        stages > 1 && pieces > 1 && self.inner.experts.is_none() && self.inner.prefill_help != Help::On
    }

    /// Pipelined windows: one thread per stage runs its layers on each
    /// piece in turn and hands the hidden state to the next stage's thread
    /// (at most `PIPELINE_DEPTH` waiting), so while stage `s` runs piece
    /// `j`, stage `s - 1` already runs piece `j + 1`. Each stage appends
    /// to and reads only its own layers' KV and recurrent states
    /// (`KvCache::stage_views`), every row at its own position, so each
    /// piece sees exactly what the sequential forward would.
    ///
    /// If a piece fails, the stages stop; the cache is brought back to the
    /// end of the pieces the last stage completed (all those before the
    /// failing one): KV rows past it are dropped, and on a hybrid model the
    /// recurrent states (advanced by later pieces on earlier stages) are
    /// restored from before the run and the completed pieces run again,
    /// one at a time (unless `!keep_completed`: then the cache goes back to
    /// the start of the run and no logits are returned).
    fn forward_pipelined(
        &self,
        kv: &mut KvCache,
        pieces: &[Piece<'_>],
        keep_completed: bool,
    ) -> (Vec<Vec<f32>>, Option<Error>) {
        let (stages, _) = self.cpu();
        let n = stages.len();
        let start = kv.len();
        let mut starts = Vec::with_capacity(pieces.len() + 1);
        starts.push(start);
        for p in pieces {
            starts.push(starts[starts.len() - 1] + p.tokens.len());
        }
        let total = starts[pieces.len()] - start;
        let before = kv.is_hybrid().then(|| kv.deltas());
        kv.reserve(total);
        let ranges: Vec<Range<usize>> = stages.iter().map(|s| s.layers.clone()).collect();
        let mut views = kv.stage_views(&ranges);
        let starts = &starts;
        let runs: Vec<StageRun> = std::thread::scope(|scope| {
            let (mut senders, mut receivers) = (Vec::with_capacity(n), vec![None]);
            for _ in 1..n {
                let (tx, rx) = mpsc::sync_channel::<Vec<f32>>(PIPELINE_DEPTH);
                senders.push(Some(tx));
                receivers.push(Some(rx));
            }
            senders.push(None);
            let handles: Vec<_> = views
                .iter_mut()
                .zip(senders)
                .zip(receivers)
                .enumerate()
                .map(|(s, ((view, tx), rx))| scope.spawn(move || self.pipeline_stage(s, view, tx, rx, pieces, starts)))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))).collect()
        });
        drop(views);
        if let Some(split) = &self.inner.split {
            let mut st = split.lock();
            for (s, run) in runs.iter().enumerate() {
                st.stages[s].seconds += run.seconds;
                st.handoffs += run.handoffs;
                st.handoff_bytes += run.handoff_bytes;
                st.handoff_seconds += run.handoff_seconds;
            }
            st.pipelined_windows += runs[n - 1].done as u64;
        }
        let mut runs = runs;
        let done = runs[n - 1].done;
        let mut logits = std::mem::take(&mut runs[n - 1].logits);
        // The first failing piece's error (the earliest stage's on a tie).
        let failed = runs.into_iter().filter_map(|r| r.error).min_by_key(|(j, _)| *j);
        let Some((j, err)) = failed else {
            debug_assert_eq!(done, pieces.len());
            kv.commit(total);
            return (logits, None);
        };
        debug_assert_eq!(done, j, "every piece before the failing one completes");
        match before {
            None => kv.settle(starts[done]),
            Some(deltas) if !keep_completed => {
                kv.settle(start);
                kv.restore_deltas(&deltas);
                logits.clear();
            }
            Some(deltas) => {
                kv.settle(start);
                kv.restore_deltas(&deltas);
                for (k, p) in pieces[..done].iter().enumerate() {
                    if let Err(e) = self.forward_host(kv, p.tokens, Logits::Skip) {
                        // Not expected (the same rows ran before): the
                        // cache holds the pieces that did run again.
                        logits.truncate(k);
                        return (logits, Some(e));
                    }
                }
            }
        }
        (logits, Some(err))
    }

    /// Stage `s`'s thread of `forward_pipelined`: each piece from the
    /// previous stage (the embedding on the first), its layers, then to the
    /// next stage (the logits on the last).
    fn pipeline_stage(
        &self,
        s: usize,
        kv: &mut StageKv<'_>,
        tx: Option<mpsc::SyncSender<Vec<f32>>>,
        rx: Option<mpsc::Receiver<Vec<f32>>>,
        pieces: &[Piece<'_>],
        starts: &[usize],
    ) -> StageRun {
        let mut run = StageRun::default();
        for (j, p) in pieces.iter().enumerate() {
            let mut x = match &rx {
                None => self.embed(p.tokens),
                Some(rx) => match rx.recv() {
                    Ok(x) => x,
                    // The previous stage stopped (a failure there).
                    Err(_) => break,
                },
            };
            let began = Instant::now();
            if let Err(e) = self.run_stage(s, None, kv, &mut x, starts[j]) {
                run.error = Some((j, e));
                break;
            }
            run.seconds += began.elapsed().as_secs_f64();
            match &tx {
                Some(tx) => {
                    let (bytes, sent) = (std::mem::size_of_val(&x[..]) as u64, Instant::now());
                    if tx.send(x).is_err() {
                        // The next stage stopped (a failure there).
                        break;
                    }
                    run.handoffs += 1;
                    run.handoff_bytes += bytes;
                    run.handoff_seconds += sent.elapsed().as_secs_f64();
                }
                None => match self.head(&x, p.want, starts[j]) {
                    Ok(l) => run.logits.push(l),
                    Err(e) => {
                        run.error = Some((j, e));
                        break;
                    }
                },
            }
            run.done = j + 1;
        }
        run
    }

    fn forward_host(&self, kv: &mut KvCache, tokens: &[u32], logits: Logits) -> Result<Vec<f32>> {
        let start = kv.len();
        let deltas = if kv.is_hybrid() { Some(kv.deltas()) } else { None };
        match self.forward_rows(kv, tokens, logits) {
            Ok(l) => {
                kv.commit(tokens.len());
                Ok(l)
            }
            Err(e) => {
                kv.truncate(start);
                if let Some(d) = deltas {
                    kv.restore_deltas(&d);
                }
                Err(e)
            }
        }
    }

    fn forward_rows(&self, kv: &mut KvCache, tokens: &[u32], logits: Logits) -> Result<Vec<f32>> {
        let c = self.config();
        let (stages, _) = self.cpu();
        let (h, t) = (c.hidden_size, tokens.len());
        let start = kv.len();
        if let Some(cache) = &self.inner.experts {
            cache.lock().begin_forward(t);
        }
        let help = self.inner.prefill_help.applies(stages.len(), t);
        let mut x = self.embed(tokens);
        let ranges: Vec<Range<usize>> = stages.iter().map(|s| s.layers.clone()).collect();
        let mut views = kv.stage_views(&ranges);
        for (s, view) in views.iter_mut().enumerate() {
            if s > 0 {
                x = self.hand_off(&x);
            }
            let began = Instant::now();
            let helper = help.then(|| helper_of(stages, s));
            self.run_stage(s, helper, view, &mut x, start)?;
            if let Some(split) = &self.inner.split {
                split.lock().stages[s].seconds += began.elapsed().as_secs_f64();
            }
        }
        if let Some(cache) = &self.inner.experts {
            cache.lock().end_forward(&self.inner.pack, t)?;
        }
        debug_assert_eq!(x.len(), t * h);
        self.head(&x, logits, start)
    }

    /// The embedding rows of `tokens`.
    fn embed(&self, tokens: &[u32]) -> Vec<f32> {
        let (_, w) = self.cpu();
        let h = self.config().hidden_size;
        let mut x = vec![0.0f32; tokens.len() * h];
        for (row, &tok) in x.chunks_exact_mut(h).zip(tokens) {
            row.copy_from_slice(w.embed.row(tok as usize));
        }
        x
    }

    /// Runs stage `s`'s layers on the rows `x` at positions `start..` (with
    /// a `helper` for its MoE blocks), the hidden state checked after each.
    fn run_stage(
        &self,
        s: usize,
        helper: Option<(usize, &dyn Backend, f64)>,
        kv: &mut StageKv<'_>,
        x: &mut [f32],
        start: usize,
    ) -> Result<()> {
        let (stages, w) = self.cpu();
        let stage = &stages[s];
        let b: &dyn Backend = &stage.backend;
        let h = self.config().hidden_size;
        #[cfg(any(test, feature = "test-hooks"))]
        let t = x.len() / h;
        for l in stage.layers.clone() {
            let lw = &w.layers[l];
            match &lw.mixer {
                Mixer::Attention { .. } => self.attention_block(b, l, lw, kv, x),
                Mixer::Linear { .. } => self.linear_block(b, l, lw, kv, x),
            }
            self.moe_block(b, s, helper, l, lw, x)?;
            #[cfg(any(test, feature = "test-hooks"))]
            if let Some(row) = self.take_nan(l, start, t) {
                x[row * h] = f32::NAN;
            }
            check_finite(x, h, start, || format!("at layer {l}"))?;
            #[cfg(test)]
            {
                let mut fail = self.inner.fail_after_layers.lock().unwrap();
                if let Some(n) = fail.as_mut() {
                    *n -= 1;
                    if *n == 0 {
                        *fail = None;
                        return Err(Error::Cancelled);
                    }
                }
            }
        }
        Ok(())
    }

    /// The logits `want`s of the final hidden state `x` of rows at
    /// positions `start..`, on the last stage, checked finite.
    fn head(&self, x: &[f32], want: Logits, start: usize) -> Result<Vec<f32>> {
        let c = self.config();
        let (stages, w) = self.cpu();
        let (h, t) = (c.hidden_size, x.len() / c.hidden_size);
        let r = want.rows(t);
        if r == 0 {
            return Ok(Vec::new());
        }
        let (rows, first) = (&x[(t - r) * h..], start + t - r);
        let b = &stages[stages.len() - 1].backend;
        let mut xn = vec![0.0f32; rows.len()];
        b.rmsnorm(rows, &w.final_norm, self.eps(), &mut xn);
        let mut out = vec![0.0f32; rows.len() / h * c.vocab_size];
        b.matmul(&xn, w.lm_head(), &mut out);
        check_finite(&out, c.vocab_size, first, || "in the logits".into())?;
        Ok(out)
    }

    /// The one hidden-state hand-off of a window from a stage to the next:
    /// the next stage's own copy (a peer copy between GPUs), counted.
    fn hand_off(&self, x: &[f32]) -> Vec<f32> {
        let began = Instant::now();
        let moved = x.to_vec();
        if let Some(split) = &self.inner.split {
            let mut s = split.lock();
            s.handoffs += 1;
            s.handoff_bytes += std::mem::size_of_val(x) as u64;
            s.handoff_seconds += began.elapsed().as_secs_f64();
        }
        moved
    }

    fn eps(&self) -> f32 {
        self.config().rms_norm_eps as f32
    }

    /// `x += o_proj(attention(rope(norm(q)), rope(norm(k)), v))` over `x [T, hidden]`.
    fn attention_block(&self, b: &dyn Backend, layer: usize, lw: &LayerWeights, kv: &mut StageKv<'_>, x: &mut [f32]) {
        let c = self.config();
        let eps = self.eps();
        let shape =
            AttentionShape { heads: c.num_attention_heads, kv_heads: c.num_key_value_heads, head_dim: c.head_dim };
        let t = x.len() / c.hidden_size;
        let start_pos = kv.rows(layer);

        let Mixer::Attention { q_proj, k_proj, v_proj, o_proj, q_norm, k_norm } = &lw.mixer else {
            unreachable!("attention_block on a linear layer")
        };
        let mut h = vec![0.0f32; x.len()];
        b.rmsnorm(x, &lw.input_norm, eps, &mut h);
        let mut q = vec![0.0f32; t * shape.q_dim()];
        let mut k = vec![0.0f32; t * shape.kv_dim()];
        let mut v = vec![0.0f32; t * shape.kv_dim()];
        let mut gate = Vec::new();
        if c.has_attention_gate() {
            // q_proj emits [q | gate] per head.
            let mut qg = vec![0.0f32; t * c.q_proj_dim()];
            b.matmul(&h, q_proj, &mut qg);
            gate = vec![0.0f32; q.len()];
            split_q_gate(&qg, shape.heads, shape.head_dim, &mut q, &mut gate);
        } else {
            b.matmul(&h, q_proj, &mut q);
        }
        b.matmul(&h, k_proj, &mut k);
        b.matmul(&h, v_proj, &mut v);
        // q_norm / k_norm: RMSNorm over each head's head_dim, before RoPE.
        let mut qn = vec![0.0f32; q.len()];
        let mut kn = vec![0.0f32; k.len()];
        b.rmsnorm(&q, q_norm, eps, &mut qn);
        b.rmsnorm(&k, k_norm, eps, &mut kn);
        b.rope(&mut qn, shape.heads, shape.head_dim, start_pos, &self.inner.rope);
        b.rope(&mut kn, shape.kv_heads, shape.head_dim, start_pos, &self.inner.rope);
        kv.append(layer, &kn, &v);

        let (k_cache, v_cache) = kv.layer(layer);
        let mut attn = vec![0.0f32; q.len()];
        b.attention(&qn, k_cache, v_cache, shape, start_pos, &mut attn);
        if c.has_attention_gate() {
            b.output_gate(&mut attn, &gate);
        }
        let mut o = vec![0.0f32; x.len()];
        b.matmul(&attn, o_proj, &mut o);
        b.add(x, &o);
    }

    /// `x += gated_deltanet(norm(x))`, advancing the layer's recurrent state.
    fn linear_block(&self, b: &dyn Backend, layer: usize, lw: &LayerWeights, kv: &mut StageKv<'_>, x: &mut [f32]) {
        let c = self.config();
        let Mixer::Linear { in_proj_qkvz, in_proj_ba, conv1d, dt_bias, a_log, norm, out_proj } = &lw.mixer else {
            unreachable!("linear_block on an attention layer")
        };
        let mut h = vec![0.0f32; x.len()];
        b.rmsnorm(x, &lw.input_norm, self.eps(), &mut h);
        let w = GatedDeltaNetWeights { in_proj_qkvz, in_proj_ba, conv1d, dt_bias, a_log, norm, out_proj };
        let mut o = vec![0.0f32; x.len()];
        b.gated_deltanet(&h, &w, deltanet_shape(c), self.eps(), kv.delta_mut(layer), &mut o);
        b.add(x, &o);
    }

    /// `x += moe(norm(x))` on `b`; with a `helper` (an idle stage and the
    /// share of rows it takes), through `moe::HelpedCompute`.
    fn moe_block(
        &self,
        b: &dyn Backend,
        active: usize,
        helper: Option<(usize, &dyn Backend, f64)>,
        layer: usize,
        lw: &LayerWeights,
        x: &mut [f32],
    ) -> Result<()> {
        let c = self.config();
        let mut h = vec![0.0f32; x.len()];
        b.rmsnorm(x, &lw.post_attn_norm, self.eps(), &mut h);
        let moe =
            MoeLayer { layer, router: &lw.router, top_k: c.num_experts_per_tok, norm_topk_prob: c.norm_topk_prob };
        let mut out = vec![0.0f32; x.len()];
        // The helper and its share of this step (the measured speeds, once known).
        let help = helper.map(|(i, hb, prior)| (i, hb, self.inner.help_rates.lock().share(active, i, prior)));
        let timing = match (&self.inner.experts, help) {
            (Some(cache), help) => {
                let helper = help.map(|(_, hb, share)| (hb, share));
                cache.lock().moe_forward(b, helper, &self.inner.pack, &moe, &h, &mut out)?.1
            }
            (None, Some((_, helper, share))) => {
                let mut help = moe::HelpedCompute::new(&self.inner.pack, helper, share);
                moe::forward_with(b, &mut help, &moe, &h, &mut out)?;
                help.timing()
            }
            (None, None) => {
                moe::forward(b, &self.inner.pack, &moe, &h, &mut out)?;
                moe::HelpTiming::default()
            }
        };
        if let Some((hi, _, _)) = help {
            let mut rates = self.inner.help_rates.lock();
            rates.observe(active, timing.own_rows, timing.own_seconds);
            rates.observe(hi, timing.helper_rows, timing.helper_seconds);
        }
        if let (Some(split), Some(_)) = (&self.inner.split, help) {
            let mut s = split.lock();
            s.helped_layers += 1;
            s.helper_rows += timing.helper_rows as u64;
        }
        if let Some(shared) = &lw.shared {
            self.shared_expert(b, shared, &h, &mut out)?;
        }
        b.add(x, &out);
        Ok(())
    }

    /// `out += sigmoid(h . gate) * shared_mlp(h)` over `h [T, hidden]`.
    fn shared_expert(&self, b: &dyn Backend, se: &SharedExpert, h: &[f32], out: &mut [f32]) -> Result<()> {
        let hidden = self.config().hidden_size;
        let t = h.len() / hidden;
        let mut y = vec![0.0f32; h.len()];
        match &se.mlp {
            SharedMlp::Nvfp4 { gate, up, down } => {
                let pack = &self.inner.pack;
                let m = |name: &str| match pack.tensor(name)?.data {
                    TensorData::Nvfp4(m) => Ok(m),
                    _ => Err(Error::tensor(name, "the shared expert is no longer NVFP4")),
                };
                let weights = ExpertView { gate: m(gate)?, up: m(up)?, down: m(down)?, blob: &[] };
                b.expert_ffn(&[ExpertRows { weights, rows: t }], h, &mut y);
            }
            SharedMlp::Dense { gate, up, down } => {
                let (mut g, mut u) = (vec![0.0f32; t * gate.rows], vec![0.0f32; t * up.rows]);
                b.matmul(h, gate, &mut g);
                b.matmul(h, up, &mut u);
                for (gv, uv) in g.iter_mut().zip(&u) {
                    *gv = silu(*gv) * uv;
                }
                b.matmul(&g, down, &mut y);
            }
        }
        let mut logit = vec![0.0f32; t];
        b.matmul(h, &se.gate, &mut logit);
        for ((o, yr), &l) in out.chunks_exact_mut(hidden).zip(y.chunks_exact(hidden)).zip(&logit) {
            let s = sigmoid(l);
            for (ov, yv) in o.iter_mut().zip(yr) {
                *ov += s * yv;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::test_pack::{tiny_config, write_tiny_pack, DenseKind, TinyPack};
    use super::*;

    fn assert_send_sync<T: Send + Sync + Clone>() {}

    #[test]
    fn engine_and_session_are_shareable() {
        assert_send_sync::<Engine>();
        fn send<T: Send>() {}
        send::<Session>();
    }

    fn logits_of(dir: &Path, opts: &EngineOptions, prompt: &[u32]) -> Vec<f32> {
        let e = Engine::load(dir, opts).unwrap();
        let mut s = e.new_session(&SessionOptions::default()).unwrap();
        s.prefill_all(prompt).unwrap()
    }

    #[test]
    fn check_finite_names_the_first_bad_value_its_place_and_position() {
        assert!(check_finite(&[1.0, -2.0, 0.0, 5.0], 2, 7, || unreachable!()).is_ok());
        let rows = [1.0, 2.0, 3.0, f32::INFINITY, f32::NAN, 0.0];
        let err = check_finite(&rows, 2, 10, || "in the logits".into()).unwrap_err();
        assert!(matches!(err, Error::NonFinite(ref m) if m == "inf in the logits, position 11"), "{err}");
        assert_eq!(err.to_string(), "non-finite values: inf in the logits, position 11");
    }

    #[test]
    fn load_exposes_config_and_pack() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = tiny_config();
        write_tiny_pack(dir.path(), &cfg, &TinyPack::default()).unwrap();
        let e = Engine::load(dir.path(), &EngineOptions::default()).unwrap();
        assert_eq!(e.config(), &cfg);
        assert_eq!(e.pack().dir(), dir.path());
        assert_eq!(e.backend_name(), "cpu");
        let missing = Engine::load(&dir.path().join("nope"), &EngineOptions::default());
        assert!(missing.err().unwrap().to_string().contains("nope"));
    }

    #[test]
    fn dedicated_pool_gives_identical_logits() {
        let dir = tempfile::tempdir().unwrap();
        write_tiny_pack(dir.path(), &tiny_config(), &TinyPack::default()).unwrap();
        let prompt = [5, 17, 90, 3, 3, 44];
        let global = logits_of(dir.path(), &EngineOptions::default(), &prompt);
        let pooled = logits_of(dir.path(), &EngineOptions { threads: Some(2), ..Default::default() }, &prompt);
        assert_eq!(global, pooled);
        let e = Engine::load(dir.path(), &EngineOptions { threads: Some(0), ..Default::default() });
        assert!(matches!(e, Err(Error::InvalidArgument(_))));
    }

    #[test]
    fn tied_embeddings_use_the_embedding_as_lm_head() {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = tiny_config();
        cfg.tie_word_embeddings = true;
        write_tiny_pack(dir.path(), &cfg, &TinyPack::default()).unwrap();
        assert!(Pack::open(dir.path()).unwrap().tensor("lm_head.weight").is_err());
        let e = Engine::load(dir.path(), &EngineOptions::default()).unwrap();
        let (_, w) = e.cpu();
        assert!(w.lm_head.is_none());
        assert!(std::ptr::eq(w.lm_head(), &w.embed));
        let mut s = e.new_session(&SessionOptions::default()).unwrap();
        assert!(s.prefill(&[1, 2, 3]).unwrap().iter().all(|v| v.is_finite()));
    }

    #[test]
    fn nvfp4_dense_weights_equal_their_dequantized_f32() {
        // The same weights stored as NVFP4 (dequantized at load, global scale
        // included) and as the f32 of that dequantization give equal logits.
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let cfg = tiny_config();
        let nv = TinyPack { dense: DenseKind::Nvfp4, ..TinyPack::default() };
        let f = TinyPack { dense: DenseKind::F32OfNvfp4, ..TinyPack::default() };
        write_tiny_pack(a.path(), &cfg, &nv).unwrap();
        write_tiny_pack(b.path(), &cfg, &f).unwrap();
        let q = Pack::open(a.path()).unwrap();
        let qp = q.tensor("model.layers.0.self_attn.q_proj.weight").unwrap();
        assert!(matches!(qp.data, crate::pack::TensorData::Nvfp4(_)));
        let prompt = [7, 8, 9, 96];
        let opts = EngineOptions::default();
        assert_eq!(logits_of(a.path(), &opts, &prompt), logits_of(b.path(), &opts, &prompt));
        // And differ from the unquantized bf16 model (the comparison is not vacuous).
        let c = tempfile::tempdir().unwrap();
        write_tiny_pack(c.path(), &cfg, &TinyPack::default()).unwrap();
        assert_ne!(logits_of(a.path(), &opts, &prompt), logits_of(c.path(), &opts, &prompt));
    }

    #[test]
    fn devices_parse_and_cuda_is_refused_without_the_backend() {
        assert_eq!(Device::parse("cpu").unwrap(), Device::Cpu);
        assert_eq!(Device::parse("cuda").unwrap(), Device::Cuda(0));
        assert_eq!(Device::parse("cuda:3").unwrap(), Device::Cuda(3));
        for bad in ["", "gpu", "cuda:", "cuda:-1", "cuda:+1", "cuda:1x", "CPU", "cuda:99999999999"] {
            assert!(matches!(Device::parse(bad), Err(Error::InvalidArgument(_))), "{bad:?}");
        }
        assert_eq!(Device::parse_list(&[]).unwrap(), vec![Device::Cpu]);
        let err = Device::parse_list(&["cuda:1".into()]).unwrap_err();
        assert!(matches!(err, Error::NoCuda(ref m) if m.contains("cuda")), "{err}");
        #[cfg(not(feature = "cuda"))]
        assert!(err.to_string().contains("feature cuda"), "{err}");
        #[cfg(feature = "cuda")]
        {
            // Whatever this machine has, a CUDA device is probed: refused
            // with the cause when absent, accepted when present.
            match (Device::parse_list(&["cuda".into()]), crate::backend::cuda::device_count()) {
                (Err(Error::NoCuda(m)), Err(Error::NoCuda(why))) => {
                    assert_eq!(m, why);
                    if !crate::backend::cuda::driver_library_present() {
                        assert_eq!(m, "the CUDA driver library (libcuda.so.1) was not found");
                    }
                }
                (Ok(d), Ok(_)) => assert_eq!(d, vec![Device::Cuda(0)]),
                (got, count) => panic!("{got:?} with device_count {count:?}"),
            }
            let err = Device::parse_list(&["cuda:4096".into()]).unwrap_err();
            let Error::NoCuda(m) = &err else { panic!("{err}") };
            if let Ok(count) = crate::backend::cuda::device_count() {
                assert!(
                    m.starts_with(&format!("cuda:4096 does not exist: this machine has {count} CUDA device")),
                    "{m}"
                );
            }
        }
        // Bad devices are refused before the pack is opened.
        let e = Engine::load(
            Path::new("/nonexistent"),
            &EngineOptions { devices: vec!["tpu".into()], ..Default::default() },
        );
        assert!(matches!(e, Err(Error::InvalidArgument(_))));
    }

    #[test]
    fn layer_split_points_are_validated_and_default_to_even_stages() {
        assert_eq!(stage_layers(4, 1, None).unwrap(), vec![0..4]);
        assert_eq!(stage_layers(4, 2, None).unwrap(), vec![0..2, 2..4]);
        assert_eq!(stage_layers(5, 3, None).unwrap(), vec![0..2, 2..4, 4..5]);
        assert_eq!(stage_layers(4, 2, Some(&[1])).unwrap(), vec![0..1, 1..4]);
        assert_eq!(stage_layers(4, 3, Some(&[1, 3])).unwrap(), vec![0..1, 1..3, 3..4]);
        let bad = |layers, stages, split: Option<&[usize]>, want: &str| {
            let err = stage_layers(layers, stages, split).unwrap_err();
            assert!(matches!(err, Error::InvalidArgument(ref m) if m.contains(want)), "{split:?}: {err}");
        };
        bad(4, 2, Some(&[]), "0 point(s) for 2 device(s)");
        bad(4, 2, Some(&[1, 2]), "2 point(s) for 2 device(s)");
        bad(4, 1, Some(&[2]), "1 point(s) for 1 device(s)");
        bad(4, 2, Some(&[0]), "in 1..4");
        bad(4, 2, Some(&[4]), "in 1..4");
        bad(4, 3, Some(&[2, 2]), "strictly increasing");
        bad(4, 3, Some(&[3, 1]), "strictly increasing");
        bad(2, 3, None, "3 devices for 2 layers");
    }

    #[test]
    fn prefill_help_parses_and_applies_by_rows_and_stages() {
        assert_eq!(Help::parse("auto").unwrap(), Help::Auto);
        assert_eq!(Help::parse("on").unwrap(), Help::On);
        assert_eq!(Help::parse("off").unwrap(), Help::Off);
        assert!(matches!(Help::parse("yes"), Err(Error::InvalidArgument(_))));
        assert!(!Help::Auto.applies(2, HELP_AUTO_MIN_ROWS - 1));
        assert!(Help::Auto.applies(2, HELP_AUTO_MIN_ROWS));
        assert!(!Help::Auto.applies(1, 10_000), "one stage has no one to help it");
        assert!(Help::On.applies(2, 1) && !Help::On.applies(1, 1));
        assert!(!Help::Off.applies(3, 10_000));
    }

    #[test]
    fn help_share_follows_the_measured_speeds_within_bounds() {
        let mut r = HelpRates::new(3);
        // Unmeasured: the prior.
        assert_eq!(r.share(0, 1, 0.4), 0.4);
        r.observe(0, 1000, 1.0);
        assert_eq!(r.share(0, 1, 0.4), 0.4, "one side measured");
        // Too few rows, or no time: not a measurement.
        r.observe(1, HELP_MIN_ROWS - 1, 1.0);
        r.observe(1, 1000, 0.0);
        assert_eq!(r.rate(1), None);
        // The helper at 3000 rows/s against 1000: it takes 3/4.
        r.observe(1, 3000, 1.0);
        assert!((r.share(0, 1, 0.4) - 0.75).abs() < 1e-12);
        // Smoothed: a new measurement moves the rate a quarter of the way.
        r.observe(0, 5000, 1.0);
        assert_eq!(r.rate(0), Some(1000.0 + HELP_RATE_SMOOTHING * 4000.0));
        // Bounded, so the slow side keeps being measured.
        r.observe(2, 16, 1000.0);
        assert_eq!(r.share(1, 2, 0.5), HELP_SHARE_BOUNDS.0);
        assert_eq!(r.share(2, 1, 0.5), HELP_SHARE_BOUNDS.1);
    }

    #[test]
    fn stages_divide_the_threads_and_the_helper_share_follows_them() {
        let stages = cpu_stages(vec![0..1, 1..2, 2..4], Some(5)).unwrap();
        let threads: Vec<usize> = stages.iter().map(|s| s.backend.threads()).collect();
        assert_eq!(threads, vec![2, 2, 1]);
        // Stage 2 (1 thread) is helped by stage 0 (2 threads, the nearest
        // after it among the largest): 2/3 of the rows.
        let (i, helper, share) = helper_of(&stages, 2);
        assert!(i == 0 && std::ptr::addr_eq(helper, &stages[0].backend));
        assert!((share - 2.0 / 3.0).abs() < 1e-12, "{share}");
        let (i, helper, share) = helper_of(&stages, 0);
        assert!(i == 1 && std::ptr::addr_eq(helper, &stages[1].backend));
        assert_eq!(share, 0.5);
        // Fewer threads than stages: one each.
        let one_each = cpu_stages(vec![0..1, 1..2], Some(1)).unwrap();
        assert!(one_each.iter().all(|s| s.backend.threads() == 1));
        assert!(matches!(cpu_stages(vec![0..1, 1..2], Some(0)), Err(Error::InvalidArgument(_))));
    }

    #[test]
    fn a_split_from_memory_budgets_fills_the_stages_evenly_within_them() {
        // 8 layers of 10 bytes, the embedding (5) on the first stage, the head (5) on the last.
        let layers = [10u64; 8];
        // Equal budgets: 4 + 4 layers (45 bytes each).
        assert_eq!(stage_layers_by_budget(&layers, 5, 5, &[100, 100]).unwrap(), vec![0..4, 4..8]);
        // Budgets 5 : 12 -> about a quarter of the layers first: 2 (25/50) and 6 (65/120).
        assert_eq!(stage_layers_by_budget(&layers, 5, 5, &[50, 120]).unwrap(), vec![0..2, 2..8]);
        // Uneven layers (a heavy layer 2): the cut balances bytes, not layer counts.
        let uneven = [10u64, 10, 60, 10, 10, 10, 10, 10];
        assert_eq!(stage_layers_by_budget(&uneven, 0, 0, &[100, 100]).unwrap(), vec![0..3, 3..8]);
        // Three stages, tight: contiguous, every layer once, each within 30 bytes.
        let three = stage_layers_by_budget(&layers, 0, 0, &[30, 30, 30]).unwrap();
        assert_eq!((three[0].start, three[2].end), (0, 8));
        assert!(three.windows(2).all(|w| w[0].end == w[1].start && !w[0].is_empty()), "{three:?}");
        assert!(three.iter().all(|r| r.len() <= 3 && !r.is_empty()), "{three:?}");
        // No split fits: named budgets and need.
        let err = stage_layers_by_budget(&layers, 5, 5, &[40, 40]).unwrap_err().to_string();
        assert!(err.contains("memory budgets") && err.contains("do not hold"), "{err}");
        assert!(stage_layers_by_budget(&layers, 0, 0, &[]).is_err());
        assert!(stage_layers_by_budget(&[10], 0, 0, &[100, 100]).is_err(), "a stage needs a layer");
        // Through the engine: the pack's own bytes, a budget far larger on the second device.
        let dir = tempfile::tempdir().unwrap();
        write_tiny_pack(dir.path(), &tiny_config(), &TinyPack::default()).unwrap();
        let pack = Pack::open(dir.path()).unwrap();
        let (per_layer, first, last) = stage_bytes(&pack).unwrap();
        assert_eq!(per_layer.len(), tiny_config().num_hidden_layers);
        assert!(per_layer.iter().all(|&b| b > 0) && first > 0 && last > 0);
        let total: u64 = per_layer.iter().sum::<u64>() + first + last;
        let two = vec!["cpu".to_string(), "cpu".to_string()];
        let opts = EngineOptions { devices: two.clone(), stage_memory: Some(vec![total, total]), ..Default::default() };
        let e = Engine::load(dir.path(), &opts).unwrap();
        let want = stage_layers_by_budget(&per_layer, first, last, &[total, total]).unwrap();
        let got: Vec<_> = e.split_stats().unwrap().stages.iter().map(|s| s.layers.clone()).collect();
        assert_eq!(got, want);
        let prompt = [5, 17, 90, 3];
        let mut s = e.new_session(&SessionOptions::default()).unwrap();
        assert_eq!(s.prefill_all(&prompt).unwrap(), logits_of(dir.path(), &EngineOptions::default(), &prompt));
        for bad in [
            EngineOptions { stage_memory: Some(vec![1, 1]), ..opts.clone() },
            EngineOptions { stage_memory: Some(vec![total]), ..opts.clone() },
            EngineOptions { layer_split: Some(vec![1]), ..opts.clone() },
        ] {
            assert!(matches!(Engine::load(dir.path(), &bad), Err(Error::InvalidArgument(_))), "{bad:?}");
        }
    }

    #[test]
    fn stage_budgets_can_hold_a_sessions_kv() {
        let c = tiny_config();
        let a = (0..c.num_hidden_layers).find(|&l| c.is_full_attention(l)).unwrap();
        // K and V of 100 positions: f32, and int8 with one f32 scale per head vector.
        assert_eq!(layer_state_bytes(&c, a, 100, 4.0), (2 * 100 * c.kv_dim() * 4) as u64);
        let int8 = 2 * 100 * (c.kv_dim() + 4 * c.kv_dim() / c.head_dim);
        assert_eq!(layer_state_bytes(&c, a, 100, 1.0), int8 as u64);
        assert_eq!(layer_state_bytes(&c, a, 0, 4.0), 0);
        let dir = tempfile::tempdir().unwrap();
        write_tiny_pack(dir.path(), &c, &TinyPack::default()).unwrap();
        let pack = Pack::open(dir.path()).unwrap();
        let (per_layer, first, last) = stage_bytes(&pack).unwrap();
        let total: u64 = per_layer.iter().sum::<u64>() + first + last;
        let context = 4096;
        let kv: u64 = (0..c.num_hidden_layers).map(|l| layer_state_bytes(&c, l, context, 4.0)).sum();
        assert!(kv > total, "the test wants the KV to outweigh the weights: {kv} vs {total}");
        let opts = EngineOptions {
            devices: vec!["cpu".into(), "cpu".into()],
            stage_memory: Some(vec![total, total]),
            stage_memory_context: context,
            ..Default::default()
        };
        // Both stages' weights fit one budget, but not with the KV of 4096 tokens...
        let err = Engine::load(dir.path(), &opts).err().expect("budgets without the KV").to_string();
        assert!(err.contains("memory budgets"), "{err}");
        // ...which budgets of the weights and the KV hold, split as the rule says.
        let opts = EngineOptions { stage_memory: Some(vec![total + kv, total + kv]), ..opts };
        let e = Engine::load(dir.path(), &opts).unwrap();
        let with_kv: Vec<u64> =
            per_layer.iter().enumerate().map(|(l, b)| b + layer_state_bytes(&c, l, context, 4.0)).collect();
        let want = stage_layers_by_budget(&with_kv, first, last, &[total + kv, total + kv]).unwrap();
        let got: Vec<_> = e.split_stats().unwrap().stages.iter().map(|s| s.layers.clone()).collect();
        assert_eq!(got, want);
        // CUDA stages with a cache: each budget less the slots and the ring (or the VRAM budget).
        let stride = pack.layout().stride;
        let slots = crate::experts::ExpertCacheOptions { slots: Some(4), ring_slots: Some(2), ..Default::default() };
        assert_eq!(cache_left(&pack, &slots, &[100 * stride, 7 * stride]).unwrap(), vec![94 * stride, stride]);
        // The default ring beside a slot for every (layer, expert): 1, nothing streams.
        let pairs = c.num_hidden_layers * c.num_experts;
        let all = crate::experts::ExpertCacheOptions { slots: Some(pairs), ..Default::default() };
        assert_eq!(cache_left(&pack, &all, &[100 * stride]).unwrap(), vec![(100 - pairs as u64 - 1) * stride]);
        let vram = crate::experts::ExpertCacheOptions { vram_budget: Some(10 * stride), ..Default::default() };
        assert_eq!(cache_left(&pack, &vram, &[11 * stride]).unwrap(), vec![stride]);
        let err = cache_left(&pack, &vram, &[9 * stride]).unwrap_err().to_string();
        assert!(err.contains("below the expert cache"), "{err}");
    }

    #[test]
    fn a_split_refuses_mixed_devices_and_bad_split_points() {
        let two = |a: &str, b: &str| vec![a.to_string(), b.to_string()];
        assert_eq!(Device::parse_list(&two("cpu", "cpu")).unwrap(), vec![Device::Cpu, Device::Cpu]);
        for list in [two("cpu", "cuda"), two("cuda:0", "cpu")] {
            let err = Device::parse_list(&list).unwrap_err();
            assert!(matches!(err, Error::Unsupported(ref m) if m.contains("not both")), "{err}");
        }
        // Several CUDA devices are a split like any other: probed each (a
        // machine without CUDA refuses the first with the cause).
        if let Err(err) = Device::parse_list(&two("cuda:0", "cuda:0")) {
            assert!(matches!(err, Error::NoCuda(_)), "{err}");
        }
        let dir = tempfile::tempdir().unwrap();
        write_tiny_pack(dir.path(), &tiny_config(), &TinyPack::default()).unwrap();
        let split = EngineOptions { devices: two("cpu", "cpu"), ..Default::default() };
        let bad = EngineOptions { layer_split: Some(vec![2]), ..split.clone() };
        assert!(matches!(Engine::load(dir.path(), &bad), Err(Error::InvalidArgument(_))));
        let one = EngineOptions { layer_split: Some(vec![1]), ..Default::default() };
        assert!(matches!(Engine::load(dir.path(), &one), Err(Error::InvalidArgument(_))));
        // The split engine gives the one-device logits, counting its hand-offs.
        let e = Engine::load(dir.path(), &split).unwrap();
        let prompt = [5, 17, 90, 3];
        let mut s = e.new_session(&SessionOptions::default()).unwrap();
        assert_eq!(s.prefill_all(&prompt).unwrap(), logits_of(dir.path(), &EngineOptions::default(), &prompt));
        let stats = e.split_stats().unwrap();
        assert_eq!(stats.stages.iter().map(|s| s.layers.clone()).collect::<Vec<_>>(), vec![0..1, 1..2]);
        let hidden = tiny_config().hidden_size;
        assert_eq!((stats.handoffs, stats.handoff_bytes), (1, (prompt.len() * hidden * 4) as u64));
        // Auto: 4 rows are below the threshold, so no help.
        assert_eq!((stats.helped_layers, stats.helper_rows), (0, 0));
    }

    #[test]
    fn load_reports_progress_verifies_and_cancels() {
        let dir = tempfile::tempdir().unwrap();
        write_tiny_pack(dir.path(), &tiny_config(), &TinyPack::default()).unwrap();
        let opts = EngineOptions { verify_checksums: true, ..Default::default() };
        let mut seen = Vec::new();
        Engine::load_with_progress(dir.path(), &opts, &mut |f| {
            seen.push(f);
            true
        })
        .unwrap();
        assert_eq!((seen[0], *seen.last().unwrap()), (0.0, 1.0));
        assert!(seen.windows(2).all(|w| w[0] <= w[1]));
        // Verify ends at 0.5; then 3 steps: 2 layers, the embedding and head.
        let tail = &seen[seen.len() - 4..];
        let want = [0.5, 0.5 + 0.5 / 3.0, 0.5 + 1.0 / 3.0, 1.0];
        assert!(tail.iter().zip(want).all(|(a, b)| (a - b).abs() < 1e-6), "{seen:?}");
        assert!(seen.iter().any(|&f| f > PROGRESS_OPENED && f < PROGRESS_VERIFIED), "{seen:?}");
        let mut last = 0.0;
        let err = Engine::load_with_progress(dir.path(), &opts, &mut |f| {
            last = f;
            f < 0.6
        });
        assert!(matches!(err, Err(Error::Cancelled)));
        assert!((last - (0.5 + 0.5 / 3.0)).abs() < 1e-6, "no call after the cancel: {last}");
        // A corrupt pack fails verification when asked, and only then.
        let pack = Pack::open(dir.path()).unwrap();
        let off = pack.manifest().experts.entries[3].offset as usize + 7;
        drop(pack);
        let path = dir.path().join("experts.bin");
        let mut b = std::fs::read(&path).unwrap();
        b[off] ^= 1;
        std::fs::write(&path, b).unwrap();
        assert!(matches!(Engine::load(dir.path(), &opts), Err(Error::Checksum { .. })));
        assert!(Engine::load(dir.path(), &EngineOptions::default()).is_ok());
    }

    #[test]
    fn dense_shared_expert_equals_its_nvfp4_form() {
        // A qwen3_next pack copied with the shared expert stored as the F32
        // of its NVFP4 dequantization (global scale included) runs the
        // dense path and lands on the NVFP4 path's logits.
        use crate::pack::{DenseTensor, PackWriter};
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let cfg = crate::pack::synth::preset(crate::model::Arch::Qwen3Next, "tiny").unwrap();
        crate::pack::synth::synth(&cfg, a.path(), &Default::default()).unwrap();
        let src = Pack::open(a.path()).unwrap();
        let mut w = PackWriter::create(b.path(), &cfg, "test", true).unwrap();
        let mut dense = 0;
        for t in &src.manifest().tensors {
            let v = src.tensor(&t.name).unwrap();
            let shape: Vec<usize> = v.shape.iter().map(|&d| d as usize).collect();
            let data = match v.data {
                TensorData::F32(bytes) => DenseTensor::F32(bytes),
                TensorData::Bf16(bytes) => DenseTensor::Bf16(bytes),
                TensorData::Nvfp4(m) if t.name.contains("shared_expert.") => {
                    dense += 1;
                    let bytes: Vec<u8> = m.dequantize().iter().flat_map(|x| x.to_le_bytes()).collect();
                    w.add_tensor(&t.name, &shape, DenseTensor::F32(&bytes)).unwrap();
                    continue;
                }
                TensorData::Nvfp4(m) => DenseTensor::Nvfp4(m),
            };
            w.add_tensor(&t.name, &shape, data).unwrap();
        }
        assert!(dense >= 3 * cfg.num_hidden_layers, "{dense} shared expert tensors");
        for l in 0..cfg.num_expert_layers() {
            for e in 0..cfg.num_experts {
                w.write_expert_blob(l, e, src.expert(l, e).unwrap().blob).unwrap();
            }
        }
        w.finish().unwrap();
        let prompt = [3, 9, 27, 81, 5, 1];
        let (x, y) = (
            logits_of(a.path(), &EngineOptions::default(), &prompt),
            logits_of(b.path(), &EngineOptions::default(), &prompt),
        );
        let e = Engine::load(b.path(), &EngineOptions::default()).unwrap();
        assert!(matches!(e.cpu().1.layers[0].shared.as_ref().unwrap().mlp, SharedMlp::Dense { .. }));
        let m = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = x.iter().zip(&y).fold(0.0f32, |d, (p, q)| d.max((p - q).abs()));
        assert!(d <= 1e-5 * m, "dense vs NVFP4 shared expert: {d} of {m}");
    }
}
