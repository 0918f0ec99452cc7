//! The forward pass on one CUDA device (feature `cuda`): the math of the
//! CPU forward in `engine/mod.rs`, op for op, in the kernels of
//! `backend::cuda`, with every weight resident in device memory.
//!
//! - Dense weights are BF16 on the device (a BF16 pack's bytes unchanged;
//!   F32 and NVFP4 dense tensors are rounded to BF16, so only BF16 packs give
//!   the CPU's exact weights). Norm weights and the small DeltaNet tensors
//!   stay f32. Activations are f32 throughout.
//! - Experts stay in the pack's blob layout: every blob of the main layers
//!   is copied once into one device buffer, and a per-layer table of blob
//!   addresses (`u64 [num_experts]`) is what the MoE kernels index with the
//!   expert ids the router kernel produced on the device. A blob carries
//!   its three global scales in its tail: no kernel takes them separately.
//!   An NVFP4 shared expert (qwen3_next) becomes a blob of its own layout
//!   and runs through the same kernels with one expert and its sigmoid gate
//!   as the routing weight.
//! - A forward queues every kernel on the device's stream and waits once,
//!   at the end, to read the non-finite flags (one per layer and one for the
//!   logits) and the logits it was asked for: no host round trip per layer.
//!
//! A session's `DeviceCache` holds its KV (int8 with per-position-and-head
//! scales, or bf16; grown by doubling as the session fills) and the Gated
//! DeltaNet states in the CPU's layouts, so checkpoints copy them to and
//! from host `DeltaNetState`s unchanged.

use std::ops::Range;
use std::sync::Arc;

use half::bf16;

use super::{deltanet_shape, linear_layers, Engine, GpuPrecision, HostLogits, Logits, Piece};
use crate::backend::cuda::attention::{
    self, AttnConfig, AttnPrecision, AttnScratch, DeviceKv, KvDtype, QkvPrep, StepPlan, StepPos,
};
use crate::backend::cuda::cudarc::driver::PinnedHostSlice;
use crate::backend::cuda::deltanet::{
    deltanet_core_with, DeltaNetDeviceWeights, DeltaNetScratch, DeltaRuleForm, DeviceDeltaState,
};
use crate::backend::cuda::dense::{self, GemmPrecision, NormIn, RopeTable, Write};
use crate::backend::cuda::moe::{self, BlobLayout, ExpertGrouping, FusedScratch, GroupedPrecision};
use crate::backend::cuda::sampling;
use crate::backend::cuda::{CudaEvent, CudaSlice, CudaStream, DevicePtr, Gpu, StreamHold};
use crate::backend::{AttentionShape, DeltaNetState, Rope};
use crate::error::{Error, Result};
use crate::experts::gpu::{GpuExpertCache, TracePhase};
use crate::experts::StepPlan as ExpertStepPlan;
use crate::experts::{ExpertCacheOptions, ExpertStats};
use crate::model::weights::{layer_tensor_name, model_tensor_name, Role};
use crate::model::ModelConfig;
use crate::pack::format::ExpertLayout;
use crate::pack::{Pack, TensorData};
use crate::sampling::{DrawAhead, Drawn};
use crate::session::KvType;
use cudarc::driver::{sys, CudaGraph};

/// Rows up to which the MoE runs the per-token GEMV kernels (decode,
/// speculative verify); above, the grouped kernels (prefill).
const MOE_GEMV_MAX_ROWS: usize = 8;
// Mapped decode runs the GEMV path.
const _: () = assert!(MOE_GEMV_MAX_ROWS == crate::experts::gpu::MAPPED_MAX_ROWS);

/// `STRATA_TRACE_FORWARD=1`: each forward prints how long queueing its
/// layers took on the host and how long the whole forward took, which
/// tells a host-bound step (launch overhead) from a device-bound one.
fn trace_forward() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("STRATA_TRACE_FORWARD").is_ok_and(|v| v == "1"))
}

/// `STRATA_DECODE_SKIP=name,...` (a `test-hooks` build; one-row steps
/// only): every attention layer leaves out the named kernels (`qkv`,
/// `prep`, `attn`, `oproj`, `router`, and on the GEMV paths, resident or
/// mapped, `gateup` and `down`), and `head` the LM head, so the bench can
/// time a decode step without them: what a kernel adds to the step is the
/// difference. The results are wrong (left-out kernels leave their outputs
/// stale); nothing but timing may use it. `strata bench` refuses names
/// not in DECODE_SKIP_NAMES.
#[cfg(feature = "test-hooks")]
fn skipped(t: usize, name: &str) -> bool {
    static SKIP: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    let skip = SKIP.get_or_init(|| {
        let v = std::env::var("STRATA_DECODE_SKIP").unwrap_or_default();
        v.split(',').filter(|s| !s.is_empty()).map(str::to_owned).collect()
    });
    t == 1 && skip.iter().any(|s| s == name)
}

#[cfg(not(feature = "test-hooks"))]
fn skipped(_t: usize, _name: &str) -> bool {
    false
}

/// The logits the decode down GEMV routes from itself (`expert_down_gemv_routed`): none when the gate/up GEMV is
/// left out (`STRATA_DECODE_SKIP`), since the kernel before it must be that GEMV.
fn route_logits<'a>(c: &ModelConfig, router: &'a CudaSlice<f32>, t: usize) -> Option<moe::Logits<'a>> {
    (!skipped(t, "gateup")).then_some(moe::Logits {
        logits: router,
        num_experts: c.num_experts,
        norm_topk_prob: c.norm_topk_prob,
    })
}

/// The kernels `STRATA_DECODE_SKIP` can name.
pub const DECODE_SKIP_NAMES: [&str; 8] = ["qkv", "prep", "attn", "oproj", "router", "gateup", "down", "head"];

fn attention_shape(c: &ModelConfig) -> AttentionShape {
    AttentionShape { heads: c.num_attention_heads, kv_heads: c.num_key_value_heads, head_dim: c.head_dim }
}

/// What a captured decode step reads on the device each call: the
/// position (and the attention's key split), with the launch plan fixed at
/// capture.
struct Step {
    pos: StepPos,
    plan: StepPlan,
}

/// A captured decode step, the buffer generation it points to, and the
/// expert cache's `mapped_epoch` it chose its expert kernels by.
struct DecodeGraph {
    graph: CudaGraph,
    generation: u64,
    experts_epoch: u64,
}

// SAFETY: a CUDA graph has no thread affinity; it must only not be used
// from two threads at once. A `DecodeGraph` lives in one session's cache
// and is only touched through `&mut` of that cache (a session is used by
// one call at a time), so moving it to another thread is sound.
unsafe impl Send for DecodeGraph {}

/// A capture of a stream in progress: if a panic unwinds through it, its
/// drop ends the capture (and drops the graph), so that the stream, which
/// other sessions share, does not stay capturing.
struct OpenCapture<'a>(Option<&'a Arc<CudaStream>>);

impl Drop for OpenCapture<'_> {
    fn drop(&mut self) {
        if let Some(stream) = self.0.take() {
            let _ = stream.end_capture(sys::CUgraphInstantiate_flags(0));
        }
    }
}

/// First capacity of a session's device KV, in positions.
const KV_INITIAL_CAPACITY: usize = 256;

/// A model loaded onto CUDA devices: one stage per device of a layer
/// split (one stage without a split), in layer order
/// (docs/layer-split.md).
pub(crate) struct GpuModel {
    config: ModelConfig,
    stages: Vec<GpuStage>,
    /// Per stage: whether its helper (`helper_of`) can read its memory
    /// (the same GPU, or a peer with access enabled); prefill help skips
    /// a stage whose helper cannot.
    helpable: Vec<bool>,
}

/// The layers `range` of a model on one device: their weights, the
/// embedding on the first stage (and on the last when the head is tied to
/// it), the final norm and head on the last. A device here is a logical
/// one: two stages may share a GPU, each with its own stream.
struct GpuStage {
    gpu: Arc<Gpu>,
    config: ModelConfig,
    range: Range<usize>,
    /// On the first stage, and on the last when the head is tied to it.
    embed: Option<CudaSlice<bf16>>,
    /// On the last stage.
    head: Option<GpuHead>,
    /// `layers[l - range.start]`.
    layers: Vec<GpuLayer>,
    rope: RopeTable,
    /// Every expert blob of this stage's layers at the pack's stride (empty
    /// with an expert cache). Only the tables below point into it.
    _experts: CudaSlice<u8>,
    /// `tables[l - range.start]`: the device address of each expert's blob
    /// of layer `l` (empty with an expert cache: its tables are used).
    tables: Vec<CudaSlice<u64>>,
    /// The expert cache, when `EngineOptions::expert_cache` asks for one:
    /// experts in device slots, page-locked RAM and the mapped pack (one
    /// stage only, for now).
    experts: Option<parking_lot::Mutex<GpuExpertCache>>,
    layout: BlobLayout,
    precision: GpuPrecision,
}

struct GpuHead {
    final_norm: CudaSlice<f32>,
    /// `None` when tied to the embedding.
    lm_head: Option<CudaSlice<bf16>>,
}

struct GpuLayer {
    input_norm: CudaSlice<f32>,
    mixer: GpuMixer,
    post_attn_norm: CudaSlice<f32>,
    router: CudaSlice<bf16>,
    shared: Option<GpuShared>,
}

enum GpuMixer {
    Attention {
        /// q_proj, k_proj and v_proj stacked: `[q_proj_dim + 2 * kv_dim, hidden]`,
        /// one projection whose rows are `[q' | k | v]` (`attention::qkv_prepare`).
        qkv: CudaSlice<bf16>,
        o_proj: CudaSlice<bf16>,
        q_norm: CudaSlice<f32>,
        k_norm: CudaSlice<f32>,
    },
    Linear {
        in_proj_qkvz: CudaSlice<bf16>,
        in_proj_ba: CudaSlice<bf16>,
        out_proj: CudaSlice<bf16>,
        /// Boxed: the variants' sizes stay close.
        small: Box<DeltaNetDeviceWeights>,
    },
}

/// qwen3_next's shared expert: `sigmoid(h . gate) * mlp(h)`.
struct GpuShared {
    /// `[1, hidden]`.
    gate: CudaSlice<bf16>,
    intermediate: usize,
    mlp: GpuSharedMlp,
}

enum GpuSharedMlp {
    /// One blob in the routed experts' layout (for its own intermediate
    /// size), global scales in its tail; `table` holds its address.
    Nvfp4 {
        _blob: CudaSlice<u8>,
        table: CudaSlice<u64>,
        layout: BlobLayout,
    },
    Dense {
        gate: CudaSlice<bf16>,
        up: CudaSlice<bf16>,
        down: CudaSlice<bf16>,
    },
}

/// A dense tensor as BF16 for the device (see the module doc).
fn to_bf16(pack: &Pack, name: &str, shape: &[usize]) -> Result<Vec<bf16>> {
    let t = pack.tensor(name)?;
    let want: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
    if t.shape != want.as_slice() {
        return Err(Error::tensor(name, format!("shape {:?}, the engine needs {shape:?}", t.shape)));
    }
    Ok(match t.data {
        TensorData::Bf16(b) => b.chunks_exact(2).map(|p| bf16::from_bits(u16::from_le_bytes([p[0], p[1]]))).collect(),
        _ => t.to_f32().into_iter().map(bf16::from_f32).collect(),
    })
}

fn upload_bf16(gpu: &Gpu, pack: &Pack, name: &str, shape: &[usize]) -> Result<CudaSlice<bf16>> {
    gpu.upload(&to_bf16(pack, name, shape)?)
}

fn upload_f32(gpu: &Gpu, pack: &Pack, name: &str, len: usize, zero_centered: bool) -> Result<CudaSlice<f32>> {
    let t = pack.tensor(name)?;
    if t.numel() != len {
        return Err(Error::tensor(name, format!("{} elements, the engine needs {len}", t.numel())));
    }
    let mut v = t.to_f32();
    if zero_centered {
        v.iter_mut().for_each(|x| *x += 1.0);
    }
    gpu.upload(&v)
}

/// The device address of the start of `buf`.
fn address<T>(gpu: &Gpu, buf: &CudaSlice<T>) -> u64 {
    let (ptr, _sync) = buf.device_ptr(gpu.stream());
    ptr
}

