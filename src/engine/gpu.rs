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

use std::sync::Arc;

use half::bf16;

use super::{deltanet_shape, linear_layers, Engine, GpuPrecision, Logits};
use crate::backend::cuda::attention::{
    self, AttnConfig, AttnPrecision, AttnScratch, DeviceKv, KvDtype, QkvPrep, StepPlan, StepPos,
};
use crate::backend::cuda::cudarc::driver::PinnedHostSlice;
use crate::backend::cuda::deltanet::{
    deltanet_core_with, DeltaNetDeviceWeights, DeltaNetScratch, DeltaRuleForm, DeviceDeltaState,
};
use crate::backend::cuda::dense::{self, GemmPrecision, NormIn, RopeTable, Write};
use crate::backend::cuda::moe::{self, BlobLayout, ExpertGrouping, GroupedPrecision};
use crate::backend::cuda::{CudaSlice, DevicePtr, Gpu};
use crate::backend::{AttentionShape, DeltaNetState, Rope};
use crate::error::{Error, Result};
use crate::experts::gpu::{GpuExpertCache, TracePhase};
use crate::experts::ExpertCacheOptions;
use crate::experts::StepPlan as ExpertStepPlan;
use crate::model::weights::{layer_tensor_name, model_tensor_name, Role};
use crate::model::ModelConfig;
use crate::pack::format::ExpertLayout;
use crate::pack::{Pack, TensorData};
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

/// A captured decode step and the buffer generation it points to.
struct DecodeGraph {
    graph: CudaGraph,
    generation: u64,
}

// SAFETY: a CUDA graph has no thread affinity; it must only not be used
// from two threads at once. A `DecodeGraph` lives in one session's cache
// and is only touched through `&mut` of that cache (a session is used by
// one call at a time), so moving it to another thread is sound.
unsafe impl Send for DecodeGraph {}

/// First capacity of a session's device KV, in positions.
const KV_INITIAL_CAPACITY: usize = 256;

/// A model loaded onto one CUDA device.
pub(crate) struct GpuModel {
    gpu: Arc<Gpu>,
    config: ModelConfig,
    embed: CudaSlice<bf16>,
    /// `None` when tied to the embedding.
    lm_head: Option<CudaSlice<bf16>>,
    final_norm: CudaSlice<f32>,
    layers: Vec<GpuLayer>,
    rope: RopeTable,
    /// Every expert blob of the main layers at the pack's stride (empty
    /// with an expert cache). Only the tables below point into it.
    _experts: CudaSlice<u8>,
    /// Per layer: the device address of each expert's blob (empty with an
    /// expert cache: its tables are used).
    tables: Vec<CudaSlice<u64>>,
    /// The expert cache, when `EngineOptions::expert_cache` asks for one:
    /// experts in device slots, page-locked RAM and the mapped pack.
    experts: Option<parking_lot::Mutex<GpuExpertCache>>,
    layout: BlobLayout,
    precision: GpuPrecision,
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
    /// Copies the pack's weights to `gpu`; `progress(done, total)` after each layer.
    pub(crate) fn load(
        pack: &Pack,
        gpu: Arc<Gpu>,
        rope: &Rope,
        precision: GpuPrecision,
        cache_opts: &ExpertCacheOptions,
        progress: &mut dyn FnMut(usize, usize) -> Result<()>,
    ) -> Result<GpuModel> {
        let c = pack.config().clone();
        let (h, v, e) = (c.hidden_size, c.vocab_size, c.num_experts);
        let total = c.num_hidden_layers + 1;
        let zc = c.arch.zero_centered_norms();

        let expert_layout = pack.layout();
        let layout = BlobLayout::from(&expert_layout);
        let stride = expert_layout.stride as usize;
        let per_layer = e * stride;
        let cached = cache_opts.enabled();
        let mut experts = gpu.alloc_zeros::<u8>(if cached { 0 } else { c.num_hidden_layers * per_layer })?;
        let base = address(&gpu, &experts);
        let mut tables = Vec::with_capacity(c.num_hidden_layers);
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for l in 0..c.num_hidden_layers {
            if !cached {
                let bytes = pack.expert_layer_bytes(l)?;
                gpu.stream().memcpy_htod(bytes, &mut experts.slice_mut(l * per_layer..(l + 1) * per_layer))?;
                let table: Vec<u64> = (0..e).map(|x| base + ((l * e + x) * stride) as u64).collect();
                tables.push(gpu.upload(&table)?);
            }
            layers.push(GpuLayer::load(pack, &gpu, l)?);
            // Host buffers of this layer may be freed only once copied.
            gpu.sync()?;
            progress(l + 1, total)?;
        }
        let embed = upload_bf16(&gpu, pack, model_tensor_name(Role::Embedding), &[v, h])?;
        let lm_head = if c.tie_word_embeddings {
            None
        } else {
            Some(upload_bf16(&gpu, pack, model_tensor_name(Role::LmHead), &[v, h])?)
        };
        let final_norm = upload_f32(&gpu, pack, model_tensor_name(Role::FinalNorm), h, zc)?;
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
        let experts_cache = GpuExpertCache::load(pack, &gpu, cache_opts)?.map(parking_lot::Mutex::new);
        gpu.sync()?;
        progress(total, total)?;
        Ok(GpuModel {
            gpu,
            config: c,
            embed,
            lm_head,
            final_norm,
            layers,
            rope,
            _experts: experts,
            tables,
            experts: experts_cache,
            layout,
            precision,
        })
    }