impl GpuModel {
    /// Copies the pack's weights to the devices, stage `i`'s layers
    /// `ranges[i]` to `gpus[i]`; `progress(done, total)` after each layer.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn load(
        pack: &Pack,
        gpus: Vec<Arc<Gpu>>,
        ranges: Vec<Range<usize>>,
        rope: &Rope,
        precision: GpuPrecision,
        cache_opts: &ExpertCacheOptions,
        progress: &mut dyn FnMut(usize, usize) -> Result<()>,
    ) -> Result<GpuModel> {
        assert_eq!(gpus.len(), ranges.len(), "GpuModel::load: one device per stage");
        let c = pack.config().clone();
        let total = c.num_hidden_layers + 1;
        let n = ranges.len();
        // A cache per stage: the slots or VRAM budget on each device, the
        // host budget divided among the stages.
        let staging = cache_opts.pool_workers as u64 * pack.layout().stride;
        let host = cache_opts
            .host_budget
            .map(|b| crate::experts::stage_host_budgets(b, &ranges, c.num_hidden_layers, staging));
        let mut done = 0;
        let mut stages = Vec::with_capacity(n);
        for (i, (gpu, range)) in gpus.into_iter().zip(ranges).enumerate() {
            let mut layer_done = || {
                done += 1;
                progress(done, total)
            };
            let at = StagePlace { first: i == 0, last: i + 1 == n };
            let opts = ExpertCacheOptions { host_budget: host.as_ref().map(|h| h[i]), ..cache_opts.clone() };
            stages.push(GpuStage::load(pack, gpu, range, at, rope, precision, &opts, &mut layer_done)?);
        }
        enable_peer_access(&stages)?;
        // Help needs the helper to read the active stage's memory, and the
        // tensor-core grouped kernels on both (only they honour the
        // helper's row tiles).
        let tiles = |g: &Gpu| moe::grouped_tensor_core_paths(g, &stages[0].layout) == (true, true);
        let helpable = (0..n)
            .map(|i| {
                let (active, helper) = (&*stages[i].gpu, &*stages[helper_of(i, n)].gpu);
                n > 1 && peer_readable(helper, active) && tiles(active) && tiles(helper)
            })
            .collect();
        progress(total, total)?;
        Ok(GpuModel { config: c, stages, helpable })
    }

    /// Every stage's stream, held by this thread (`Gpu::queue`): a session
    /// on another thread queues nothing on them meanwhile.
    fn hold(&self) -> StreamHold {
        StreamHold::new(self.stages.iter().map(|s| &s.gpu))
    }

    /// The statistics of the expert caches, every stage's added up (`None`
    /// without a cache).
    pub(crate) fn expert_stats(&self) -> Option<ExpertStats> {
        self.expert_routed().map(|(s, _)| s)
    }

    /// Each stage cache's planned tiers, in stage order.
    pub(crate) fn expert_tiers(&self) -> Vec<crate::experts::Capacity> {
        self.stages.iter().filter_map(|s| s.experts.as_ref()).map(|x| x.lock().planner().capacity()).collect()
    }

    /// The statistics of the expert caches and the tokens routed to each
    /// (layer, expert), every stage's layers in order.
    pub(crate) fn expert_routed(&self) -> Option<(ExpertStats, Vec<Vec<u64>>)> {
        let mut all: Option<(ExpertStats, Vec<Vec<u64>>)> = None;
        for x in self.stages.iter().filter_map(|s| s.experts.as_ref()) {
            let mut x = x.lock();
            // (The copies' link time as far as measured; without it on a driver error.)
            let stats = x.stats_now().unwrap_or_else(|_| x.stats());
            let counts = x.planner().routed_counts();
            match all.as_mut() {
                None => all = Some((stats, counts)),
                Some((s, c)) => {
                    s.add_stage(&stats);
                    c.extend(counts);
                }
            }
        }
        all
    }

    /// Every stage's expert cache, locked (`None` for a stage without one).
    fn lock_caches(&self) -> Vec<Option<parking_lot::MutexGuard<'_, GpuExpertCache>>> {
        self.stages.iter().map(|s| s.experts.as_ref().map(|x| x.lock())).collect()
    }

    /// `begin_forward` of every stage's cache.
    fn begin_caches(caches: &mut [Option<parking_lot::MutexGuard<'_, GpuExpertCache>>], t: usize) -> Result<()> {
        caches.iter_mut().flatten().try_for_each(|x| x.begin_forward(t))
    }

    /// `end_forward` of every stage's cache after a forward that returned
    /// `r` (each cache's statistics and swaps follow its stage's steps, so
    /// every one runs; the first failure is returned).
    fn end_caches<T>(
        caches: &mut [Option<parking_lot::MutexGuard<'_, GpuExpertCache>>],
        pack: &Pack,
        t: usize,
        r: Result<T>,
    ) -> Result<T> {
        let Ok(v) = r else { return r };
        let mut first = Ok(());
        for x in caches.iter_mut().flatten() {
            let e = x.end_forward(pack, t);
            if first.is_ok() {
                first = e;
            }
        }
        first.map(|()| v)
    }

    /// A session cache on these devices: each stage's KV and recurrent
    /// states on its own device.
    pub(crate) fn new_cache(&self, kv_type: KvType) -> Result<DeviceCache> {
        let dtype = match kv_type {
            KvType::Auto | KvType::Int8 => KvDtype::Int8,
            KvType::Bf16 => KvDtype::Bf16,
            KvType::F32 => {
                return Err(Error::Unsupported("kv_type F32: the cuda backend keeps int8 (default) or bf16 KV".into()))
            }
        };
        let places = self.stages.iter().map(|s| (s.gpu.clone(), s.range.clone())).collect();
        let _held = self.hold();
        DeviceCache::new(places, &self.config, dtype)
    }

    /// `Engine::forward` on the devices: runs `tokens` at positions
    /// `cache.len()..`, returns the requested logits; on error the cache is
    /// back where it was (KV length and recurrent states).
    pub(crate) fn forward(
        &self,
        engine: &Engine,
        cache: &mut DeviceCache,
        tokens: &[u32],
        logits: Logits,
        draw: Option<&DrawAhead>,
    ) -> Result<HostLogits> {
        let _held = self.hold();
        let start = cache.len;
        cache.reserve(tokens.len())?;
        let hybrid = cache.is_hybrid();
        if hybrid {
            cache.snapshot()?;
        }
        match self.forward_rows(engine, cache, tokens, logits, draw) {
            Ok(l) => {
                cache.len = start + tokens.len();
                Ok(l)
            }
            Err(e) => {
                cache.len = start;
                if hybrid {
                    cache.restore_snapshot()?;
                }
                Err(e)
            }
        }
    }

    fn forward_rows(
        &self,
        engine: &Engine,
        cache: &mut DeviceCache,
        tokens: &[u32],
        want: Logits,
        draw: Option<&DrawAhead>,
    ) -> Result<HostLogits> {
        if tokens.len() == 1 && want == Logits::Last && self.graph_allowed(engine) {
            return self.forward_graph(engine, cache, tokens[0], draw);
        }
        let t = tokens.len();
        let start = cache.len;
        let rows = want.rows(t);
        let first = &self.stages[0];
        let mut experts = self.lock_caches();
        Self::begin_caches(&mut experts, t)?;
        let mut scratch = Vec::with_capacity(self.stages.len());
        for sc in cache.stages.iter_mut() {
            scratch.push(sc.take_scratch(t)?);
        }
        let started = std::time::Instant::now();
        let k = self.config.num_experts_per_tok;
        let help = engine.prefill_help().applies(self.stages.len(), t) && t > MOE_GEMV_MAX_ROWS;
        let r = (|| -> Result<HostLogits> {
            first.gpu.stream().memcpy_htod(tokens, &mut scratch[0].tokens)?;
            for (i, (stage, x)) in self.stages.iter().zip(experts.iter_mut()).enumerate() {
                if i > 0 {
                    self.hand_off(cache, &mut scratch, i)?;
                } else {
                    cache.stages[0].clock.start(&stage.gpu)?;
                }
                let helper = (help && self.helpable[i]).then(|| helper_of(i, self.stages.len()));
                let (own, helping) = split_scratch(&mut scratch, i, helper);
                let help = helping.map(|h| {
                    let index = helper.expect("with a helper's scratch");
                    let share = engine.inner.help_rates.lock().share(i, index, GPU_HELP_SHARE);
                    StageHelp { stage: &self.stages[index], index, scratch: h, share }
                });
                stage.enqueue(engine, &mut cache.stages[i], own, start, rows, None, x.as_deref_mut(), help)?;
                cache.stages[i].clock.end(&stage.gpu)?;
            }
            for x in experts.iter_mut().flatten().filter(|x| x.mapped_decode(t)) {
                x.note_mapped_forward(t, k)?;
            }
            self.finish(engine, cache, &mut scratch, Queued { start, rows, started, draw })
        })();
        self.settle(&r);
        for (sc, s) in cache.stages.iter_mut().zip(scratch) {
            sc.put_scratch(s);
        }
        Self::end_caches(&mut experts, engine.pack(), t, r)
    }

    /// After a failed forward of a split: waits for every stream, so that
    /// no queued hand-off or helper kernel still reads a scratch buffer
    /// that the next forward may free or reuse (a successful forward has
    /// waited in `finish`). A failure to wait is the forward's error
    /// already, or the next call's.
    fn settle<T>(&self, r: &Result<T>) {
        if r.is_err() && self.stages.len() > 1 {
            for stage in &self.stages {
                let _ = stage.gpu.sync();
            }
        }
    }

    /// The one hidden-state hand-off of a forward from stage `i - 1` to
    /// stage `i`: `x` (every row) copied on stage `i`'s stream once stage
    /// `i - 1` has queued its layers (a peer copy between GPUs, a copy
    /// within the device between two logical devices on one GPU).
    fn hand_off(&self, cache: &mut DeviceCache, scratch: &mut [Scratch], i: usize) -> Result<()> {
        let (from, to) = (&self.stages[i - 1], &self.stages[i]);
        let (before, after) = scratch.split_at_mut(i);
        let (src, dst) = (&before[i - 1].x, &mut after[0].x);
        let stream = to.gpu.stream();
        stress(&from.gpu)?;
        stream.wait(&from.gpu.stream().record_event(None)?)?;
        cache.stages[i].clock.hand_off(&to.gpu)?;
        stream.memcpy_dtod(src, dst)?;
        cache.stages[i].clock.start(&to.gpu)?;
        cache.stages[i].handoff_bytes += (src.len() * std::mem::size_of::<f32>()) as u64;
        Ok(())
    }

    /// Whether a one-row decode step may run as a CUDA graph: on unless
    /// `STRATA_CUDA_GRAPH=0`, and not while a test injects a NaN (the
    /// injection is a host decision made while queueing).
    #[cfg_attr(not(any(test, feature = "test-hooks")), allow(unused_variables))]
    fn graph_allowed(&self, engine: &Engine) -> bool {
        if self.stages.iter().any(|s| s.experts.as_ref().is_some_and(|x| !x.lock().mapped_decode(1))) {
            // The expert cache decides copies on the host at every layer
            // (unless decode runs mapped).
            return false;
        }
        #[cfg(any(test, feature = "test-hooks"))]
        if engine.nan_pending() {
            return false;
        }
        static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *ON.get_or_init(|| std::env::var("STRATA_CUDA_GRAPH").map_or(true, |v| v != "0"))
    }

    /// A decode step (one row, the last logits) replayed from CUDA graphs,
    /// one per stage: each stage's step is captured once per session (again
    /// when its buffers move: KV growth), and each call writes the token and
    /// the position to the devices, launches the first stage's graph, then
    /// each hand-off and the next stage's graph. The kernels that depend on
    /// the position read it from device memory (`StepPos`).
    fn forward_graph(
        &self,
        engine: &Engine,
        cache: &mut DeviceCache,
        token: u32,
        draw: Option<&DrawAhead>,
    ) -> Result<HostLogits> {
        let c = &self.config;
        let start = cache.len;
        let mut experts = self.lock_caches();
        Self::begin_caches(&mut experts, 1)?;
        let mut scratch = Vec::with_capacity(self.stages.len());
        for sc in cache.stages.iter_mut() {
            scratch.push(sc.take_scratch(1)?);
        }
        let started = std::time::Instant::now();
        let r = (|| -> Result<HostLogits> {
            for (i, stage) in self.stages.iter().enumerate() {
                if i > 0 {
                    self.hand_off(cache, &mut scratch, i)?;
                } else {
                    stage.gpu.stream().memcpy_htod(&[token], &mut scratch[0].tokens)?;
                    cache.stages[0].clock.start(&stage.gpu)?;
                }
                stage.launch_step(engine, &mut cache.stages[i], &mut scratch[i], start, experts[i].as_deref_mut())?;
                cache.stages[i].clock.end(&stage.gpu)?;
            }
            for x in experts.iter_mut().flatten() {
                x.note_mapped_forward(1, c.num_experts_per_tok)?;
            }
            self.finish(engine, cache, &mut scratch, Queued { start, rows: 1, started, draw })
        })();
        self.settle(&r);
        for (sc, s) in cache.stages.iter_mut().zip(scratch) {
            sc.put_scratch(s);
        }
        Self::end_caches(&mut experts, engine.pack(), 1, r)
    }

    /// Whether `forward_pieces` pipelines `pieces` on these stages: several
    /// of both, no expert cache (its steps wait on the host for routed ids), prefill help not
    /// forced on (help needs an idle stage), the run's logits (held on the
    /// device until its end) within `PIPELINE_LOGITS_BYTES`, and not turned
    /// off by `STRATA_GPU_PIPELINE=0`.
    pub(crate) fn pipelines(&self, engine: &Engine, pieces: &[Piece<'_>]) -> bool {
        static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        let on = *ON.get_or_init(|| std::env::var("STRATA_GPU_PIPELINE").map_or(true, |v| v != "0"));
        let rows: usize = pieces.iter().map(|p| p.rows()).sum();
        let logits = rows as u64 * self.config.vocab_size as u64 * 4;
        on && self.stages.len() > 1
            && pieces.len() > 1
            && self.stages.iter().all(|s| s.experts.is_none())
            && engine.prefill_help() != super::Help::On
            && logits <= PIPELINE_LOGITS_BYTES
    }

    /// Pipelined windows on CUDA stages (`Engine::forward_pieces`): every
    /// piece of the run is queued on every stage's stream without a wait
    /// on the host in between, so a stage's stream runs piece `j + 1`
    /// while the next stage's runs piece `j`. Each hand-off waits for the
    /// producing stage's piece, and a stage waits for the next stage's copy
    /// of its hidden state before it writes that buffer for another piece.
    /// Each piece has its own non-finite flags and (when it wants logits)
    /// its own device copy of them; the host waits once at the end.
    ///
    /// A failing piece (its flags, read at the end) keeps the pieces before
    /// it: the KV length goes there; on a hybrid model the recurrent states
    /// go back to before the run and the completed pieces run again, one
    /// at a time (not when `!keep_completed`: the cache then goes back to
    /// the start of the run).
    pub(crate) fn forward_pipelined(
        &self,
        engine: &Engine,
        cache: &mut DeviceCache,
        pieces: &[Piece<'_>],
        keep_completed: bool,
    ) -> (Vec<HostLogits>, Option<Error>) {
        let _held = self.hold();
        let start = cache.len;
        let mut starts = vec![start];
        for p in pieces {
            starts.push(starts[starts.len() - 1] + p.tokens.len());
        }
        let total = starts[pieces.len()] - start;
        let hybrid = cache.is_hybrid();
        let prepared = cache.reserve(total).and_then(|()| if hybrid { cache.snapshot() } else { Ok(()) });
        if let Err(e) = prepared {
            return (Vec::new(), Some(e));
        }
        let (flags, outs) = match self.queue_pieces(engine, cache, pieces, &starts) {
            Ok(r) => r,
            Err(e) => {
                if hybrid {
                    if let Err(r) = cache.restore_snapshot() {
                        return (Vec::new(), Some(r));
                    }
                }
                return (Vec::new(), Some(e));
            }
        };
        // The first failing piece, by its flags.
        let mut failed = None;
        for (j, p) in pieces.iter().enumerate() {
            let rows = p.rows();
            let of_piece: Vec<Vec<u32>> = flags.iter().map(|f| f[j].clone()).collect();
            if let Err(e) = self.check_flags(&of_piece, starts[j], p.tokens.len(), rows) {
                failed = Some((j, e));
                break;
            }
        }
        let done = failed.as_ref().map_or(pieces.len(), |(j, _)| *j);
        let last = &self.stages[self.stages.len() - 1].gpu;
        let mut logits = Vec::with_capacity(done);
        for out in outs.iter().take(done) {
            let l = match out {
                Some(d) => match last.download(d) {
                    Ok(v) => v,
                    Err(e) => {
                        // Back to the run's start (the KV length still is).
                        if hybrid {
                            let _ = cache.restore_snapshot();
                        }
                        return (Vec::new(), Some(e));
                    }
                },
                None => Vec::new(),
            };
            logits.push(HostLogits::from(l));
        }
        engine.record_split(|s| s.pipelined_windows += done as u64);
        let Some((_, err)) = failed else {
            cache.len = start + total;
            return (logits, None);
        };
        if !hybrid {
            cache.len = starts[done];
            return (logits, Some(err));
        }
        if let Err(e) = cache.restore_snapshot() {
            return (Vec::new(), Some(e));
        }
        if !keep_completed {
            return (Vec::new(), Some(err));
        }
        for (k, p) in pieces[..done].iter().enumerate() {
            if let Err(e) = self.forward(engine, cache, p.tokens, Logits::Skip, None) {
                // Not expected (the same rows ran before): the cache holds
                // the pieces that did run again.
                logits.truncate(k);
                return (logits, Some(e));
            }
        }
        (logits, Some(err))
    }

    /// Queues every piece on every stage (`forward_pipelined`); returns
    /// each stage's flags per piece, read back after the wait, and each
    /// piece's device copy of its logits (`None` for `Logits::Skip`).
    #[allow(clippy::type_complexity)]
    fn queue_pieces(
        &self,
        engine: &Engine,
        cache: &mut DeviceCache,
        pieces: &[Piece<'_>],
        starts: &[usize],
    ) -> Result<(Vec<Vec<Vec<u32>>>, Vec<Option<CudaSlice<f32>>>)> {
        let c = &self.config;
        let (n, h, vocab) = (self.stages.len(), c.hidden_size, c.vocab_size);
        // Per stage: a scratch per piece size in the run, and the flags of each piece.
        let mut scratch: Vec<Vec<Scratch>> = (0..n).map(|_| Vec::new()).collect();
        let mut flags: Vec<Vec<CudaSlice<u32>>> = Vec::with_capacity(n);
        for stage in &self.stages {
            flags.push(
                (0..pieces.len()).map(|_| stage.gpu.alloc_zeros(c.num_hidden_layers + 1)).collect::<Result<_>>()?,
            );
        }
        let mut outs: Vec<Option<CudaSlice<f32>>> = Vec::with_capacity(pieces.len());
        // consumed[i]: recorded on stage i + 1's stream after its copy of
        // stage i's hidden state.
        let mut consumed: Vec<Option<CudaEvent>> = (0..n).map(|_| None).collect();
        let mut bytes = 0u64;
        let r = (|| -> Result<()> {
            for (i, stage) in self.stages.iter().enumerate() {
                cache.stages[i].clock.start(&stage.gpu)?;
            }
            for (j, p) in pieces.iter().enumerate() {
                let t = p.tokens.len();
                let rows = p.rows();
                let mut out = None;
                for (i, stage) in self.stages.iter().enumerate() {
                    let stream = stage.gpu.stream();
                    let si = match scratch[i].iter().position(|s| s.t == t) {
                        Some(si) => si,
                        None => {
                            scratch[i].push(cache.stages[i].take_scratch(t)?);
                            scratch[i].len() - 1
                        }
                    };
                    if let Some(ev) = consumed[i].take() {
                        stream.wait(&ev)?;
                    }
                    if i == 0 {
                        stream.memcpy_htod(p.tokens, &mut scratch[0][si].tokens)?;
                    } else {
                        let prev = &self.stages[i - 1];
                        let pi =
                            scratch[i - 1].iter().position(|s| s.t == t).expect("the previous stage ran this piece");
                        let (before, after) = scratch.split_at_mut(i);
                        stress(&prev.gpu)?;
                        stream.wait(&prev.gpu.stream().record_event(None)?)?;
                        stream.memcpy_dtod(&before[i - 1][pi].x, &mut after[0][si].x)?;
                        consumed[i - 1] = Some(stream.record_event(None)?);
                        bytes += (t * h * std::mem::size_of::<f32>()) as u64;
                    }
                    let sc = &mut cache.stages[i];
                    std::mem::swap(&mut sc.flags, &mut flags[i][j]);
                    let queued = stage.enqueue(engine, sc, &mut scratch[i][si], starts[j], rows, None, None, None);
                    std::mem::swap(&mut sc.flags, &mut flags[i][j]);
                    queued?;
                    if i + 1 == n && rows > 0 {
                        let lg = LogitScratch::get(&mut scratch[i][si].head, &stage.gpu, rows, h, vocab)?;
                        let mut copy = stage.gpu.alloc_zeros::<f32>(rows * vocab)?;
                        stream.memcpy_dtod(&lg.logits, &mut copy)?;
                        out = Some(copy);
                    }
                }
                outs.push(out);
            }
            for (i, stage) in self.stages.iter().enumerate() {
                cache.stages[i].clock.end(&stage.gpu)?;
            }
            Ok(())
        })();
        // Every stream done before a scratch is kept or freed (another
        // stage's stream may read it); a failure to wait fails the run.
        let mut r = r;
        for stage in &self.stages {
            let waited = stage.gpu.sync();
            if r.is_ok() {
                r = waited;
            }
        }
        for (sc, kept) in cache.stages.iter_mut().zip(scratch) {
            for s in kept {
                sc.put_scratch(s);
            }
        }
        r?;
        let mut host = Vec::with_capacity(n);
        for (i, stage) in self.stages.iter().enumerate() {
            let mut per_piece = Vec::with_capacity(pieces.len());
            for f in &flags[i] {
                per_piece.push(stage.gpu.download(f)?);
            }
            host.push(per_piece);
        }
        let mut seconds = Vec::with_capacity(n);
        for sc in &mut cache.stages {
            seconds.push(sc.clock.read()?.0);
        }
        engine.record_split(|s| {
            for (st, sec) in s.stages.iter_mut().zip(&seconds) {
                st.seconds += sec;
            }
            s.handoffs += ((n - 1) * pieces.len()) as u64;
            s.handoff_bytes += bytes;
        });
        Ok((host, outs))
    }

    /// The non-finite error of the first layer (or the logits) flagged in
    /// any stage's `flags` of a forward of `t` rows at `start` whose last
    /// `rows` rows have logits. Each slot is written by one stage: the one
    /// running the layer after it (the last layer and the logits: the last
    /// stage); the others hold NONFINITE_NONE there.
    fn check_flags(&self, flags: &[Vec<u32>], start: usize, t: usize, rows: usize) -> Result<()> {
        let c = &self.config;
        let (h, vocab) = (c.hidden_size, c.vocab_size);
        let none = dense::NONFINITE_NONE;
        let first_logit_row = start + t - rows;
        for slot in 0..=c.num_hidden_layers {
            let flag = flags.iter().map(|f| f[slot]).find(|&f| f != none).unwrap_or(none);
            let width = if slot < c.num_hidden_layers { h } else { vocab };
            if let Some((row, _)) = dense::nonfinite_row(flag, width) {
                let place =
                    if slot < c.num_hidden_layers { format!("at layer {slot}") } else { "in the logits".into() };
                let pos = if slot < c.num_hidden_layers { start + row } else { first_logit_row + row };
                return Err(Error::NonFinite(format!("NaN or infinity {place}, position {pos}")));
            }
        }
        Ok(())
    }

    /// Waits for a queued forward and returns its logits (the last `rows`
    /// rows, from the last stage), or the non-finite error of the first
    /// layer (or the logits) whose flag is set on any stage; a split's
    /// stage and hand-off times go to the engine's `SplitStats`.
    fn finish(
        &self,
        engine: &Engine,
        cache: &mut DeviceCache,
        scratch: &mut [Scratch],
        queued: Queued<'_>,
    ) -> Result<HostLogits> {
        let Queued { start, rows, started, draw } = queued;
        let c = &self.config;
        let (h, vocab) = (c.hidden_size, c.vocab_size);
        let t = scratch[0].t;
        let queued = started.elapsed();
        // Every copy queued, then the waits: the logits (page-locked, async)
        // before the flags (pageable: the host waits for each).
        let n = self.stages.len();
        let last = &self.stages[n - 1];
        // One row (a decode step): straight into a page-locked buffer the
        // session keeps (no copy into a vector); more: through the
        // scratch's page-locked buffer into a vector.
        let mut one_row = None;
        // The next step's draw (a decode step whose session asked for one):
        // queued after the logits, read back with the flags.
        let mut drawn = None;
        if rows > 0 {
            let lg = LogitScratch::get(&mut scratch[n - 1].head, &last.gpu, rows, h, vocab)?;
            if rows == 1 {
                let mut buf = cache.stages[n - 1].logit_pool.take(&last.gpu, vocab)?;
                last.gpu.stream().memcpy_dtoh(&lg.logits, &mut buf)?;
                one_row = Some(buf);
                if let Some(d) = draw.filter(|_| device_draw_on()) {
                    let ds = match &mut lg.draw {
                        Some(ds) => ds,
                        None => lg.draw.insert(sampling::DrawScratch::new(&last.gpu, vocab)?),
                    };
                    sampling::draw(&last.gpu, &lg.logits, &d.params, d.u, ds)?;
                    let mut out = vec![0u32; 2];
                    last.gpu.stream().memcpy_dtoh(&ds.out, &mut out)?;
                    drawn = Some((d, out));
                }
            } else {
                last.gpu.stream().memcpy_dtoh(&lg.logits, &mut lg.host)?;
            }
        }
        let mut flags = vec![vec![0u32; c.num_hidden_layers + 1]; n];
        for (i, stage) in self.stages.iter().enumerate() {
            stage.gpu.stream().memcpy_dtoh(&cache.stages[i].flags, &mut flags[i])?;
        }
        for stage in &self.stages {
            stage.gpu.sync()?;
        }
        let drawn = drawn.and_then(|(d, out)| {
            (out[0] != sampling::DRAW_NONE && (out[0] as usize) < vocab).then(|| Drawn {
                params: d.params.clone(),
                rng: d.rng,
                token: out[0],
                used: out[1] != 0,
            })
        });
        let out = match one_row {
            Some(buf) => HostLogits::pinned(PinnedLogits::new(buf, &cache.stages[n - 1].logit_pool)?).with_drawn(drawn),
            None if rows > 0 => {
                let lg = LogitScratch::get(&mut scratch[n - 1].head, &last.gpu, rows, h, vocab)?;
                lg.host.as_slice()?.to_vec().into()
            }
            None => Vec::new().into(),
        };
        if n > 1 {
            let (mut seconds, mut handoff) = (Vec::with_capacity(n), 0.0);
            let (mut bytes, mut helped, mut helper_rows) = (0, 0, 0);
            let mut rates = engine.inner.help_rates.lock();
            for (i, sc) in cache.stages.iter_mut().enumerate() {
                // (A sample that cannot be read is dropped: it only steers the share.)
                if let Some(Ok(Some(x))) = sc.help_clock.as_mut().map(|c| c.read()) {
                    rates.observe(i, x.active_rows, x.active_seconds);
                    rates.observe(x.helper_stage, x.helper_rows, x.helper_seconds);
                }
            }
            drop(rates);
            for sc in &mut cache.stages {
                let (stage, hand) = sc.clock.read()?;
                seconds.push(stage);
                handoff += hand;
                bytes += std::mem::take(&mut sc.handoff_bytes);
                helped += std::mem::take(&mut sc.helped_layers);
                helper_rows += std::mem::take(&mut sc.helper_rows);
            }
            engine.record_split(|s| {
                for (st, sec) in s.stages.iter_mut().zip(&seconds) {
                    st.seconds += sec;
                }
                s.handoffs += (n - 1) as u64;
                s.handoff_bytes += bytes;
                s.handoff_seconds += handoff;
                s.helped_layers += helped;
                s.helper_rows += helper_rows;
            });
        }
        if trace_forward() {
            eprintln!(
                "strata: forward of {t} rows: queued in {:.3} ms, done in {:.3} ms",
                queued.as_secs_f64() * 1e3,
                started.elapsed().as_secs_f64() * 1e3
            );
        }
        self.check_flags(&flags, start, t, rows)?;
        Ok(out)
    }
}

/// A queued forward as `GpuModel::finish` completes it: its first
/// position, the rows whose logits it returns, when it began, and the
/// next step's draw it makes (a decode step's).
struct Queued<'a> {
    start: usize,
    rows: usize,
    started: std::time::Instant,
    draw: Option<&'a DrawAhead>,
}

/// Whether a decode step may draw the next token on the device when its
/// session asks (on unless `STRATA_DEVICE_DRAW=0`: then every draw is the
/// host's, same tokens, for comparison).
fn device_draw_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("STRATA_DEVICE_DRAW").map_or(true, |v| v != "0"))
}

/// `STRATA_SPLIT_STRESS=1` (builds with `test-hooks`): before every
/// event another stage's stream waits on (hand-offs, prefill help), the
/// producing stream first spins for about a millisecond, so that a missing
/// cross-stream wait shows as wrong values instead of passing by timing.
fn stress(gpu: &Gpu) -> Result<()> {
    #[cfg(feature = "test-hooks")]
    {
        static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        if *ON.get_or_init(|| std::env::var("STRATA_SPLIT_STRESS").is_ok_and(|v| v == "1")) {
            gpu.spin(2_000_000)?;
        }
    }
    #[cfg(not(feature = "test-hooks"))]
    let _ = gpu;
    Ok(())
}

/// The most device memory a pipelined run's logits may take (each piece
/// keeps its own until the run's one wait); a run wanting more (every
/// row's logits of a long prompt) runs one piece at a time.
const PIPELINE_LOGITS_BYTES: u64 = 1 << 30;

/// The prior of the share of a helped layer's expert rows the helping GPU
/// stage computes (the next stage, on the same kind of device). Once both
/// stages' speeds are measured (`HelpClock`, the engine's `HelpRates`, as
/// for CPU stages) the share follows them.
const GPU_HELP_SHARE: f64 = 0.5;

/// The stage that helps stage `active` of `n` with its expert rows: the
/// next one (CUDA stages are alike; the share, not the choice, follows
/// their measured speeds).
fn helper_of(active: usize, n: usize) -> usize {
    (active + 1) % n
}

/// Stage `i`'s scratch and, when `helper` is given, the helper stage's.
fn split_scratch(scratch: &mut [Scratch], i: usize, helper: Option<usize>) -> (&mut Scratch, Option<&mut Scratch>) {
    match helper {
        None => (&mut scratch[i], None),
        Some(j) if j > i => {
            let (a, b) = scratch.split_at_mut(j);
            (&mut a[i], Some(&mut b[0]))
        }
        Some(j) => {
            assert!(j < i, "a stage does not help itself");
            let (a, b) = scratch.split_at_mut(i);
            (&mut b[0], Some(&mut a[j]))
        }
    }
}

/// Lets each stage's device read the memory of the others' where they are
/// different GPUs (prefill help reads the active stage's activations and
/// experts in place); a pair that cannot is left alone (the hand-off
/// copies through the driver, and help is not offered between them:
/// `peer_readable`).
fn enable_peer_access(stages: &[GpuStage]) -> Result<()> {
    for a in stages {
        for b in stages {
            if a.gpu.ordinal() == b.gpu.ordinal() || !peer_readable(&a.gpu, &b.gpu) {
                continue;
            }
            a.gpu.context().bind_to_thread()?;
            // Stream-ordered pool allocations (cudarc allocates with
            // cuMemAllocAsync where the device supports it) are not covered
            // by context peer access: the pool grants its own.
            let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
            // SAFETY: `pool` is a valid out-pointer; the device handle is live.
            unsafe { sys::cuDeviceGetMemPool(&mut pool, b.gpu.context().cu_device()) }.result()?;
            let grant = sys::CUmemAccessDesc {
                location: sys::CUmemLocation {
                    type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                    id: a.gpu.ordinal() as i32,
                },
                flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            };
            // SAFETY: one valid descriptor for a pool of a live device.
            unsafe { sys::cuMemPoolSetAccess(pool, &grant, 1) }.result()?;
            // SAFETY: both contexts are live (held by the stages); the
            // call only changes what `a`'s context may address.
            match unsafe { sys::cuCtxEnablePeerAccess(b.gpu.context().cu_ctx(), 0) } {
                sys::cudaError_enum::CUDA_SUCCESS | sys::cudaError_enum::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {}
                e => {
                    return Err(Error::Cuda(format!(
                        "enabling peer access from cuda:{} to cuda:{}: {e:?}",
                        a.gpu.ordinal(),
                        b.gpu.ordinal()
                    )))
                }
            }
        }
    }
    Ok(())
}

/// Whether kernels on `a` may read `b`'s memory: the same GPU, or a peer
/// the driver reports as accessible (a failed query counts as no).
fn peer_readable(a: &Gpu, b: &Gpu) -> bool {
    if a.ordinal() == b.ordinal() {
        return true;
    }
    let mut can = 0;
    // SAFETY: plain query of two valid ordinals.
    let r = unsafe { sys::cuDeviceCanAccessPeer(&mut can, a.ordinal() as i32, b.ordinal() as i32) };
    r == sys::cudaError_enum::CUDA_SUCCESS && can != 0
}

/// Where a stage sits in the split.
#[derive(Clone, Copy)]
struct StagePlace {
    first: bool,
    last: bool,
}

/// A helping stage's part in a MoE layer of another stage.
struct StageHelp<'a> {
    stage: &'a GpuStage,
    /// The helper's stage number.
    index: usize,
    scratch: &'a mut Scratch,
    share: f64,
}

/// The timing of a forward's first helped step without the expert cache
/// (`GpuStage::helped_experts`), for the speed model of prefill help: the
/// active stage's expert kernels and the helper's, each between two events
/// on its own stream, read once the forward has finished
/// (`GpuModel::finish`) and fed to the engine's `HelpRates`. (A cached
/// step's waves join the two streams at every wave, so its spans measure
/// the link, not the devices: not sampled.)
struct HelpClock {
    active: [CudaEvent; 2],
    helper: [CudaEvent; 2],
    helper_stage: usize,
    /// Set when recorded this forward: (active rows, helper rows).
    rows: Option<(usize, usize)>,
}

/// One helped step's timing (`HelpClock::read`).
struct HelpSample {
    active_rows: usize,
    active_seconds: f64,
    helper_stage: usize,
    helper_rows: usize,
    helper_seconds: f64,
}

impl HelpClock {
    fn new(active: &Gpu, helper: &Gpu, helper_stage: usize) -> Result<HelpClock> {
        let ev = |g: &Gpu| g.context().new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT));
        Ok(HelpClock {
            active: [ev(active)?, ev(active)?],
            helper: [ev(helper)?, ev(helper)?],
            helper_stage,
            rows: None,
        })
    }

    /// The recorded step's timing, clearing it; `None` when nothing was
    /// recorded this forward.
    fn read(&mut self) -> Result<Option<HelpSample>> {
        let Some((active_rows, helper_rows)) = self.rows.take() else { return Ok(None) };
        let secs = |e: &[CudaEvent; 2]| -> Result<f64> { Ok(f64::from(e[0].elapsed_ms(&e[1])?) / 1e3) };
        Ok(Some(HelpSample {
            active_rows,
            active_seconds: secs(&self.active)?,
            helper_stage: self.helper_stage,
            helper_rows,
            helper_seconds: secs(&self.helper)?,
        }))
    }
}