    /// `f` of the expert cache (`None` without one).
    pub(crate) fn expert_cache<R>(&self, f: impl FnOnce(&GpuExpertCache) -> R) -> Option<R> {
        self.experts.as_ref().map(|c| f(&c.lock()))
    }

    /// A session cache on this device.
    pub(crate) fn new_cache(&self, kv_type: KvType) -> Result<DeviceCache> {
        let dtype = match kv_type {
            KvType::Auto | KvType::Int8 => KvDtype::Int8,
            KvType::Bf16 => KvDtype::Bf16,
            KvType::F32 => {
                return Err(Error::Unsupported("kv_type F32: the cuda backend keeps int8 (default) or bf16 KV".into()))
            }
        };
        DeviceCache::new(self.gpu.clone(), &self.config, dtype)
    }

    /// `Engine::forward` on the device: runs `tokens` at positions
    /// `cache.len()..`, returns the requested logits; on error the cache is
    /// back where it was (KV length and recurrent states).
    pub(crate) fn forward(
        &self,
        engine: &Engine,
        cache: &mut DeviceCache,
        tokens: &[u32],
        logits: Logits,
    ) -> Result<Vec<f32>> {
        let start = cache.len;
        cache.reserve(tokens.len())?;
        let hybrid = cache.is_hybrid();
        if hybrid {
            cache.snapshot()?;
        }
        match self.forward_rows(engine, cache, tokens, logits) {
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

    fn forward_rows(&self, engine: &Engine, cache: &mut DeviceCache, tokens: &[u32], want: Logits) -> Result<Vec<f32>> {
        if tokens.len() == 1 && want == Logits::Last && self.graph_allowed(engine) {
            return self.forward_graph(engine, cache, tokens[0]);
        }
        let t = tokens.len();
        let start = cache.len;
        let rows = match want {
            Logits::Skip => 0,
            Logits::Last => 1,
            Logits::All => t,
        };
        let mut experts = self.experts.as_ref().map(|x| x.lock());
        if let Some(x) = experts.as_mut() {
            x.begin_forward(t)?;
        }
        let mut s = cache.take_scratch(t)?;
        let started = std::time::Instant::now();
        let k = self.config.num_experts_per_tok;
        let r = (|| -> Result<Vec<f32>> {
            self.gpu.stream().memcpy_htod(tokens, &mut s.tokens)?;
            self.enqueue(engine, cache, &mut s, start, rows, None, experts.as_deref_mut())?;
            if let Some(x) = experts.as_mut().filter(|x| x.mapped_decode(t)) {
                x.note_mapped_forward(t, k)?;
            }
            self.finish(cache, &mut s, start, rows, started)
        })();
        cache.put_scratch(s);
        let r = match (r, experts.as_mut()) {
            (Ok(l), Some(x)) => x.end_forward(engine.pack(), t).map(|()| l),
            (r, _) => r,
        };
        r
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

    /// Whether a one-row decode step may run as a CUDA graph: on unless
    /// `STRATA_CUDA_GRAPH=0`, and not while a test injects a NaN (the
    /// injection is a host decision made while queueing).
    #[cfg_attr(not(any(test, feature = "test-hooks")), allow(unused_variables))]
    fn graph_allowed(&self, engine: &Engine) -> bool {
        if self.experts.as_ref().is_some_and(|x| !x.lock().mapped_decode(1)) {
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

    /// A decode step (one row, the last logits) replayed from a CUDA graph:
    /// the step is captured once per session (again when its buffers move:
    /// KV growth), and each call writes the token and the position to the
    /// device and launches the graph. The kernels that depend on the
    /// position read it from device memory (`StepPos`).
    fn forward_graph(&self, engine: &Engine, cache: &mut DeviceCache, token: u32) -> Result<Vec<f32>> {
        let gpu = &*self.gpu;
        let c = &self.config;
        let start = cache.len;
        let mut experts = self.experts.as_ref().map(|x| x.lock());
        if let Some(x) = experts.as_mut() {
            x.begin_forward(1)?;
        }
        let mut s = cache.take_scratch(1)?;
        let mut step = cache.step.take();
        let started = std::time::Instant::now();
        let r = (|| -> Result<Vec<f32>> {
            let step = match &mut step {
                Some(st) => st,
                None => step.insert(Step {
                    pos: StepPos::new(gpu)?,
                    plan: attention::step_plan(gpu, attention_shape(c), 1, cache.dtype)?,
                }),
            };
            gpu.stream().memcpy_htod(&[token], &mut s.tokens)?;
            step.pos.set(gpu, start, attention::step_chunk(&step.plan, start + 1))?;
            // Everything the graph points to must exist before the capture.
            LogitScratch::get(&mut s.head, gpu, 1, c.hidden_size, c.vocab_size)?;
            if cache.graph.as_ref().is_none_or(|g| g.generation != cache.generation) {
                cache.graph = None;
                gpu.stream().begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
                let queued = self.enqueue(engine, cache, &mut s, start, 1, Some(step), experts.as_deref_mut());
                let captured = gpu.stream().end_capture(sys::CUgraphInstantiate_flags(0));
                queued?;
                let graph = captured?.ok_or_else(|| Error::Cuda("capturing the decode step gave no graph".into()))?;
                cache.graph = Some(DecodeGraph { graph, generation: cache.generation });
            }
            cache.graph.as_ref().expect("captured above").graph.launch()?;
            if let Some(x) = experts.as_mut() {
                x.note_mapped_forward(1, c.num_experts_per_tok)?;
            }
            self.finish(cache, &mut s, start, 1, started)
        })();
        cache.step = step;
        cache.put_scratch(s);
        match (r, experts.as_mut()) {
            (Ok(l), Some(x)) => x.end_forward(engine.pack(), 1).map(|()| l),
            (r, _) => r,
        }
    }

    /// Queues a forward of the `s.t` rows whose tokens are in `s.tokens`,
    /// at positions `start..`: the flags reset, the embedding, every layer,
    /// and the head for the last `rows` rows. Nothing here waits or copies
    /// from the host, so it can be captured into a graph (with `step`:
    /// position-dependent kernels then read the position on the device).
    #[cfg_attr(not(any(test, feature = "test-hooks")), allow(unused_variables))]
    #[allow(clippy::too_many_arguments)]
    fn enqueue(
        &self,
        engine: &Engine,
        cache: &mut DeviceCache,
        s: &mut Scratch,
        start: usize,
        rows: usize,
        step: Option<&Step>,
        mut experts: Option<&mut GpuExpertCache>,
    ) -> Result<()> {
        let c = &self.config;
        let gpu = &*self.gpu;
        let (h, t, vocab) = (c.hidden_size, s.t, c.vocab_size);
        let eps = c.rms_norm_eps as f32;
        dense::reset_flags(gpu, &mut cache.flags)?;
        dense::embed(gpu, &self.embed, &s.tokens, t, h, &mut s.x)?;
        for (l, lw) in self.layers.iter().enumerate() {
            // Each block adds its output to the residual stream x itself
            // (the projections and expert kernels accumulate).
            // The input norm runs in the mixer's first projection; layer
            // l - 1's output is checked for NaN/inf there (slot l - 1).
            match &lw.mixer {
                GpuMixer::Attention { .. } => self.attention(l, lw, cache, s, start, step)?,
                GpuMixer::Linear { .. } => self.linear(l, lw, cache, s)?,
            }
            self.moe(engine, l, lw, s, experts.as_deref_mut())?;
            #[cfg(any(test, feature = "test-hooks"))]
            if let Some(row) = engine.take_nan(l, start, t) {
                gpu.stream().memcpy_htod(&[f32::NAN], &mut s.x.slice_mut(row * h..row * h + 1))?;
            }
            if l + 1 == self.layers.len() {
                dense::first_nonfinite(gpu, &s.x, h, &mut cache.flags, l)?;
            }
        }
        if rows > 0 {
            let head = self.lm_head.as_ref().unwrap_or(&self.embed);
            let lg = LogitScratch::get(&mut s.head, gpu, rows, h, vocab)?;
            gpu.stream().memcpy_dtod(&s.x.slice((t - rows) * h..t * h), &mut lg.rows)?;
            dense::rmsnorm(gpu, &lg.rows, &self.final_norm, eps, &mut lg.normed)?;
            self.proj(Write::Store, &lg.normed, head, rows, vocab, h, &mut lg.logits, &mut lg.bf)?;
            dense::first_nonfinite(gpu, &lg.logits, vocab, &mut cache.flags, c.num_hidden_layers)?;
        }
        Ok(())
    }

    /// Waits for a queued forward and returns its logits (the last `rows`
    /// rows), or the non-finite error of the first layer (or the logits)
    /// whose flag is set.
    fn finish(
        &self,
        cache: &mut DeviceCache,
        s: &mut Scratch,
        start: usize,
        rows: usize,
        started: std::time::Instant,
    ) -> Result<Vec<f32>> {
        let c = &self.config;
        let gpu = &*self.gpu;
        let (h, t, vocab) = (c.hidden_size, s.t, c.vocab_size);
        let queued = started.elapsed();
        // Both copies queued, then one wait.
        let mut flags = vec![0u32; cache.flags.len()];
        let out = if rows > 0 {
            let lg = LogitScratch::get(&mut s.head, gpu, rows, h, vocab)?;
            gpu.stream().memcpy_dtoh(&lg.logits, &mut lg.host)?;
            gpu.stream().memcpy_dtoh(&cache.flags, &mut flags)?;
            gpu.sync()?;
            lg.host.as_slice()?.to_vec()
        } else {
            gpu.stream().memcpy_dtoh(&cache.flags, &mut flags)?;
            gpu.sync()?;
            Vec::new()
        };
        if trace_forward() {
            eprintln!(
                "strata: forward of {t} rows: queued in {:.3} ms, done in {:.3} ms",
                queued.as_secs_f64() * 1e3,
                started.elapsed().as_secs_f64() * 1e3
            );
        }
        let first_logit_row = start + t - rows;
        for (slot, &flag) in flags.iter().enumerate() {
            let width = if slot < c.num_hidden_layers { h } else { vocab };
            if let Some((row, _)) = dense::nonfinite_row(flag, width) {
                let place =
                    if slot < c.num_hidden_layers { format!("at layer {slot}") } else { "in the logits".into() };
                let pos = if slot < c.num_hidden_layers { start + row } else { first_logit_row + row };
                return Err(Error::NonFinite(format!("NaN or infinity {place}, position {pos}")));
            }
        }
        Ok(out)
    }

    /// `x += o_proj(attention(...))` of the normed rows in `s.h`.
    fn attention(
        &self,
        l: usize,
        lw: &GpuLayer,
        cache: &mut DeviceCache,
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
        self.normed_proj(norm, &s.x, &mut s.h, false, qkv, t, width, h, &mut s.qkv, &mut s.bf)?;
        // The q/k norms, RoPE, the gate split and the KV append in one
        // launch; in a captured decode step the position comes from the device.
        let prep = QkvPrep { heads: shape.heads, gated: c.has_attention_gate(), q_norm, k_norm, eps, rope: &self.rope };
        let gate = if prep.gated { Some(&mut s.gate) } else { None };
        let kv = cache.kv[l].as_mut().expect("an attention layer has KV");
        match step {
            None => {
                attention::qkv_prepare(gpu, &prep, &s.qkv, t, kv, start, &mut s.qn, gate)?;
                attention::attention_with_scratch(
                    gpu,
                    &s.qn,
                    kv,
                    shape,
                    start,
                    t,
                    &mut s.attn,
                    self.attn_config(),
                    &mut s.attn_split,
                )?;
            }
            Some(st) => {
                attention::qkv_prepare_at(gpu, &prep, &s.qkv, t, kv, &st.pos, &mut s.qn, gate)?;
                attention::attention_at(gpu, &s.qn, kv, shape, t, &mut s.attn, &st.plan, &st.pos, &mut s.attn_split)?;
            }
        }
        if c.has_attention_gate() {
            dense::output_gate(gpu, &mut s.attn, &s.gate)?;
        }
        self.proj(Write::Add, &s.attn, o_proj, t, h, qd, &mut s.x, &mut s.bf)
    }

    /// `x += out_proj(gated_deltanet(...))` of the normed rows in `s.h`.
    fn linear(&self, l: usize, lw: &GpuLayer, cache: &mut DeviceCache, s: &mut Scratch) -> Result<()> {
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
    fn moe(
        &self,
        engine: &Engine,
        l: usize,
        lw: &GpuLayer,
        s: &mut Scratch,
        mut experts: Option<&mut GpuExpertCache>,
    ) -> Result<()> {
        let c = &self.config;
        let gpu = &*self.gpu;
        let (t, h, e, k) = (s.t, c.hidden_size, c.num_experts, c.num_experts_per_tok);
        let norm = NormIn { w: &lw.post_attn_norm, eps: c.rms_norm_eps as f32, check: None };
        self.normed_proj(norm, &s.x, &mut s.h, true, &lw.router, t, e, h, &mut s.router, &mut s.bf)?;
        let p = self.grouped_precision();
        if let Some(x) = experts.as_deref_mut().filter(|x| x.mapped_decode(t)) {
            // Mapped decode: the resident path through the cache's table
            // (slots, and host memory read in place); the ids kept per layer.
            let (table, mut ids) = x.mapped_step(l)?;
            let route = moe::Route {
                logits: &s.router,
                num_experts: e,
                norm_topk_prob: c.norm_topk_prob,
                ids: &mut ids,
                weights: &mut s.weights,
            };
            let layout = &self.layout;
            moe::expert_gate_up_gemv_routed(gpu, &s.h, route, table, layout, t, k, &mut s.moe.act)?;
            moe::expert_down_gemv(gpu, &s.moe.act, &ids, &s.weights, table, layout, t, k, &mut s.x, true)?;
        } else if let Some(x) = experts {
            self.cached_experts(engine.pack(), x, l, s)?;
        } else if t <= MOE_GEMV_MAX_ROWS {
            let (table, layout) = (&self.tables[l], &self.layout);
            // Decode: the routing runs inside the gate/up GEMV (one launch fewer).
            let route = moe::Route {
                logits: &s.router,
                num_experts: e,
                norm_topk_prob: c.norm_topk_prob,
                ids: &mut s.ids,
                weights: &mut s.weights,
            };
            moe::expert_gate_up_gemv_routed(gpu, &s.h, route, table, layout, t, k, &mut s.moe.act)?;
            moe::expert_down_gemv(gpu, &s.moe.act, &s.ids, &s.weights, table, layout, t, k, &mut s.x, true)?;
        } else {
            let (table, layout) = (&self.tables[l], &self.layout);
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

impl GpuModel {
    /// The routed experts of layer `l` through the expert cache: top-k on
    /// the device, the ids read back, the step planned (misses copied into
    /// slots, the layer's table pointed at them), then the one expert
    /// pipeline (`run_experts`); a step with streamed experts computes in
    /// waves, each wave's copies into the ring overlapping the wave before.
    fn cached_experts(&self, pack: &Pack, x: &mut GpuExpertCache, l: usize, s: &mut Scratch) -> Result<()> {
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
        let r = self.cached_compute(pack, x, l, s, &ids, &plan);
        x.trace(TracePhase::Compute, started);
        r
    }

    /// The expert kernels of a planned cached step (`cached_experts`).
    fn cached_compute(
        &self,
        pack: &Pack,
        x: &mut GpuExpertCache,
        l: usize,
        s: &mut Scratch,
        ids: &[u32],
        plan: &ExpertStepPlan,
    ) -> Result<()> {
        let c = &self.config;
        let gpu = &*self.gpu;
        let (t, e, k) = (s.t, c.num_experts, c.num_experts_per_tok);
        let p = self.grouped_precision();
        let layout = &self.layout;
        if plan.ring.is_empty() {
            return run_experts(gpu, &s.h, &s.ids, &s.weights, x.table(l), layout, t, k, &mut s.moe, &mut s.x, true, p);
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
        for (w, experts) in std::iter::once(&waves.slots).chain(&ring_waves).enumerate() {
            if experts.is_empty() {
                continue;
            }
            let ring_wave = w.checked_sub(1);
            if let Some(rw) = ring_wave {
                x.stream_wave(pack, plan, &waves, rw)?;
            }
            let mut tiles = vec![0u32; e + 1];
            for j in 0..e {
                let mine = experts.binary_search(&j).is_ok();
                tiles[j + 1] = tiles[j] + if mine { counts[j].div_ceil(moe::TILE_M) as u32 } else { 0 };
            }
            // The grouping's own tile offsets are rewritten by its next fill.
            gpu.stream().memcpy_htod(&tiles, &mut g.tile_offsets)?;
            moe::expert_gate_up_grouped_with(gpu, &s.h, g, x.table(l), layout, &mut m.act, p)?;
            moe::expert_down_grouped_with(gpu, &m.act, g, x.table(l), layout, y, p)?;
            if let Some(rw) = ring_wave {
                x.wave_computed(rw)?;
            }
        }
        moe::moe_combine(gpu, y, g, &s.weights, layout.hidden as usize, &mut s.x, true)
    }
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
}

impl MoeScratch {
    fn new(gpu: &Gpu, t: usize, k: usize, num_experts: usize, hidden: usize, inter: usize) -> Result<MoeScratch> {
        let grouped = t > MOE_GEMV_MAX_ROWS;
        Ok(MoeScratch {
            act: gpu.alloc_zeros(t * k * inter)?,
            grouping: if grouped { Some(ExpertGrouping::new(gpu, t * k, num_experts)?) } else { None },
            y: if grouped { Some(gpu.alloc_zeros(t * k * hidden)?) } else { None },
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

/// A session's state on the device (see the module doc).
pub(crate) struct DeviceCache {
    gpu: Arc<Gpu>,
    config: ModelConfig,
    dtype: KvDtype,
    /// Committed positions.
    len: usize,
    /// Per layer: the KV of an attention layer.
    kv: Vec<Option<DeviceKv>>,
    /// Per layer: the state of a Gated DeltaNet layer.
    delta: Vec<Option<DeviceDeltaState>>,
    /// A copy of `delta` taken before each forward, to roll back a failure.
    spare: Vec<Option<DeviceDeltaState>>,
    /// One non-finite flag per layer, and one for the logits.
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
}

impl DeviceCache {
    fn new(gpu: Arc<Gpu>, c: &ModelConfig, dtype: KvDtype) -> Result<DeviceCache> {
        let linear = linear_layers(c);
        let cap = KV_INITIAL_CAPACITY.min(c.max_position_embeddings.max(1));
        let kv = linear
            .iter()
            .map(|s| match s {
                Some(_) => Ok(None),
                None => DeviceKv::new(&gpu, dtype, cap, c.num_key_value_heads, c.head_dim).map(Some),
            })
            .collect::<Result<Vec<_>>>()?;
        let states = |gpu: &Gpu| -> Result<Vec<Option<DeviceDeltaState>>> {
            linear.iter().map(|s| s.map(|s| DeviceDeltaState::new(gpu, s)).transpose()).collect()
        };
        Ok(DeviceCache {
            delta: states(&gpu)?,
            spare: states(&gpu)?,
            flags: gpu.alloc_zeros(c.num_hidden_layers + 1)?,
            gpu,
            config: c.clone(),
            dtype,
            len: 0,
            kv,
            scratch: None,
            decode: None,
            step: None,
            graph: None,
            generation: 0,
        })
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn is_hybrid(&self) -> bool {
        self.delta.iter().any(Option::is_some)
    }

    pub(crate) fn num_layers(&self) -> usize {
        self.kv.len()
    }

    pub(crate) fn has_kv(&self, layer: usize) -> bool {
        self.kv[layer].is_some()
    }

    pub(crate) fn truncate(&mut self, n: usize) {
        assert!(n <= self.len, "DeviceCache::truncate past its length");
        self.len = n;
    }

    /// Grows every layer's KV (doubling) to hold `n` more positions.
    pub(crate) fn reserve(&mut self, n: usize) -> Result<()> {
        let need = self.len + n;
        for slot in self.kv.iter_mut() {
            let Some(kv) = slot else { continue };
            if kv.capacity >= need {
                continue;
            }
            let cap = need.max(2 * kv.capacity).min(self.config.max_position_embeddings.max(need));
            let mut grown = DeviceKv::new(&self.gpu, self.dtype, cap, kv.kv_heads, kv.head_dim)?;
            let rows = self.len * kv.kv_heads;
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

    fn snapshot(&mut self) -> Result<()> {
        for (spare, d) in self.spare.iter_mut().zip(&self.delta) {
            if let (Some(spare), Some(d)) = (spare, d) {
                spare.copy_from(&self.gpu, d)?;
            }
        }
        Ok(())
    }

    fn restore_snapshot(&mut self) -> Result<()> {
        for (d, spare) in self.delta.iter_mut().zip(&self.spare) {
            if let (Some(d), Some(spare)) = (d, spare) {
                d.copy_from(&self.gpu, spare)?;
            }
        }
        Ok(())
    }

    pub(crate) fn deltas(&self) -> Result<Vec<DeltaNetState>> {
        self.delta.iter().flatten().map(|d| d.download(&self.gpu)).collect()
    }

    pub(crate) fn restore_deltas(&mut self, states: &[DeltaNetState]) -> Result<()> {
        let mut it = states.iter();
        for d in self.delta.iter_mut().flatten() {
            let s = it.next().expect("DeviceCache::restore_deltas: too few states");
            assert!(s.conv.len() == d.conv.len() && s.recurrent.len() == d.recurrent.len(), "restore_deltas: shapes");
            self.gpu.stream().memcpy_htod(&s.conv, &mut d.conv)?;
            self.gpu.stream().memcpy_htod(&s.recurrent, &mut d.recurrent)?;
        }
        assert!(it.next().is_none(), "DeviceCache::restore_deltas: too many states");
        // The host states may be freed when this returns.
        self.gpu.sync()
    }

    pub(crate) fn reset_deltas(&mut self) -> Result<()> {
        for d in self.delta.iter_mut().flatten() {
            self.gpu.stream().memset_zeros(&mut d.conv)?;
            self.gpu.stream().memset_zeros(&mut d.recurrent)?;
        }
        Ok(())
    }

    /// Keys and values of `layer`, positions `0..len`, dequantized.
    pub(crate) fn layer_f32(&self, layer: usize) -> Result<(Vec<f32>, Vec<f32>)> {
        let kv = self.kv[layer].as_ref().expect("layer_f32 of a Gated DeltaNet layer");
        attention::kv_read_f32(&self.gpu, kv, self.len)
    }

    /// A new cache of this one's kind holding a restored state.
    pub(crate) fn restored(
        &self,
        len: usize,
        layers: Vec<(Vec<f32>, Vec<f32>)>,
        deltas: &[DeltaNetState],
    ) -> Result<DeviceCache> {
        let mut d = DeviceCache::new(self.gpu.clone(), &self.config, self.dtype)?;
        d.reserve(len)?;
        for (slot, (k, v)) in d.kv.iter_mut().zip(layers) {
            if let Some(kv) = slot {
                if len > 0 {
                    let (k, v) = (self.gpu.upload(&k)?, self.gpu.upload(&v)?);
                    attention::kv_append(&self.gpu, kv, &k, &v, 0, len)?;
                }
            }
        }
        d.restore_deltas(deltas)?;
        d.len = len;
        Ok(d)
    }
}