impl GpuStage {
    /// Copies the weights of layers `range` to `gpu` (and the embedding
    /// and head where `at` says); `layer_done()` after each layer.
    #[allow(clippy::too_many_arguments)]
    fn load(
        pack: &Pack,
        gpu: Arc<Gpu>,
        range: Range<usize>,
        at: StagePlace,
        rope: &Rope,
        precision: GpuPrecision,
        cache_opts: &ExpertCacheOptions,
        layer_done: &mut dyn FnMut() -> Result<()>,
    ) -> Result<GpuStage> {
        let c = pack.config().clone();
        let (h, v, e) = (c.hidden_size, c.vocab_size, c.num_experts);
        let zc = c.arch.zero_centered_norms();

        let expert_layout = pack.layout();
        let layout = BlobLayout::from(&expert_layout);
        let stride = expert_layout.stride as usize;
        let per_layer = e * stride;
        let cached = cache_opts.enabled();
        let mut experts = gpu.alloc_zeros::<u8>(if cached { 0 } else { range.len() * per_layer })?;
        let base = address(&gpu, &experts);
        let mut tables = Vec::with_capacity(range.len());
        let mut layers = Vec::with_capacity(range.len());
        for (i, l) in range.clone().enumerate() {
            if !cached {
                let bytes = pack.expert_layer_bytes(l)?;
                gpu.stream().memcpy_htod(bytes, &mut experts.slice_mut(i * per_layer..(i + 1) * per_layer))?;
                let table: Vec<u64> = (0..e).map(|x| base + ((i * e + x) * stride) as u64).collect();
                tables.push(gpu.upload(&table)?);
            }
            layers.push(GpuLayer::load(pack, &gpu, l)?);
            // Host buffers of this layer may be freed only once copied.
            gpu.sync()?;
            layer_done()?;
        }
        let embed = if at.first || (at.last && c.tie_word_embeddings) {
            Some(upload_bf16(&gpu, pack, model_tensor_name(Role::Embedding), &[v, h])?)
        } else {
            None
        };
        let head = if at.last {
            Some(GpuHead {
                final_norm: upload_f32(&gpu, pack, model_tensor_name(Role::FinalNorm), h, zc)?,
                lm_head: if c.tie_word_embeddings {
                    None
                } else {
                    Some(upload_bf16(&gpu, pack, model_tensor_name(Role::LmHead), &[v, h])?)
                },
            })
        } else {
            None
        };
        let rope = RopeTable::new(&gpu, rope)?;
        if cached && moe::grouped_tensor_core_paths(&gpu, &layout) != (true, true) {
            // Streamed waves limit the grouped kernels to a wave's experts
            // through their row-tile offsets, which only the tensor-core
            // kernels read.
            return Err(Error::Unsupported(format!(
                "the expert cache on the GPU needs the tensor-core grouped kernels: compute capability 8.0+ \
                 (this device: {:?}) and hidden and moe_intermediate sizes multiples of 32 ({} and {})",
                gpu.compute_capability(),
                layout.hidden,
                layout.intermediate
            )));
        }
        let experts_cache = GpuExpertCache::load(pack, &gpu, cache_opts, range.clone())?.map(parking_lot::Mutex::new);
        gpu.sync()?;
        Ok(GpuStage {
            gpu,
            config: c,
            range,
            embed,
            head,
            layers,
            rope,
            _experts: experts,
            tables,
            experts: experts_cache,
            layout,
            precision,
        })
    }

    /// The expert table of layer `l` (without an expert cache).
    fn table(&self, l: usize) -> &CudaSlice<u64> {
        &self.tables[l - self.range.start]
    }

    /// A dense projection `out (+)= x W^T` at the engine's precision.
    #[allow(clippy::too_many_arguments)]
    fn proj(
        &self,
        write: Write,
        x: &CudaSlice<f32>,
        w: &CudaSlice<bf16>,
        t: usize,
        n: usize,
        k: usize,
        out: &mut CudaSlice<f32>,
        scratch: &mut CudaSlice<bf16>,
    ) -> Result<()> {
        let precision = match self.precision {
            GpuPrecision::Accurate => GemmPrecision::Split,
            GpuPrecision::Fast => GemmPrecision::Bf16,
        };
        dense::project_with(&self.gpu, x, w, t, n, k, out, scratch, write, precision)
    }

    /// `out = rmsnorm(x) W^T` (`norm.check`: also the non-finite guard of
    /// x). One decode row: the norm runs inside the GEMV
    /// (`dense::gemv_rmsnorm`), and `normed` receives rmsnorm(x) only when
    /// `store_normed` (later kernels read it). More rows: the norm into
    /// `normed`, then the projection.
    #[allow(clippy::too_many_arguments)]
    fn normed_proj(
        &self,
        norm: NormIn<'_>,
        x: &CudaSlice<f32>,
        normed: &mut CudaSlice<f32>,
        store_normed: bool,
        w: &CudaSlice<bf16>,
        t: usize,
        n: usize,
        k: usize,
        out: &mut CudaSlice<f32>,
        scratch: &mut CudaSlice<bf16>,
    ) -> Result<()> {
        let gpu = &*self.gpu;
        if t == 1 {
            return dense::gemv_rmsnorm(gpu, x, norm, normed, store_normed, w, n, k, out, Write::Store);
        }
        norm.apply(gpu, x, normed)?;
        self.proj(Write::Store, normed, w, t, n, k, out, scratch)
    }

    fn grouped_precision(&self) -> GroupedPrecision {
        match self.precision {
            GpuPrecision::Accurate => GroupedPrecision::Split,
            GpuPrecision::Fast => GroupedPrecision::Bf16,
        }
    }

    fn attn_config(&self) -> AttnConfig {
        let precision = match self.precision {
            GpuPrecision::Accurate => AttnPrecision::F32,
            GpuPrecision::Fast => AttnPrecision::Bf16,
        };
        AttnConfig { precision, ..AttnConfig::default() }
    }

    /// This stage's part of a decode step from its CUDA graph, captured
    /// first when there is none for the current buffers (the first stage's
    /// token is already in `s.tokens`, the previous stage's hidden state in
    /// `s.x`).
    fn launch_step(
        &self,
        engine: &Engine,
        cache: &mut StageCache,
        s: &mut Scratch,
        start: usize,
        mut experts: Option<&mut GpuExpertCache>,
    ) -> Result<()> {
        let gpu = &*self.gpu;
        let c = &self.config;
        let mut step = cache.step.take();
        let r = (|| -> Result<()> {
            let step = match &mut step {
                Some(st) => st,
                None => step.insert(Step {
                    pos: StepPos::new(gpu)?,
                    plan: attention::step_plan(gpu, attention_shape(c), 1, cache.dtype)?,
                }),
            };
            step.pos.set(gpu, start, attention::step_chunk(&step.plan, start + 1))?;
            // Everything the graph points to must exist before the capture.
            if self.head.is_some() {
                LogitScratch::get(&mut s.head, gpu, 1, c.hidden_size, c.vocab_size)?;
            }
            let experts_epoch = experts.as_deref().map_or(0, GpuExpertCache::mapped_epoch);
            if cache.graph.as_ref().is_none_or(|g| g.generation != cache.generation || g.experts_epoch != experts_epoch)
            {
                cache.graph = None;
                gpu.stream().begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
                let mut open = OpenCapture(Some(gpu.stream()));
                let queued = self.enqueue(engine, cache, s, start, 1, Some(step), experts.as_deref_mut(), None);
                open.0 = None;
                let captured = gpu.stream().end_capture(sys::CUgraphInstantiate_flags(0));
                queued?;
                let graph = captured?.ok_or_else(|| Error::Cuda("capturing the decode step gave no graph".into()))?;
                cache.graph = Some(DecodeGraph { graph, generation: cache.generation, experts_epoch });
            }
            cache.graph.as_ref().expect("captured above").graph.launch()?;
            Ok(())
        })();
        cache.step = step;
        r
    }

    /// Queues this stage's part of a forward of the `s.t` rows at positions
    /// `start..`: the flags reset, the embedding (first stage: tokens in
    /// `s.tokens`; later stages find the hidden state in `s.x`), its layers,
    /// and the head for the last `rows` rows (last stage). Nothing here
    /// waits or copies from the host (except with `help`, which reads the
    /// expert counts of each layer), so it can be captured into a graph
    /// (with `step`: position-dependent kernels then read the position on
    /// the device).
    #[cfg_attr(not(any(test, feature = "test-hooks")), allow(unused_variables))]
    #[allow(clippy::too_many_arguments)]
    fn enqueue(
        &self,
        engine: &Engine,
        cache: &mut StageCache,
        s: &mut Scratch,
        start: usize,
        rows: usize,
        step: Option<&Step>,
        mut experts: Option<&mut GpuExpertCache>,
        mut help: Option<StageHelp<'_>>,
    ) -> Result<()> {
        let c = &self.config;
        let gpu = &*self.gpu;
        let (h, t, vocab) = (c.hidden_size, s.t, c.vocab_size);
        let eps = c.rms_norm_eps as f32;
        dense::reset_flags(gpu, &mut cache.flags)?;
        if self.range.start == 0 {
            let embed = self.embed.as_ref().expect("the first stage holds the embedding");
            dense::embed(gpu, embed, &s.tokens, t, h, &mut s.x)?;
        }
        for (i, lw) in self.layers.iter().enumerate() {
            let l = self.range.start + i;
            // Each block adds its output to the residual stream x itself
            // (the projections and expert kernels accumulate).
            // The input norm runs in the mixer's first projection; layer
            // l - 1's output is checked for NaN/inf there (slot l - 1).
            match &lw.mixer {
                GpuMixer::Attention { .. } => self.attention(l, lw, cache, s, start, step)?,
                GpuMixer::Linear { .. } => self.linear(l, lw, cache, s)?,
            }
            self.moe(engine, l, lw, s, experts.as_deref_mut(), help.as_mut(), cache)?;
            #[cfg(any(test, feature = "test-hooks"))]
            if let Some(row) = engine.take_nan(l, start, t) {
                gpu.stream().memcpy_htod(&[f32::NAN], &mut s.x.slice_mut(row * h..row * h + 1))?;
            }
            if l + 1 == c.num_hidden_layers {
                dense::first_nonfinite(gpu, &s.x, h, &mut cache.flags, l)?;
            }
        }
        if let (Some(head), true) = (&self.head, rows > 0 && !skipped(t, "head")) {
            let w = head.lm_head.as_ref().or(self.embed.as_ref()).expect("the last stage holds the head");
            let lg = LogitScratch::get(&mut s.head, gpu, rows, h, vocab)?;
            gpu.stream().memcpy_dtod(&s.x.slice((t - rows) * h..t * h), &mut lg.rows)?;
            dense::rmsnorm(gpu, &lg.rows, &head.final_norm, eps, &mut lg.normed)?;
            self.proj(Write::Store, &lg.normed, w, rows, vocab, h, &mut lg.logits, &mut lg.bf)?;
            dense::first_nonfinite(gpu, &lg.logits, vocab, &mut cache.flags, c.num_hidden_layers)?;
        }
        Ok(())
    }

    /// `x += o_proj(attention(...))` of the normed rows in `s.h`.
    fn attention(
        &self,
        l: usize,
        lw: &GpuLayer,
        cache: &mut StageCache,
        s: &mut Scratch,
        start: usize,
        step: Option<&Step>,
    ) -> Result<()> {
        let c = &self.config;
        let gpu = &*self.gpu;
        let GpuMixer::Attention { qkv, o_proj, q_norm, k_norm } = &lw.mixer else {
            unreachable!("attention on a linear layer")
        };
        let (t, h, eps) = (s.t, c.hidden_size, c.rms_norm_eps as f32);
        let shape = attention_shape(c);
        let qd = shape.q_dim();
        let width = c.q_proj_dim() + 2 * shape.kv_dim();
        let norm = NormIn { w: &lw.input_norm, eps, check: l.checked_sub(1).map(|prev| (&mut cache.flags, prev)) };
        if !skipped(t, "qkv") {
            self.normed_proj(norm, &s.x, &mut s.h, false, qkv, t, width, h, &mut s.qkv, &mut s.bf)?;
        }
        // The q/k norms, RoPE, the gate split and the KV append in one
        // launch; in a captured decode step the position comes from the device.
        let prep = QkvPrep { heads: shape.heads, gated: c.has_attention_gate(), q_norm, k_norm, eps, rope: &self.rope };
        let gate = if prep.gated { Some(&mut s.gate) } else { None };
        let kv = cache.kv[l].as_mut().expect("an attention layer has KV");
        match step {
            None => {
                if !skipped(t, "prep") {
                    attention::qkv_prepare(gpu, &prep, &s.qkv, t, kv, start, &mut s.qn, gate)?;
                }
                if !skipped(t, "attn") {
                    let (config, split) = (self.attn_config(), &mut s.attn_split);
                    attention::attention_with_scratch(gpu, &s.qn, kv, shape, start, t, &mut s.attn, config, split)?;
                }
            }
            Some(st) => {
                if !skipped(t, "prep") {
                    attention::qkv_prepare_at(gpu, &prep, &s.qkv, t, kv, &st.pos, &mut s.qn, gate)?;
                }
                if !skipped(t, "attn") {
                    let (plan, pos, split) = (&st.plan, &st.pos, &mut s.attn_split);
                    attention::attention_at(gpu, &s.qn, kv, shape, t, &mut s.attn, plan, pos, split)?;
                }
            }
        }
        if c.has_attention_gate() {
            dense::output_gate(gpu, &mut s.attn, &s.gate)?;
        }
        if skipped(t, "oproj") {
            return Ok(());
        }
        self.proj(Write::Add, &s.attn, o_proj, t, h, qd, &mut s.x, &mut s.bf)
    }

    /// `x += out_proj(gated_deltanet(...))` of the normed rows in `s.h`.
    fn linear(&self, l: usize, lw: &GpuLayer, cache: &mut StageCache, s: &mut Scratch) -> Result<()> {
        let c = &self.config;
        let gpu = &*self.gpu;
        let GpuMixer::Linear { in_proj_qkvz, in_proj_ba, out_proj, small } = &lw.mixer else {
            unreachable!("linear on an attention layer")
        };
        let shape = deltanet_shape(c);
        let (t, h, eps) = (s.t, c.hidden_size, c.rms_norm_eps as f32);
        let dn = s.dn.as_mut().expect("a hybrid's scratch");
        let norm = NormIn { w: &lw.input_norm, eps, check: l.checked_sub(1).map(|prev| (&mut cache.flags, prev)) };
        self.normed_proj(norm, &s.x, &mut s.h, true, in_proj_qkvz, t, shape.qkvz_dim(), h, &mut dn.qkvz, &mut s.bf)?;
        self.proj(Write::Store, &s.h, in_proj_ba, t, shape.ba_dim(), h, &mut dn.ba, &mut s.bf)?;
        let state = cache.delta[l].as_mut().expect("a linear layer has a recurrent state");
        deltanet_core_with(
            gpu,
            &dn.qkvz,
            &dn.ba,
            small,
            shape,
            eps,
            t,
            state,
            &mut dn.core,
            &mut dn.scratch,
            DeltaRuleForm::Auto,
        )?;
        self.proj(Write::Add, &dn.core, out_proj, t, h, shape.value_dim(), &mut s.x, &mut s.bf)
    }

    /// `x += moe(s.h)` (+ the shared expert), through the one MoE pipeline:
    /// router, top-k on the device, experts by the blob table, combine.
    #[allow(clippy::too_many_arguments)]
    fn moe(
        &self,
        engine: &Engine,
        l: usize,
        lw: &GpuLayer,
        s: &mut Scratch,
        mut experts: Option<&mut GpuExpertCache>,
        help: Option<&mut StageHelp<'_>>,
        cache: &mut StageCache,
    ) -> Result<()> {
        let c = &self.config;
        let gpu = &*self.gpu;
        let (t, h, e, k) = (s.t, c.hidden_size, c.num_experts, c.num_experts_per_tok);
        let norm = NormIn { w: &lw.post_attn_norm, eps: c.rms_norm_eps as f32, check: None };
        if !skipped(t, "router") {
            self.normed_proj(norm, &s.x, &mut s.h, true, &lw.router, t, e, h, &mut s.router, &mut s.bf)?;
        }
        let p = self.grouped_precision();
        if let Some(x) = experts.as_deref_mut().filter(|x| x.mapped_decode(t)) {
            // Mapped decode: the resident path through the cache's table
            // (slots, and host memory read in place); the ids kept per layer.
            // A layer whose every expert is in a slot takes the all-resident kernels.
            let step = x.mapped_step(l)?;
            let (table, mut ids, host_blobs) = (step.table, step.ids, step.host_blobs);
            let route = moe::Route {
                logits: &s.router,
                num_experts: e,
                norm_topk_prob: c.norm_topk_prob,
                ids: &mut ids,
                weights: &mut s.weights,
                host_blobs,
            };
            let layout = &self.layout;
            if !skipped(t, "gateup") {
                moe::expert_gate_up_gemv_routed(gpu, &s.h, route, table, layout, t, k, &mut s.moe.act)?;
            }
            if !skipped(t, "down") {
                let logits = route_logits(c, &s.router, t);
                // Misses read from host memory in place take the CUDA-core GEMVs (host_blobs).
                let (act, w) = (&s.moe.act, &s.weights);
                moe::expert_down_gemv_routed(
                    gpu, act, &ids, w, logits, host_blobs, table, layout, t, k, &mut s.x, true,
                )?;
            }
        } else if let Some(x) = experts {
            // (A helper only for grouped rows: decode-size steps run the GEMVs.)
            let help = help.filter(|_| t > MOE_GEMV_MAX_ROWS);
            let helped = help.is_some();
            let helper_rows = self.cached_experts(engine.pack(), x, l, s, help)?;
            if helped && helper_rows > 0 {
                cache.helped_layers += 1;
                cache.helper_rows += helper_rows as u64;
            }
        } else if t <= MOE_GEMV_MAX_ROWS {
            let (table, layout) = (self.table(l), &self.layout);
            // Decode: the routing runs inside the gate/up GEMV (one launch fewer).
            let route = moe::Route {
                logits: &s.router,
                num_experts: e,
                norm_topk_prob: c.norm_topk_prob,
                ids: &mut s.ids,
                weights: &mut s.weights,
                host_blobs: false,
            };
            let i = c.moe_intermediate_size;
            let whole = !skipped(t, "gateup") && !skipped(t, "down");
            if let Some(fs) =
                s.moe.fused.as_mut().filter(|_| whole && t == 1 && moe::fused_decode_shape(gpu, h, i, k, e).is_some())
            {
                // One launch: 16 blocks an expert (moe::fused_decode; opt-in, STRATA_FUSED_MOE=1).
                moe::fused_decode(gpu, &s.h, route, table, layout, k, &mut s.moe.act, fs, &mut s.x, true)?;
            } else {
                if !skipped(t, "gateup") {
                    moe::expert_gate_up_gemv_routed(gpu, &s.h, route, table, layout, t, k, &mut s.moe.act)?;
                }
                if !skipped(t, "down") {
                    let logits = route_logits(c, &s.router, t);
                    let (ids, w) = (&s.ids, &s.weights);
                    let act = &s.moe.act;
                    moe::expert_down_gemv_routed(gpu, act, ids, w, logits, false, table, layout, t, k, &mut s.x, true)?;
                }
            }
        } else if let Some(help) = help {
            moe::route_topk(gpu, &s.router, t, e, k, c.norm_topk_prob, &mut s.ids, &mut s.weights)?;
            let helper_rows = self.helped_experts(l, s, help, &mut cache.help_clock)?;
            cache.helped_layers += 1;
            cache.helper_rows += helper_rows as u64;
        } else {
            let (table, layout) = (self.table(l), &self.layout);
            moe::route_topk(gpu, &s.router, t, e, k, c.norm_topk_prob, &mut s.ids, &mut s.weights)?;
            run_experts(gpu, &s.h, &s.ids, &s.weights, table, layout, t, k, &mut s.moe, &mut s.x, true, p)?;
        }
        if let Some(sh) = &lw.shared {
            let sx = s.shared.as_mut().expect("a shared expert's scratch");
            self.proj(Write::Store, &s.h, &sh.gate, t, 1, h, &mut sx.logit, &mut s.bf)?;
            match &sh.mlp {
                GpuSharedMlp::Nvfp4 { table, layout, .. } => {
                    dense::sigmoid(gpu, &mut sx.logit)?;
                    run_experts(gpu, &s.h, &sx.zeros, &sx.logit, table, layout, t, 1, &mut sx.moe, &mut s.x, true, p)?;
                }
                GpuSharedMlp::Dense { gate, up, down } => {
                    let i = sh.intermediate;
                    self.proj(Write::Store, &s.h, gate, t, i, h, &mut sx.g, &mut s.bf)?;
                    self.proj(Write::Store, &s.h, up, t, i, h, &mut sx.u, &mut s.bf)?;
                    dense::silu_mul(gpu, &sx.g, &sx.u, &mut sx.act)?;
                    self.proj(Write::Store, &sx.act, down, t, h, i, &mut sx.y, &mut s.bf)?;
                    dense::sigmoid_scale_add(gpu, &mut s.x, &sx.y, &sx.logit, h)?;
                }
            }
        }
        Ok(())
    }
}

impl GpuStage {
    /// The routed experts of layer `l` through the expert cache: top-k on
    /// the device, the ids read back, the step planned (misses copied into
    /// slots, the layer's table pointed at them), then the one expert
    /// pipeline (`run_experts`); a step with streamed experts computes in
    /// waves, each wave's copies into the ring overlapping the wave before.
    /// With `help`, every wave's experts are divided with the helper
    /// (`cached_compute`). Returns the rows the helper computed.
    fn cached_experts(
        &self,
        pack: &Pack,
        x: &mut GpuExpertCache,
        l: usize,
        s: &mut Scratch,
        help: Option<&mut StageHelp<'_>>,
    ) -> Result<usize> {
        let c = &self.config;
        let gpu = &*self.gpu;
        let (t, e, k) = (s.t, c.num_experts, c.num_experts_per_tok);
        let started = std::time::Instant::now();
        moe::route_topk(gpu, &s.router, t, e, k, c.norm_topk_prob, &mut s.ids, &mut s.weights)?;
        let ids = x.read_ids(&s.ids, t * k)?;
        x.trace(TracePhase::Route, started);
        let started = std::time::Instant::now();
        let plan = x.plan_step(pack, l, &ids)?;
        x.trace(TracePhase::Plan, started);
        let started = std::time::Instant::now();
        let r = self.cached_compute(pack, x, l, s, &ids, &plan, help);
        x.trace(TracePhase::Compute, started);
        r
    }

    /// The expert kernels of a planned cached step (`cached_experts`).
    ///
    /// With `help` (prefill help while experts stream), each wave's experts
    /// (ascending) are divided by the rule of every device
    /// (`moe::help_cut_rows`): the helper's stream waits for the wave's
    /// copies (an event after this stream's wait for them), runs the grouped
    /// kernels over the tail of the wave's experts with its own row tiles,
    /// reading this stage's normed rows, table and slots or ring slots in
    /// place, and writes its output rows into this stage's (disjoint rows);
    /// this stream computes the head meanwhile, then waits for the helper
    /// before the wave's ring slots may be refilled. One combine at the end.
    #[allow(clippy::too_many_arguments)]
    fn cached_compute(
        &self,
        pack: &Pack,
        x: &mut GpuExpertCache,
        l: usize,
        s: &mut Scratch,
        ids: &[u32],
        plan: &ExpertStepPlan,
        mut help: Option<&mut StageHelp<'_>>,
    ) -> Result<usize> {
        let c = &self.config;
        let gpu = &*self.gpu;
        let (t, e, k) = (s.t, c.num_experts, c.num_experts_per_tok);
        let p = self.grouped_precision();
        let layout = &self.layout;
        if plan.ring.is_empty() && help.is_none() {
            run_experts(gpu, &s.h, &s.ids, &s.weights, x.table(l), layout, t, k, &mut s.moe, &mut s.x, true, p)?;
            return Ok(0);
        }
        // Waves: the grouped kernels over the rows of one wave's experts at a
        // time (the other experts get no row tiles), one combine at the end.
        let m = &mut s.moe;
        if m.grouping.is_none() {
            m.grouping = Some(ExpertGrouping::new(gpu, t * k, e)?);
            m.y = Some(gpu.alloc_zeros(t * k * c.hidden_size)?);
        }
        let g = m.grouping.as_mut().expect("set above");
        moe::group_by_expert_into(gpu, &s.ids, t, k, g)?;
        // (An id >= E marks a non-finite routing: no row of any wave; the
        // kernels turn it into NaN for the guard.)
        let mut counts = vec![0usize; e];
        ids.iter().filter(|&&i| (i as usize) < e).for_each(|&i| counts[i as usize] += 1);
        let waves = x.waves(plan);
        let ring_waves: Vec<Vec<usize>> =
            waves.ring.iter().map(|w| w.iter().map(|&n| plan.ring[n].expert).collect()).collect();
        let y = m.y.as_mut().expect("set above");
        // Row tiles over `mine` of the experts (none for the others).
        let tiles = |mine: &[usize]| row_tiles(counts.iter().copied(), |j| mine.binary_search(&j).is_ok());
        if let Some(help) = help.as_deref_mut() {
            let hg = help.scratch.moe.grouping.as_mut().expect("grouped scratch for more than a few rows");
            share_grouping(gpu, &help.stage.gpu, g, hg, t, k)?;
        }
        let mut helper_rows = 0;
        for (w, experts) in std::iter::once(&waves.slots).chain(&ring_waves).enumerate() {
            if experts.is_empty() {
                continue;
            }
            let ring_wave = w.checked_sub(1);
            if let Some(rw) = ring_wave {
                x.stream_wave(pack, plan, &waves, rw)?;
            }
            // The helper takes the wave's experts from `cut` on (a wave of one
            // expert stays here: the rule would give it all to the helper).
            let cut = match help.as_deref() {
                Some(help) if experts.len() > 1 => {
                    crate::moe::help_cut_rows(experts.iter().map(|&j| counts[j]), help.share)
                }
                _ => experts.len(),
            };
            if let Some(help) = help.as_deref_mut().filter(|_| cut < experts.len()) {
                let hgpu = &*help.stage.gpu;
                let hstream = hgpu.stream();
                let hm = &mut help.scratch.moe;
                let hg = hm.grouping.as_mut().expect("grouped scratch for more than a few rows");
                // After this stream's wait for the wave's copies (and the table).
                stress(gpu)?;
                hstream.wait(&gpu.stream().record_event(None)?)?;
                hstream.memcpy_htod(&tiles(&experts[cut..]), &mut hg.tile_offsets)?;
                moe::expert_gate_up_grouped_with(hgpu, &s.h, hg, x.table(l), layout, &mut hm.act, p)?;
                moe::expert_down_grouped_with(hgpu, &hm.act, hg, x.table(l), layout, y, p)?;
                helper_rows += experts[cut..].iter().map(|&j| counts[j]).sum::<usize>();
            }
            if cut > 0 {
                // The grouping's own tile offsets are rewritten by its next fill.
                gpu.stream().memcpy_htod(&tiles(&experts[..cut]), &mut g.tile_offsets)?;
                moe::expert_gate_up_grouped_with(gpu, &s.h, g, x.table(l), layout, &mut m.act, p)?;
                moe::expert_down_grouped_with(gpu, &m.act, g, x.table(l), layout, y, p)?;
            }
            if let Some(help) = help.as_deref().filter(|_| cut < experts.len()) {
                // The helper's rows are in, and its reads of the wave's slots done.
                let hgpu = &*help.stage.gpu;
                stress(hgpu)?;
                gpu.stream().wait(&hgpu.stream().record_event(None)?)?;
            }
            if let Some(rw) = ring_wave {
                x.wave_computed(plan, &waves, rw)?;
            }
        }
        if let Some(help) = help.as_deref() {
            // Whether or not it computed: its copies of this layer's
            // grouping and reads of `h` are done before the next layer
            // rewrites them.
            let hgpu = &*help.stage.gpu;
            stress(hgpu)?;
            gpu.stream().wait(&hgpu.stream().record_event(None)?)?;
        }
        // After a streamed prefill step, the next layer's will likely stream
        // too: its first ring copies start now, under this layer's last wave
        // and its attention.
        if !plan.ring.is_empty() && t > MOE_GEMV_MAX_ROWS {
            x.prefetch_ring(pack, l + 1)?;
        }
        moe::moe_combine(gpu, y, g, &s.weights, layout.hidden as usize, &mut s.x, true)?;
        Ok(helper_rows)
    }

    /// The routed experts of layer `l` (ids routed into `s.ids`) with
    /// another stage's help (prefill help, docs/layer-split.md): the one
    /// grouped pipeline, its experts divided at an expert boundary
    /// (`moe::help_cut_rows`, as on the CPU), the experts before it computed here, the rest by the
    /// helper's stream reading this stage's normed rows and expert table in
    /// place (two logical devices on one GPU, or a peer GPU), the helper's
    /// output rows copied back before the one combine. Returns the rows the
    /// helper computed.
    fn helped_experts(
        &self,
        l: usize,
        s: &mut Scratch,
        help: &mut StageHelp<'_>,
        clock: &mut Option<HelpClock>,
    ) -> Result<usize> {
        let c = &self.config;
        let gpu = &*self.gpu;
        let (t, e, k, h) = (s.t, c.num_experts, c.num_experts_per_tok, c.hidden_size);
        let p = self.grouped_precision();
        let (table, layout) = (self.table(l), &self.layout);
        let m = &mut s.moe;
        let g = m.grouping.as_mut().expect("grouped scratch for more than a few rows");
        moe::group_by_expert_into(gpu, &s.ids, t, k, g)?;
        // Each expert's rows, on the host: where to divide.
        let mut offsets = vec![0u32; e + 1];
        gpu.stream().memcpy_dtoh(&g.offsets, &mut offsets)?;
        gpu.sync()?;
        // The CPU's rule (`moe::help_cut_rows`): the helper takes experts split..E.
        let split = crate::moe::help_cut_rows(offsets.windows(2).map(|w| (w[1] - w[0]) as usize), help.share);
        let rows = || offsets.windows(2).map(|w| (w[1] - w[0]) as usize);
        let tiles = |mine: Range<usize>| row_tiles(rows(), |j| mine.contains(&j));

        // The helper: a copy of the grouping with its own row tiles, the
        // kernels on its stream once this stream has grouped the rows.
        let hgpu = &*help.stage.gpu;
        let hstream = hgpu.stream();
        // The forward's first helped step is timed (`HelpClock`).
        if clock.as_ref().is_none_or(|c| c.helper_stage != help.index) {
            *clock = Some(HelpClock::new(gpu, hgpu, help.index)?);
        }
        let clock = clock.as_mut().filter(|c| c.rows.is_none());
        let hm = &mut help.scratch.moe;
        let hg = hm.grouping.as_mut().expect("grouped scratch for more than a few rows");
        let hy = hm.y.as_mut().expect("grouped scratch for more than a few rows");
        share_grouping(gpu, hgpu, g, hg, t, k)?;
        hstream.memcpy_htod(&tiles(split..e), &mut hg.tile_offsets)?;
        if let Some(c) = &clock {
            c.helper[0].record(hstream)?;
        }
        moe::expert_gate_up_grouped_with(hgpu, &s.h, hg, table, layout, &mut hm.act, p)?;
        moe::expert_down_grouped_with(hgpu, &hm.act, hg, table, layout, hy, p)?;
        if let Some(c) = &clock {
            c.helper[1].record(hstream)?;
        }

        // This stage's experts, meanwhile.
        gpu.stream().memcpy_htod(&tiles(0..split), &mut g.tile_offsets)?;
        let y = m.y.as_mut().expect("grouped scratch for more than a few rows");
        if let Some(c) = &clock {
            c.active[0].record(gpu.stream())?;
        }
        moe::expert_gate_up_grouped_with(gpu, &s.h, g, table, layout, &mut m.act, p)?;
        moe::expert_down_grouped_with(gpu, &m.act, g, table, layout, y, p)?;
        if let Some(c) = clock {
            c.active[1].record(gpu.stream())?;
            c.rows = Some((offsets[split] as usize, (offsets[e] - offsets[split]) as usize));
        }

        // The helper's rows (slots offsets[split]..offsets[e], contiguous:
        // slots are in expert order), then the combine of every row.
        stress(hgpu)?;
        gpu.stream().wait(&hstream.record_event(None)?)?;
        let (a, b) = (offsets[split] as usize * h, offsets[e] as usize * h);
        if b > a {
            gpu.stream().memcpy_dtod(&hy.slice(a..b), &mut y.slice_mut(a..b))?;
        }
        moe::moe_combine(gpu, y, g, &s.weights, h, &mut s.x, true)?;
        Ok((offsets[e] - offsets[split]) as usize)
    }
}

/// Row-tile offsets (`ExpertGrouping::tile_offsets`) over the experts that
/// `mine` picks, of `rows` rows each (in expert order): whole tiles of
/// those experts' rows, none for the others. How a wave of streamed
/// experts and each side of prefill help run the grouped kernels on part
/// of a grouping.
fn row_tiles(rows: impl Iterator<Item = usize>, mine: impl Fn(usize) -> bool) -> Vec<u32> {
    let mut tiles = vec![0u32];
    for (j, n) in rows.enumerate() {
        let add = if mine(j) { n.div_ceil(moe::TILE_M) as u32 } else { 0 };
        tiles.push(tiles[j] + add);
    }
    tiles
}

/// Prefill help: the helper's copy of the active stage's grouping `g` of
/// `t x k` rows, on the helper's stream once the active stream has grouped
/// them (the helper's row tiles are its own, written per use).
fn share_grouping(
    gpu: &Gpu,
    hgpu: &Gpu,
    g: &ExpertGrouping,
    hg: &mut ExpertGrouping,
    t: usize,
    k: usize,
) -> Result<()> {
    let hstream = hgpu.stream();
    stress(gpu)?;
    hstream.wait(&gpu.stream().record_event(None)?)?;
    let n = t * k;
    hstream.memcpy_dtod(&g.offsets, &mut hg.offsets)?;
    hstream.memcpy_dtod(&g.rows.slice(..n), &mut hg.rows.slice_mut(..n))?;
    hstream.memcpy_dtod(&g.slot_of.slice(..n), &mut hg.slot_of.slice_mut(..n))?;
    hstream.memcpy_dtod(&g.slot_expert.slice(..n), &mut hg.slot_expert.slice_mut(..n))?;
    (hg.tokens, hg.top_k) = (t, k);
    Ok(())
}

/// `out (+)= sum_j w[t, j] * expert_{ids[t, j]}(x[t])` with the experts found
/// through `table`: per-token GEMV kernels for few rows, grouped kernels
/// (tokens aligned by expert) for more. The one expert pipeline of the GPU.
#[allow(clippy::too_many_arguments)]
fn run_experts(
    gpu: &Gpu,
    x: &CudaSlice<f32>,
    ids: &CudaSlice<u32>,
    weights: &CudaSlice<f32>,
    table: &CudaSlice<u64>,
    layout: &BlobLayout,
    t: usize,
    k: usize,
    m: &mut MoeScratch,
    out: &mut CudaSlice<f32>,
    accumulate: bool,
    precision: GroupedPrecision,
) -> Result<()> {
    if t <= MOE_GEMV_MAX_ROWS {
        moe::expert_gate_up_gemv(gpu, x, ids, table, layout, t, k, &mut m.act)?;
        moe::expert_down_gemv(gpu, &m.act, ids, weights, table, layout, t, k, out, accumulate)
    } else {
        let g = m.grouping.as_mut().expect("grouped scratch for more than a few rows");
        moe::group_by_expert_into(gpu, ids, t, k, g)?;
        let y = m.y.as_mut().expect("grouped scratch for more than a few rows");
        moe::expert_gate_up_grouped_with(gpu, x, g, table, layout, &mut m.act, precision)?;
        moe::expert_down_grouped_with(gpu, &m.act, g, table, layout, y, precision)?;
        moe::moe_combine(gpu, y, g, weights, layout.hidden as usize, out, accumulate)
    }
}

impl GpuLayer {
    fn load(pack: &Pack, gpu: &Arc<Gpu>, l: usize) -> Result<GpuLayer> {
        let c = pack.config();
        let h = c.hidden_size;
        let zc = c.arch.zero_centered_norms();
        let n = |role| layer_tensor_name(l, role);
        let mixer = if c.is_full_attention(l) {
            GpuMixer::Attention {
                qkv: {
                    let mut w = to_bf16(pack, &n(Role::QProj), &[c.q_proj_dim(), h])?;
                    w.extend(to_bf16(pack, &n(Role::KProj), &[c.kv_dim(), h])?);
                    w.extend(to_bf16(pack, &n(Role::VProj), &[c.kv_dim(), h])?);
                    gpu.upload(&w)?
                },
                o_proj: upload_bf16(gpu, pack, &n(Role::OProj), &[h, c.q_dim()])?,
                q_norm: upload_f32(gpu, pack, &n(Role::QNorm), c.head_dim, zc)?,
                k_norm: upload_f32(gpu, pack, &n(Role::KNorm), c.head_dim, zc)?,
            }
        } else {
            let s = deltanet_shape(c);
            let f32s = |role, len| -> Result<Vec<f32>> {
                let t = pack.tensor(&n(role))?;
                if t.numel() != len {
                    return Err(Error::tensor(n(role), format!("{} elements, the engine needs {len}", t.numel())));
                }
                Ok(t.to_f32())
            };
            GpuMixer::Linear {
                in_proj_qkvz: upload_bf16(gpu, pack, &n(Role::LinearInProjQkvz), &[s.qkvz_dim(), h])?,
                in_proj_ba: upload_bf16(gpu, pack, &n(Role::LinearInProjBa), &[s.ba_dim(), h])?,
                out_proj: upload_bf16(gpu, pack, &n(Role::LinearOutProj), &[h, s.value_dim()])?,
                small: Box::new(DeltaNetDeviceWeights::new(
                    gpu,
                    &f32s(Role::LinearConv1d, s.conv_dim() * s.conv_kernel)?,
                    &f32s(Role::LinearDtBias, s.value_heads)?,
                    &f32s(Role::LinearALog, s.value_heads)?,
                    &f32s(Role::LinearNorm, s.value_head_dim)?,
                    s,
                )?),
            }
        };
        let shared = match c.shared_expert_intermediate_size() {
            None => None,
            Some(is) => Some(GpuShared::load(pack, gpu, l, is)?),
        };
        Ok(GpuLayer {
            input_norm: upload_f32(gpu, pack, &n(Role::InputNorm), h, zc)?,
            mixer,
            post_attn_norm: upload_f32(gpu, pack, &n(Role::PostAttnNorm), h, zc)?,
            router: upload_bf16(gpu, pack, &n(Role::Router), &[c.num_experts, h])?,
            shared,
        })
    }
}

impl GpuShared {
    fn load(pack: &Pack, gpu: &Arc<Gpu>, l: usize, is: usize) -> Result<GpuShared> {
        let h = pack.config().hidden_size;
        let n = |role| layer_tensor_name(l, role);
        let names = [n(Role::SharedGateProj), n(Role::SharedUpProj), n(Role::SharedDownProj)];
        let mut nvfp4 = Vec::new();
        for name in &names {
            if let TensorData::Nvfp4(m) = pack.tensor(name)?.data {
                nvfp4.push(m);
            }
        }
        let mlp = if let [g, u, d] = nvfp4[..] {
            // A blob of the experts' layout for this intermediate size.
            let layout = ExpertLayout::new(h as u64, is as u64);
            if (g.rows, g.cols, u.rows, u.cols, d.rows, d.cols) != (is, h, is, h, h, is) {
                return Err(Error::tensor(&names[0], format!("the shared expert is not [{is}, {h}] / [{h}, {is}]")));
            }
            let mut blob = vec![0u8; layout.used_len() as usize];
            for (m, codes, scales) in [
                (g, layout.gate_codes, layout.gate_scales),
                (u, layout.up_codes, layout.up_scales),
                (d, layout.down_codes, layout.down_scales),
            ] {
                blob[codes as usize..codes as usize + m.codes.len()].copy_from_slice(m.codes);
                blob[scales as usize..scales as usize + m.scales.len()].copy_from_slice(m.scales);
            }
            let tail = layout.tail as usize;
            for (i, m) in [g, u, d].iter().enumerate() {
                blob[tail + 4 * i..tail + 4 * i + 4].copy_from_slice(&m.global_scale.to_le_bytes());
            }
            let dev = gpu.upload(&blob)?;
            let table = gpu.upload(&[address(gpu, &dev)])?;
            GpuSharedMlp::Nvfp4 { _blob: dev, table, layout: BlobLayout::from(&layout) }
        } else {
            GpuSharedMlp::Dense {
                gate: upload_bf16(gpu, pack, &names[0], &[is, h])?,
                up: upload_bf16(gpu, pack, &names[1], &[is, h])?,
                down: upload_bf16(gpu, pack, &names[2], &[h, is])?,
            }
        };
        Ok(GpuShared { gate: upload_bf16(gpu, pack, &n(Role::SharedExpertGate), &[1, h])?, intermediate: is, mlp })
    }
}

/// The intermediate buffers of the expert kernels for one row count.
struct MoeScratch {
    /// `[T * k, I]`.
    act: CudaSlice<f32>,
    /// Grouped path only: the grouping and `[T * k, hidden]` outputs.
    grouping: Option<ExpertGrouping>,
    y: Option<CudaSlice<f32>>,
    /// One-row scratch only: the fused decode MoE's buffers (`moe::fused_decode`).
    fused: Option<FusedScratch>,
}

impl MoeScratch {
    fn new(gpu: &Gpu, t: usize, k: usize, num_experts: usize, hidden: usize, inter: usize) -> Result<MoeScratch> {
        let grouped = t > MOE_GEMV_MAX_ROWS;
        Ok(MoeScratch {
            act: gpu.alloc_zeros(t * k * inter)?,
            grouping: if grouped { Some(ExpertGrouping::new(gpu, t * k, num_experts)?) } else { None },
            y: if grouped { Some(gpu.alloc_zeros(t * k * hidden)?) } else { None },
            fused: if t == 1 && gpu.fused_moe() { Some(FusedScratch::new(gpu, hidden, k)?) } else { None },
        })
    }
}

struct SharedScratch {
    /// `[T]`: the gate's logits, then (NVFP4) their sigmoid.
    logit: CudaSlice<f32>,
    /// `[T]` zeros: every row's expert id in the one-entry table.
    zeros: CudaSlice<u32>,
    moe: MoeScratch,
    /// Dense shared expert: `[T, I]` gate, up, act and `[T, hidden]` out.
    g: CudaSlice<f32>,
    u: CudaSlice<f32>,
    act: CudaSlice<f32>,
    y: CudaSlice<f32>,
}

struct DeltaScratch {
    qkvz: CudaSlice<f32>,
    ba: CudaSlice<f32>,
    core: CudaSlice<f32>,
    scratch: DeltaNetScratch,
}

/// Page-locked buffers of one row of logits for a stage's decode steps: a
/// step takes one, the device copies its logits into it, and the session
/// holds it (`PinnedLogits`) until its next logits replace it, which gives
/// it back. A session holds at most two at once (its logits and the next
/// step's), so the pool stays that small.
pub(crate) struct LogitPool {
    /// Its buffers are freed with this device's stream held (a session's
    /// last logits may outlive its device state, on any thread).
    gpu: Arc<Gpu>,
    free: parking_lot::Mutex<Vec<PinnedHostSlice<f32>>>,
}

/// Buffers a pool keeps for reuse; more given back are freed.
const LOGIT_POOL_KEEP: usize = 4;

impl LogitPool {
    fn new(gpu: Arc<Gpu>) -> LogitPool {
        LogitPool { gpu, free: parking_lot::Mutex::new(Vec::new()) }
    }

    /// A free buffer of `len` floats, or a new one.
    fn take(&self, gpu: &Gpu, len: usize) -> Result<PinnedHostSlice<f32>> {
        let mut free = self.free.lock();
        if let Some(i) = free.iter().position(|b| b.len() == len) {
            return Ok(free.swap_remove(i));
        }
        drop(free);
        // SAFETY: read only after a copy into it has completed (PinnedLogits::new waits for it).
        Ok(unsafe { gpu.context().alloc_pinned_with_flags::<f32>(len, 0) }?)
    }

    fn give_back(&self, buf: PinnedHostSlice<f32>) {
        let mut free = self.free.lock();
        if free.len() < LOGIT_POOL_KEEP {
            free.push(buf);
        } else {
            drop(free);
            let _held = StreamHold::new([&self.gpu]);
            drop(buf);
        }
    }
}

impl Drop for LogitPool {
    fn drop(&mut self) {
        let _held = StreamHold::new([&self.gpu]);
        self.free.get_mut().clear();
    }
}

/// One row of logits in a page-locked buffer of a `LogitPool`, read as
/// `[f32]`; dropping it gives the buffer back.
pub(crate) struct PinnedLogits {
    buf: Option<PinnedHostSlice<f32>>,
    /// The buffer's contents, checked complete once at creation.
    ptr: *const f32,
    len: usize,
    pool: Arc<LogitPool>,
}

// SAFETY: the buffer is page-locked host memory owned by this value (no
// device work writes it once `new` has waited for the copy), read through
// `&self` only; moving it between threads or sharing `&` is sound.
unsafe impl Send for PinnedLogits {}
unsafe impl Sync for PinnedLogits {}

impl PinnedLogits {
    /// Wraps `buf` once the copy into it has completed.
    fn new(buf: PinnedHostSlice<f32>, pool: &Arc<LogitPool>) -> Result<PinnedLogits> {
        let s = buf.as_slice()?;
        let (ptr, len) = (s.as_ptr(), s.len());
        Ok(PinnedLogits { buf: Some(buf), ptr, len, pool: pool.clone() })
    }
}

impl std::ops::Deref for PinnedLogits {
    type Target = [f32];

    fn deref(&self) -> &[f32] {
        // SAFETY: `ptr`/`len` describe `buf`, alive while `self` is, and
        // written by nothing while a `PinnedLogits` holds it.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for PinnedLogits {
    fn drop(&mut self) {
        if let Some(buf) = self.buf.take() {
            self.pool.give_back(buf);
        }
    }
}

/// The buffers of the final norm and head for `rows` rows.
struct LogitScratch {
    rows: CudaSlice<f32>,
    normed: CudaSlice<f32>,
    logits: CudaSlice<f32>,
    bf: CudaSlice<bf16>,
    /// Page-locked (cached, not write-combined) host copy of `logits`: the
    /// device writes it directly, without the driver's staging of a
    /// pageable copy.
    host: PinnedHostSlice<f32>,
    /// The buffers of the draws from one row (made on the first).
    draw: Option<sampling::DrawScratch>,
}

impl LogitScratch {
    /// The one for `rows` rows in `kept`, made on first use.
    fn get<'a>(
        kept: &'a mut Vec<(usize, LogitScratch)>,
        gpu: &Gpu,
        rows: usize,
        hidden: usize,
        vocab: usize,
    ) -> Result<&'a mut LogitScratch> {
        let i = match kept.iter().position(|(r, _)| *r == rows) {
            Some(i) => i,
            None => {
                let l = LogitScratch {
                    rows: gpu.alloc_zeros(rows * hidden)?,
                    normed: gpu.alloc_zeros(rows * hidden)?,
                    logits: gpu.alloc_zeros(rows * vocab)?,
                    // SAFETY: the host buffer is only read after a copy of `logits` into it has completed.
                    host: unsafe { gpu.context().alloc_pinned_with_flags::<f32>(rows * vocab, 0) }?,
                    bf: gpu.alloc_zeros(2 * rows * hidden)?,
                    draw: None,
                };
                kept.push((rows, l));
                kept.len() - 1
            }
        };
        Ok(&mut kept[i].1)
    }
}

/// Every intermediate buffer of a forward of `t` rows, sized exactly (the
/// elementwise kernels take whole buffers). A session keeps the last one,
/// so decode steps allocate nothing.
struct Scratch {
    t: usize,
    tokens: CudaSlice<u32>,
    x: CudaSlice<f32>,
    h: CudaSlice<f32>,
    /// The stacked projection's rows `[q' | k | v]`.
    qkv: CudaSlice<f32>,
    gate: CudaSlice<f32>,
    qn: CudaSlice<f32>,
    attn: CudaSlice<f32>,
    /// The split partials of the attention kernels.
    attn_split: AttnScratch,
    router: CudaSlice<f32>,
    ids: CudaSlice<u32>,
    weights: CudaSlice<f32>,
    moe: MoeScratch,
    shared: Option<SharedScratch>,
    dn: Option<DeltaScratch>,
    /// BF16 copy of a GEMM's input (cuBLAS path), as large as the widest.
    bf: CudaSlice<bf16>,
    /// The head's buffers, by row count (1 or `t`), made on first use.
    head: Vec<(usize, LogitScratch)>,
}

impl Scratch {
    fn new(gpu: &Gpu, c: &ModelConfig, t: usize) -> Result<Scratch> {
        let (h, e, k) = (c.hidden_size, c.num_experts, c.num_experts_per_tok);
        let (qd, kvd) = (c.q_dim(), c.kv_dim());
        let gated = c.has_attention_gate();
        let z = |n: usize| gpu.alloc_zeros::<f32>(n);
        let mut widest = h.max(qd);
        let dn = match c.linear_attn() {
            None => None,
            Some(_) => {
                let s = deltanet_shape(c);
                widest = widest.max(s.value_dim());
                Some(DeltaScratch {
                    qkvz: z(t * s.qkvz_dim())?,
                    ba: z(t * s.ba_dim())?,
                    core: z(t * s.value_dim())?,
                    scratch: DeltaNetScratch::new(gpu, s, t)?,
                })
            }
        };
        let shared = match c.shared_expert_intermediate_size() {
            None => None,
            Some(is) => {
                widest = widest.max(is);
                Some(SharedScratch {
                    logit: z(t)?,
                    zeros: gpu.alloc_zeros(t)?,
                    moe: MoeScratch::new(gpu, t, 1, 1, h, is)?,
                    g: z(t * is)?,
                    u: z(t * is)?,
                    act: z(t * is)?,
                    y: z(t * h)?,
                })
            }
        };
        Ok(Scratch {
            t,
            tokens: gpu.alloc_zeros(t)?,
            x: z(t * h)?,
            h: z(t * h)?,
            qkv: z(t * (c.q_proj_dim() + 2 * kvd))?,
            gate: z(if gated { t * qd } else { 0 })?,
            qn: z(t * qd)?,
            attn: z(t * qd)?,
            attn_split: AttnScratch::new(gpu, attention_shape(c), t)?,
            router: z(t * e)?,
            ids: gpu.alloc_zeros(t * k)?,
            weights: z(t * k)?,
            moe: MoeScratch::new(gpu, t, k, e, h, c.moe_intermediate_size)?,
            shared,
            dn,
            // hi and lo halves for the accurate GEMMs.
            bf: gpu.alloc_zeros(2 * t * widest)?,
            head: Vec::new(),
        })
    }
}

/// A session's state on the devices (see the module doc): one
/// `StageCache` per stage, each on its stage's device.
pub(crate) struct DeviceCache {
    config: ModelConfig,
    dtype: KvDtype,
    /// Committed positions.
    len: usize,
    stages: Vec<StageCache>,
}

/// A stage's part of a session's state: the KV and recurrent states of
/// its layers, its flags, scratch and captured decode step.
struct StageCache {
    gpu: Arc<Gpu>,
    /// The stage's layers.
    range: Range<usize>,
    config: ModelConfig,
    dtype: KvDtype,
    /// Per layer of the model (`None` outside this stage's layers): the KV
    /// of an attention layer.
    kv: Vec<Option<DeviceKv>>,
    /// Per layer (`None` outside this stage's layers): the state of a
    /// Gated DeltaNet layer.
    delta: Vec<Option<DeviceDeltaState>>,
    /// A copy of `delta` taken before each forward, to roll back a failure.
    spare: Vec<Option<DeviceDeltaState>>,
    /// One non-finite flag per layer, and one for the logits (this stage
    /// sets the slots of the layers before its own and, last stage, the
    /// last layer's and the logits').
    flags: CudaSlice<u32>,
    /// The scratch of the last forward of more than one row.
    scratch: Option<Scratch>,
    /// The scratch of one-row forwards (decode), kept apart so that a
    /// prefill does not move the buffers a captured step points to.
    decode: Option<Scratch>,
    step: Option<Step>,
    graph: Option<DecodeGraph>,
    /// Bumped whenever a buffer a captured step uses is reallocated.
    generation: u64,
    /// A split's timing of this stage in the current forward.
    clock: StageClock,
    /// Page-locked buffers for one row of logits (the last stage's decode
    /// steps), shared with the `PinnedLogits` a session holds.
    logit_pool: Arc<LogitPool>,
    /// What this forward moved and helped, for `SplitStats`.
    handoff_bytes: u64,
    helped_layers: u64,
    helper_rows: u64,
    /// The speed sample of this stage's helped steps (made at its first).
    help_clock: Option<HelpClock>,
}

/// Events around a stage's part of a forward (a split only: without one
/// nothing is recorded): the hand-off into it, then its layers.
#[derive(Default)]
struct StageClock {
    events: Option<[CudaEvent; 3]>,
    /// Which of hand-off and layers were recorded this forward.
    recorded: [bool; 2],
}

const CLOCK_HANDOFF: usize = 0;
const CLOCK_START: usize = 1;
const CLOCK_END: usize = 2;

impl StageClock {
    fn new(gpu: &Gpu, split: bool) -> Result<StageClock> {
        if !split {
            return Ok(StageClock::default());
        }
        let ev = || gpu.context().new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT));
        Ok(StageClock { events: Some([ev()?, ev()?, ev()?]), recorded: [false; 2] })
    }

    fn record(&mut self, gpu: &Gpu, which: usize) -> Result<()> {
        if let Some(ev) = &self.events {
            ev[which].record(gpu.stream())?;
        }
        Ok(())
    }

    fn hand_off(&mut self, gpu: &Gpu) -> Result<()> {
        self.recorded[0] = true;
        self.record(gpu, CLOCK_HANDOFF)
    }

    fn start(&mut self, gpu: &Gpu) -> Result<()> {
        self.record(gpu, CLOCK_START)
    }

    fn end(&mut self, gpu: &Gpu) -> Result<()> {
        self.recorded[1] = true;
        self.record(gpu, CLOCK_END)
    }

    /// Seconds of this stage's layers and of the hand-off into it (0 when
    /// not recorded), once the stream has finished; clears the record.
    fn read(&mut self) -> Result<(f64, f64)> {
        let Some(ev) = &self.events else { return Ok((0.0, 0.0)) };
        let secs = |a: usize, b: usize| -> Result<f64> { Ok(f64::from(ev[a].elapsed_ms(&ev[b])?) / 1e3) };
        let hand = if self.recorded[0] { secs(CLOCK_HANDOFF, CLOCK_START)? } else { 0.0 };
        let stage = if self.recorded[1] { secs(CLOCK_START, CLOCK_END)? } else { 0.0 };
        self.recorded = [false; 2];
        Ok((stage, hand))
    }
}

impl DeviceCache {
    /// Empty state for stages on `places` (device, layers), in layer order.
    fn new(places: Vec<(Arc<Gpu>, Range<usize>)>, c: &ModelConfig, dtype: KvDtype) -> Result<DeviceCache> {
        let split = places.len() > 1;
        let stages = places
            .into_iter()
            .map(|(gpu, range)| StageCache::new(gpu, range, c, dtype, split))
            .collect::<Result<Vec<_>>>()?;
        Ok(DeviceCache { config: c.clone(), dtype, len: 0, stages })
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn is_hybrid(&self) -> bool {
        self.stages.iter().any(|s| s.delta.iter().any(Option::is_some))
    }

    pub(crate) fn num_layers(&self) -> usize {
        self.config.num_hidden_layers
    }

    pub(crate) fn has_kv(&self, layer: usize) -> bool {
        self.stages.iter().any(|s| s.kv[layer].is_some())
    }

    pub(crate) fn truncate(&mut self, n: usize) {
        assert!(n <= self.len, "DeviceCache::truncate past its length");
        self.len = n;
    }

    /// Every stage's stream, held by this thread (`Gpu::queue`).
    fn hold(&self) -> StreamHold {
        StreamHold::new(self.stages.iter().map(|s| &s.gpu))
    }

    /// Grows every layer's KV (doubling) to hold `n` more positions.
    pub(crate) fn reserve(&mut self, n: usize) -> Result<()> {
        let _held = self.hold();
        let len = self.len;
        self.stages.iter_mut().try_for_each(|s| s.reserve(len, len + n))
    }

    fn snapshot(&mut self) -> Result<()> {
        for s in &mut self.stages {
            for (spare, d) in s.spare.iter_mut().zip(&s.delta) {
                if let (Some(spare), Some(d)) = (spare, d) {
                    spare.copy_from(&s.gpu, d)?;
                }
            }
        }
        Ok(())
    }

    fn restore_snapshot(&mut self) -> Result<()> {
        for s in &mut self.stages {
            for (d, spare) in s.delta.iter_mut().zip(&s.spare) {
                if let (Some(d), Some(spare)) = (d, spare) {
                    d.copy_from(&s.gpu, spare)?;
                }
            }
        }
        Ok(())
    }

    /// The Gated DeltaNet states, in layer order.
    pub(crate) fn deltas(&self) -> Result<Vec<DeltaNetState>> {
        let _held = self.hold();
        self.stages.iter().flat_map(|s| s.delta.iter().flatten().map(|d| d.download(&s.gpu))).collect()
    }

    pub(crate) fn restore_deltas(&mut self, states: &[DeltaNetState]) -> Result<()> {
        let _held = self.hold();
        let mut it = states.iter();
        for s in &mut self.stages {
            for d in s.delta.iter_mut().flatten() {
                let st = it.next().expect("DeviceCache::restore_deltas: too few states");
                assert!(
                    st.conv.len() == d.conv.len() && st.recurrent.len() == d.recurrent.len(),
                    "restore_deltas: shapes"
                );
                s.gpu.stream().memcpy_htod(&st.conv, &mut d.conv)?;
                s.gpu.stream().memcpy_htod(&st.recurrent, &mut d.recurrent)?;
            }
        }
        assert!(it.next().is_none(), "DeviceCache::restore_deltas: too many states");
        // The host states may be freed when this returns.
        self.stages.iter().try_for_each(|s| s.gpu.sync())
    }

    pub(crate) fn reset_deltas(&mut self) -> Result<()> {
        let _held = self.hold();
        for s in &mut self.stages {
            for d in s.delta.iter_mut().flatten() {
                s.gpu.stream().memset_zeros(&mut d.conv)?;
                s.gpu.stream().memset_zeros(&mut d.recurrent)?;
            }
        }
        Ok(())
    }

    /// Keys and values of `layer`, positions `0..len`, dequantized.
    pub(crate) fn layer_f32(&self, layer: usize) -> Result<(Vec<f32>, Vec<f32>)> {
        let _held = self.hold();
        let s = self.stages.iter().find(|s| s.kv[layer].is_some()).expect("layer_f32 of a Gated DeltaNet layer");
        attention::kv_read_f32(&s.gpu, s.kv[layer].as_ref().expect("found above"), self.len)
    }

    /// A new cache of this one's kind holding a restored state.
    pub(crate) fn restored(
        &self,
        len: usize,
        layers: Vec<(Vec<f32>, Vec<f32>)>,
        deltas: &[DeltaNetState],
    ) -> Result<DeviceCache> {
        let _held = self.hold();
        let places = self.stages.iter().map(|s| (s.gpu.clone(), s.range.clone())).collect();
        let mut d = DeviceCache::new(places, &self.config, self.dtype)?;
        d.reserve(len)?;
        for (l, (k, v)) in layers.into_iter().enumerate() {
            if len == 0 {
                break;
            }
            for s in &mut d.stages {
                if let Some(kv) = &mut s.kv[l] {
                    let (k, v) = (s.gpu.upload(&k)?, s.gpu.upload(&v)?);
                    attention::kv_append(&s.gpu, kv, &k, &v, 0, len)?;
                }
            }
        }
        d.restore_deltas(deltas)?;
        d.len = len;
        Ok(d)
    }
}

impl Drop for DeviceCache {
    /// Frees the state on its streams, held (a free is queued on a stream
    /// that another thread's forward may be capturing).
    fn drop(&mut self) {
        let _held = self.hold();
        self.stages.clear();
    }
}

impl StageCache {
    fn new(gpu: Arc<Gpu>, range: Range<usize>, c: &ModelConfig, dtype: KvDtype, split: bool) -> Result<StageCache> {
        let linear = linear_layers(c);
        let cap = KV_INITIAL_CAPACITY.min(c.max_position_embeddings.max(1));
        let kv = linear
            .iter()
            .enumerate()
            .map(|(l, s)| match s {
                None if range.contains(&l) => {
                    DeviceKv::new(&gpu, dtype, cap, c.num_key_value_heads, c.head_dim).map(Some)
                }
                _ => Ok(None),
            })
            .collect::<Result<Vec<_>>>()?;
        let states = |gpu: &Gpu| -> Result<Vec<Option<DeviceDeltaState>>> {
            linear
                .iter()
                .enumerate()
                .map(|(l, s)| s.filter(|_| range.contains(&l)).map(|s| DeviceDeltaState::new(gpu, s)).transpose())
                .collect()
        };
        let logit_pool = Arc::new(LogitPool::new(gpu.clone()));
        Ok(StageCache {
            delta: states(&gpu)?,
            spare: states(&gpu)?,
            flags: gpu.alloc_zeros(c.num_hidden_layers + 1)?,
            clock: StageClock::new(&gpu, split)?,
            gpu,
            range,
            config: c.clone(),
            dtype,
            kv,
            scratch: None,
            decode: None,
            step: None,
            graph: None,
            generation: 0,
            logit_pool,
            handoff_bytes: 0,
            helped_layers: 0,
            helper_rows: 0,
            help_clock: None,
        })
    }

    /// Grows this stage's KV (doubling) to hold `need` positions, keeping
    /// the first `len`.
    fn reserve(&mut self, len: usize, need: usize) -> Result<()> {
        for slot in self.kv.iter_mut() {
            let Some(kv) = slot else { continue };
            if kv.capacity >= need {
                continue;
            }
            let cap = need.max(2 * kv.capacity).min(self.config.max_position_embeddings.max(need));
            let mut grown = DeviceKv::new(&self.gpu, self.dtype, cap, kv.kv_heads, kv.head_dim)?;
            let rows = len * kv.kv_heads;
            let bytes = rows * kv.head_dim * self.dtype.value_bytes();
            let stream = self.gpu.stream();
            stream.memcpy_dtod(&kv.k.slice(..bytes), &mut grown.k.slice_mut(..bytes))?;
            stream.memcpy_dtod(&kv.v.slice(..bytes), &mut grown.v.slice_mut(..bytes))?;
            if self.dtype == KvDtype::Int8 {
                stream.memcpy_dtod(&kv.k_scale.slice(..rows), &mut grown.k_scale.slice_mut(..rows))?;
                stream.memcpy_dtod(&kv.v_scale.slice(..rows), &mut grown.v_scale.slice_mut(..rows))?;
            }
            *kv = grown;
            self.generation += 1;
        }
        Ok(())
    }

    /// The scratch for `t` rows: the kept one when it fits exactly.
    fn take_scratch(&mut self, t: usize) -> Result<Scratch> {
        if t == 1 {
            return match self.decode.take() {
                Some(s) => Ok(s),
                None => {
                    self.generation += 1;
                    Scratch::new(&self.gpu, &self.config, 1)
                }
            };
        }
        match self.scratch.take() {
            Some(s) if s.t == t => Ok(s),
            _ => Scratch::new(&self.gpu, &self.config, t),
        }
    }

    fn put_scratch(&mut self, s: Scratch) {
        if s.t == 1 {
            self.decode = Some(s);
        } else {
            self.scratch = Some(s);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_tiles_cover_only_the_picked_experts() {
        let t = moe::TILE_M;
        // Rows of experts 0..4: one tile, none, two and a bit, one row.
        let rows = [t, 0, 2 * t + 1, 1];
        assert_eq!(row_tiles(rows.into_iter(), |_| true), vec![0, 1, 1, 4, 5]);
        assert_eq!(row_tiles(rows.into_iter(), |j| j >= 2), vec![0, 0, 0, 3, 4]);
        assert_eq!(row_tiles(rows.into_iter(), |j| j == 0), vec![0, 1, 1, 1, 1]);
    }
}
