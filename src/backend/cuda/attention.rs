//! CUDA launch wrappers for kernels/attention.cu (see kernels/README.md):
//! the device KV cache of one attention layer (int8 with per-block scales,
//! or bf16), appending rows to it, and causal grouped-query attention over
//! it (flash-decoding for a few rows, tiled flash attention for prefill).

use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute_enum};

use super::{CudaFunction, CudaSlice, Gpu, KernelArgs, LaunchConfig, PushKernelArg, PREWAIT_ATTN};
use crate::backend::AttentionShape;
use crate::error::{Error, Result};

/// Element type of a device KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvDtype {
    /// i8 values, one f32 scale per (position, kv head) block of head_dim
    /// values: `scale = amax / 127`, `value = round_ties_even(x / scale)`
    /// clamped to ±127 (all 0 when the scale is 0); `x ≈ value * scale`.
    Int8,
    /// bf16 values (round to nearest even), no scales.
    Bf16,
}

impl KvDtype {
    /// Bytes of one cached value.
    pub fn value_bytes(self) -> usize {
        match self {
            KvDtype::Int8 => 1,
            KvDtype::Bf16 => 2,
        }
    }

    fn kernel_tag(self) -> &'static str {
        match self {
            KvDtype::Int8 => "i8",
            KvDtype::Bf16 => "bf16",
        }
    }
}

/// One attention layer's KV cache on the device, `capacity` positions: K and
/// V each `[capacity, kv_heads, head_dim]` (raw bytes of `dtype`), and for
/// Int8 one f32 scale per (position, kv head) in `k_scale` / `v_scale`
/// (`[capacity, kv_heads]`; a single unused element for Bf16).
pub struct DeviceKv {
    pub dtype: KvDtype,
    pub capacity: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub k: CudaSlice<u8>,
    pub v: CudaSlice<u8>,
    pub k_scale: CudaSlice<f32>,
    pub v_scale: CudaSlice<f32>,
}

/// head_dim values the kernels are built for (SIMT: all of them).
const HEAD_DIMS: [usize; 5] = [16, 32, 64, 128, 256];
/// head_dim values the tensor-core kernels (attn_mma_*, attn_dec_*) are built for;
/// `AttnKernel::Auto` runs the SIMT kernel for the others.
const TC_HEAD_DIMS: [usize; 3] = [64, 128, 256];

impl DeviceKv {
    /// A zeroed cache of `capacity` positions.
    pub fn new(gpu: &Gpu, dtype: KvDtype, capacity: usize, kv_heads: usize, head_dim: usize) -> Result<DeviceKv> {
        if capacity == 0 || kv_heads == 0 || !HEAD_DIMS.contains(&head_dim) {
            return Err(Error::InvalidArgument(format!(
                "DeviceKv: capacity {capacity}, kv_heads {kv_heads}, head_dim {head_dim} (head_dim must be 16, 32, 64, 128 or 256)"
            )));
        }
        if capacity > i32::MAX as usize / 2 {
            return Err(Error::InvalidArgument(format!("DeviceKv: capacity {capacity} positions is too many")));
        }
        let values = capacity * kv_heads * head_dim * dtype.value_bytes();
        let scales = match dtype {
            KvDtype::Int8 => capacity * kv_heads,
            KvDtype::Bf16 => 1,
        };
        Ok(DeviceKv {
            dtype,
            capacity,
            kv_heads,
            head_dim,
            k: gpu.alloc_zeros::<u8>(values)?,
            v: gpu.alloc_zeros::<u8>(values)?,
            k_scale: gpu.alloc_zeros::<f32>(scales)?,
            v_scale: gpu.alloc_zeros::<f32>(scales)?,
        })
    }

    /// Device bytes held (values and scales of K and V).
    pub fn bytes(&self) -> usize {
        self.k.len() + self.v.len() + 4 * (self.k_scale.len() + self.v_scale.len())
    }

    /// Bytes one position occupies (K and V, scales included): what attention reads per key.
    pub fn bytes_per_position(&self) -> usize {
        let values = 2 * self.kv_heads * self.head_dim * self.dtype.value_bytes();
        match self.dtype {
            KvDtype::Int8 => values + 2 * 4 * self.kv_heads,
            KvDtype::Bf16 => values,
        }
    }

    fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim
    }
}

/// The int8 quantization of one (position, kv head) block, exactly as
/// attn_kv_append_i8 does it (the rule lives with the CPU's emulation of
/// the int8 cache).
pub use crate::quant::quantize_int8_block;

fn launch_err(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Cuda(format!("{what}: {e}"))
}

fn i32_arg(what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| Error::InvalidArgument(format!("{what} = {v} does not fit in i32")))
}

/// Quantizes (Int8) or rounds (Bf16) `rows` rows of `k` and `v`
/// (`[rows, kv_heads * head_dim]` f32) into positions `start_pos..start_pos + rows`.
pub fn kv_append(
    gpu: &Gpu,
    kv: &mut DeviceKv,
    k: &CudaSlice<f32>,
    v: &CudaSlice<f32>,
    start_pos: usize,
    rows: usize,
) -> Result<()> {
    let kv_dim = kv.kv_dim();
    if rows == 0 {
        return Ok(());
    }
    if k.len() < rows * kv_dim || v.len() < rows * kv_dim {
        return Err(Error::InvalidArgument(format!(
            "kv_append: k/v hold {}/{} values, {rows} rows need {}",
            k.len(),
            v.len(),
            rows * kv_dim
        )));
    }
    if start_pos + rows > kv.capacity {
        return Err(Error::InvalidArgument(format!(
            "kv_append: positions {start_pos}..{} past the capacity {}",
            start_pos + rows,
            kv.capacity
        )));
    }
    let sp = i32_arg("start_pos", start_pos)?;
    kv_append_launch(gpu, kv, k, v, sp, rows, None)
}

/// `kv_append` with start_pos read from `pos.buf[0]` on the device (a
/// captured decode step): positions `start_pos..start_pos + rows` must lie
/// within the capacity (the caller's duty: nothing is checked on the host
/// value here). No allocation, synchronization or host copy.
pub fn kv_append_at(
    gpu: &Gpu,
    kv: &mut DeviceKv,
    k: &CudaSlice<f32>,
    v: &CudaSlice<f32>,
    pos: &StepPos,
    rows: usize,
) -> Result<()> {
    let kv_dim = kv.kv_dim();
    if rows == 0 {
        return Ok(());
    }
    if k.len() < rows * kv_dim || v.len() < rows * kv_dim || rows > kv.capacity || pos.buf.len() < 2 {
        return Err(Error::InvalidArgument(format!(
            "kv_append_at: k/v hold {}/{} values, {rows} rows need {} (capacity {})",
            k.len(),
            v.len(),
            rows * kv_dim,
            kv.capacity
        )));
    }
    kv_append_launch(gpu, kv, k, v, 0, rows, Some(&pos.buf))
}

/// The append kernels; `step`: None (start_pos `sp`) or the StepPos buffer.
fn kv_append_launch(
    gpu: &Gpu,
    kv: &mut DeviceKv,
    k: &CudaSlice<f32>,
    v: &CudaSlice<f32>,
    sp: i32,
    rows: usize,
    step: Option<&CudaSlice<i32>>,
) -> Result<()> {
    let kv_dim = kv.kv_dim();
    let n = i32_arg("rows", rows)?;
    let null_step = 0u64;
    match kv.dtype {
        KvDtype::Int8 => {
            let f = gpu.function("attn_kv_append_i8")?;
            let warps = rows * kv.kv_heads * 2;
            let blocks = u32::try_from(warps.div_ceil(4)).map_err(|e| launch_err("kv_append grid", e))?;
            let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 };
            let (kvh, hd) = (kv.kv_heads as i32, kv.head_dim as i32);
            let mut b = gpu.stream().launch_builder(&f);
            b.arg(k).arg(v).arg(&mut kv.k).arg(&mut kv.v).arg(&mut kv.k_scale).arg(&mut kv.v_scale);
            b.arg(&sp).arg(&n).arg(&kvh).arg(&hd);
            match step {
                Some(s) => b.arg(s),
                None => b.arg(&null_step),
            };
            // SAFETY: attn_kv_append_i8(const float* k, const float* v, i8* kc, i8* vc, float* ks, float* vs,
            // int start_pos, int rows, int kv_heads, int head_dim, const int* step): one warp per (row, kv head,
            // K|V) reads rows * kv_dim floats of k/v (checked by the callers) and writes positions
            // start_pos..start_pos+rows (<= capacity: checked by kv_append; kv_append_at's caller keeps the device
            // start_pos in range) of the [capacity, kv_heads, head_dim] caches and [capacity, kv_heads] scales;
            // step is null or the 2 ints of a StepPos.
            unsafe { b.launch(cfg) }?;
        }
        KvDtype::Bf16 => {
            let f = gpu.function("attn_kv_append_bf16")?;
            let cfg = gpu.grid_stride_config(rows * kv_dim);
            let kvd = kv_dim as i32;
            let mut b = gpu.stream().launch_builder(&f);
            b.arg(k).arg(v).arg(&mut kv.k).arg(&mut kv.v).arg(&sp).arg(&n).arg(&kvd);
            match step {
                Some(s) => b.arg(s),
                None => b.arg(&null_step),
            };
            // SAFETY: attn_kv_append_bf16(const float* k, const float* v, bf16* kc, bf16* vc, int start_pos,
            // int rows, int kv_dim, const int* step) reads rows * kv_dim floats (checked) and writes bf16 elements
            // start_pos*kv_dim .. (start_pos+rows)*kv_dim of caches holding capacity*kv_dim (checked, or kept in
            // range by kv_append_at's caller); step is null or the 2 ints of a StepPos.
            unsafe { b.launch(cfg) }?;
        }
    }
    Ok(())
}

/// What `qkv_prepare` needs besides its buffers: the query heads, whether the projection carries an output gate
/// per query head (Qwen3-Next), the per-head q and k RMSNorm weights (`[head_dim]` each), their epsilon and the
/// RoPE table (partial rotary: `rope.rotary_dim <= head_dim`, the dims past it pass through).
pub struct QkvPrep<'a> {
    pub heads: usize,
    pub gated: bool,
    pub q_norm: &'a CudaSlice<f32>,
    pub k_norm: &'a CudaSlice<f32>,
    pub eps: f32,
    pub rope: &'a crate::backend::cuda::dense::RopeTable,
}

/// The attention block's preparation of `rows` rows in one launch, from one projection `qkv [rows, W]` whose row
/// is `[q' | k | v]`, `W = q'dim + 2 * kv_heads * head_dim`, `q'` = q `[heads * head_dim]` or (gated) per head
/// `[q_h | gate_h]` (`[heads][2 * head_dim]`): `qn [rows, heads, head_dim] = rope(rmsnorm(q))`, `gate
/// [rows, heads * head_dim]` (gated only, else None), and K = rope(rmsnorm(k)) and V appended to `kv` at positions
/// `start_pos..start_pos + rows` (int8-quantized or bf16-rounded exactly as `kv_append`). The same bits as
/// `dense::split_q_gate` + `dense::rmsnorm_rope` (q, then k) + `kv_append`. head_dim and kv_heads come from `kv`;
/// buffers may be longer than needed.
#[allow(clippy::too_many_arguments)]
pub fn qkv_prepare(
    gpu: &Gpu,
    p: &QkvPrep,
    qkv: &CudaSlice<f32>,
    rows: usize,
    kv: &mut DeviceKv,
    start_pos: usize,
    qn: &mut CudaSlice<f32>,
    gate: Option<&mut CudaSlice<f32>>,
) -> Result<()> {
    check_qkv_prep("qkv_prepare", p, qkv, rows, kv, qn, gate.as_deref())?;
    if start_pos.checked_add(rows).is_none_or(|end| end > kv.capacity) {
        return Err(Error::InvalidArgument(format!(
            "qkv_prepare: positions {start_pos}..{start_pos}+{rows} past the capacity {}",
            kv.capacity
        )));
    }
    qkv_prep_launch(gpu, p, qkv, rows, kv, start_pos as u64, None, qn, gate)
}

/// `qkv_prepare` with start_pos read from `pos.buf[0]` on the device (a captured decode step): positions
/// `start_pos..start_pos + rows` must lie within the capacity (the caller's duty). No allocation, synchronization
/// or host copy.
#[allow(clippy::too_many_arguments)]
pub fn qkv_prepare_at(
    gpu: &Gpu,
    p: &QkvPrep,
    qkv: &CudaSlice<f32>,
    rows: usize,
    kv: &mut DeviceKv,
    pos: &StepPos,
    qn: &mut CudaSlice<f32>,
    gate: Option<&mut CudaSlice<f32>>,
) -> Result<()> {
    check_qkv_prep("qkv_prepare_at", p, qkv, rows, kv, qn, gate.as_deref())?;
    if rows > kv.capacity || pos.buf.is_empty() {
        return Err(Error::InvalidArgument(format!(
            "qkv_prepare_at: {rows} rows, capacity {}, a step buffer of {} ints",
            kv.capacity,
            pos.buf.len()
        )));
    }
    qkv_prep_launch(gpu, p, qkv, rows, kv, 0, Some(&pos.buf), qn, gate)
}

/// The shape and length checks of `qkv_prepare` (everything but the positions).
fn check_qkv_prep(
    what: &str,
    p: &QkvPrep,
    qkv: &CudaSlice<f32>,
    rows: usize,
    kv: &DeviceKv,
    qn: &CudaSlice<f32>,
    gate: Option<&CudaSlice<f32>>,
) -> Result<()> {
    let (hd, kv_dim) = (kv.head_dim, kv.kv_dim());
    let q_dim = p.heads * hd;
    let width = if p.gated { 2 * q_dim } else { q_dim } + 2 * kv_dim;
    let rot = p.rope.rotary_dim;
    let bad = if p.heads == 0 || p.heads > i32::MAX as usize / 2 {
        Some(format!("{} query heads", p.heads))
    } else if p.q_norm.len() != hd || p.k_norm.len() != hd {
        Some(format!("q/k norm weights of {}/{} values, head_dim {hd}", p.q_norm.len(), p.k_norm.len()))
    } else if rot % 2 != 0 || rot > hd || p.rope.inv_freq.len() < rot / 2 {
        Some(format!("rotary_dim {rot} ({} frequencies) with head_dim {hd}", p.rope.inv_freq.len()))
    } else if qkv.len() < rows * width {
        Some(format!("qkv holds {} values, {rows} rows of {width} need {}", qkv.len(), rows * width))
    } else if qn.len() < rows * q_dim {
        Some(format!("qn holds {} values, {rows} rows need {}", qn.len(), rows * q_dim))
    } else if p.gated != gate.is_some() {
        Some(format!("gated {} with{} a gate buffer", p.gated, if gate.is_some() { "" } else { "out" }))
    } else if gate.is_some_and(|g| g.len() < rows * q_dim) {
        Some(format!("the gate holds {} values, {rows} rows need {}", gate.map_or(0, |g| g.len()), rows * q_dim))
    } else if rows.checked_mul(p.heads + kv.kv_heads).is_none_or(|w| w > i32::MAX as usize) {
        Some(format!("{rows} rows is too many for one launch"))
    } else {
        None
    };
    match bad {
        Some(msg) => Err(Error::InvalidArgument(format!("{what}: {msg}"))),
        None => Ok(()),
    }
}

/// attn_qkv_prep_{i8,bf16}; `step`: None (start_pos `start64`) or the StepPos buffer.
#[allow(clippy::too_many_arguments)]
fn qkv_prep_launch(
    gpu: &Gpu,
    p: &QkvPrep,
    qkv: &CudaSlice<f32>,
    rows: usize,
    kv: &mut DeviceKv,
    start64: u64,
    step: Option<&CudaSlice<i32>>,
    qn: &mut CudaSlice<f32>,
    gate: Option<&mut CudaSlice<f32>>,
) -> Result<()> {
    if rows == 0 {
        return Ok(());
    }
    let warps = rows * (p.heads + kv.kv_heads);
    let blocks = u32::try_from(warps.div_ceil(PREP_WARPS)).map_err(|e| launch_err("qkv_prepare grid", e))?;
    let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (PREP_WARPS as u32 * 32, 1, 1), shared_mem_bytes: 0 };
    let f = gpu.function(&format!("attn_qkv_prep_{}", kv.dtype.kernel_tag()))?;
    let (half, nr, h, kvh, hd, gated) = (
        (p.rope.rotary_dim / 2) as i32,
        rows as i32,
        p.heads as i32,
        kv.kv_heads as i32,
        kv.head_dim as i32,
        p.gated as i32,
    );
    let mut a = KernelArgs::new();
    a.buf(gpu, qkv).buf(gpu, p.q_norm).buf(gpu, p.k_norm).val(p.eps).buf(gpu, &p.rope.inv_freq).val(half);
    a.val(p.rope.attention_factor).buf_mut(gpu, qn);
    match gate {
        Some(g) => a.buf_mut(gpu, g),
        None => a.null(),
    };
    a.buf_mut(gpu, &mut kv.k).buf_mut(gpu, &mut kv.v).buf_mut(gpu, &mut kv.k_scale).buf_mut(gpu, &mut kv.v_scale);
    a.val(nr).val(h).val(kvh).val(hd).val(gated).val(start64);
    match step {
        Some(s) => a.buf(gpu, s),
        None => a.null(),
    };
    // Triggers the attention after it only after its own wait when that one (the one-row kernel) reads keys before
    // its wait.
    a.val((nr == 1 && gpu.prewait(PREWAIT_ATTN)) as i32);
    // SAFETY: attn_qkv_prep_{i8,bf16}(const float* qkv, const float* q_norm, const float* k_norm, float eps,
    // const float* inv_freq, int half, float attention_factor, float* qn, float* gate, KV* kc, KV* vc, float* ks,
    // float* vs, int rows, int heads, int kv_heads, int head_dim, int gated, u64 start_pos, const int* step,
    // int late_trigger): one
    // warp per (row, head) reads rows*W floats of qkv, head_dim of each norm, half (<= head_dim / 2) frequencies,
    // and writes rows*heads*head_dim of qn and (gated, else null and untouched) gate (all checked by
    // check_qkv_prep), and positions start_pos..start_pos+rows (<= capacity: checked by qkv_prepare, kept by
    // qkv_prepare_at's caller) of the [capacity, kv_heads, head_dim] caches and (int8) [capacity, kv_heads] scales;
    // head_dim <= 256 (DeviceKv) fits the kernel's per-warp row; step null or a StepPos's ints. The kernel waits
    // for its predecessor (strata_pdl_wait) before touching memory.
    unsafe { gpu.launch(&f, cfg, &mut a) }?;
    Ok(())
}

/// Warps per block of attn_qkv_prep_* (ATTN_PREP_WARPS).
const PREP_WARPS: usize = 8;

/// The cache's positions `0..len` dequantized to f32 `[len, kv_heads * head_dim]`
/// (K, V): for checkpoints and tests. Synchronizes the stream.
pub fn kv_read_f32(gpu: &Gpu, kv: &DeviceKv, len: usize) -> Result<(Vec<f32>, Vec<f32>)> {
    if len > kv.capacity {
        return Err(Error::InvalidArgument(format!("kv_read_f32: {len} positions, capacity {}", kv.capacity)));
    }
    let kv_dim = kv.kv_dim();
    let n = len * kv_dim;
    if n == 0 {
        return Ok((Vec::new(), Vec::new()));
    }
    let stream = gpu.stream();
    let nbytes = n * kv.dtype.value_bytes();
    let kraw = stream.clone_dtoh(&kv.k.slice(0..nbytes))?;
    let vraw = stream.clone_dtoh(&kv.v.slice(0..nbytes))?;
    let out = match kv.dtype {
        KvDtype::Int8 => {
            let ks = stream.clone_dtoh(&kv.k_scale.slice(0..len * kv.kv_heads))?;
            let vs = stream.clone_dtoh(&kv.v_scale.slice(0..len * kv.kv_heads))?;
            gpu.sync()?;
            let hd = kv.head_dim;
            let deq = |raw: &[u8], scales: &[f32]| -> Vec<f32> {
                raw.iter().enumerate().map(|(i, &b)| (b as i8) as f32 * scales[i / hd]).collect()
            };
            (deq(&kraw, &ks), deq(&vraw, &vs))
        }
        KvDtype::Bf16 => {
            gpu.sync()?;
            let deq = |raw: &[u8]| -> Vec<f32> {
                raw.chunks_exact(2).map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32()).collect()
            };
            (deq(&kraw), deq(&vraw))
        }
    };
    Ok(out)
}

/// Threads of the SIMT attention kernel and its key tile (kernels/attention.cu).
const SIMT_THREADS: u32 = 256;
const SIMT_TK: usize = 32;
/// Threads and query vectors of a block of the tensor-core kernel.
const MMA_THREADS: u32 = 128;
const MMA_BQ: usize = 64;
/// Threads of a block of the tensor-core decode kernel (4 warps, each its own key tiles).
const DEC_THREADS: u32 = 128;
const DEC_WARPS: usize = 4;
/// Most query vectors per kv head the decode kernel takes (two n-blocks of 8).
pub const DEC_MAX_QUERIES: usize = 16;
/// Threads of a block of the one-row decode kernel (attn_row_*).
const ROW_THREADS: u32 = 256;
/// Splits merged per group by attn_row_* (the first level of its two-level merge, used past 16 splits).
const ROW_GROUP_SPLITS: usize = 8;
/// Most query heads one attn_row_* block takes: a GQA group of more is cut into parts (grid z) of at most this
/// many, each part's blocks reading the same K/V (the second read hits L2) with half the accumulators.
const ROW_QB: usize = 4;
/// Blocks per SM attn_row_* fits (its launch bounds: at most 128 registers) and its split count aims for.
const ROW_BLOCKS_PER_SM: usize = 2;
/// At most this many splits attn_row_* merges in one level (its `one_level` argument; more: groups of
/// ROW_GROUP_SPLITS first).
const ROW_ONE_LEVEL: usize = 16;

/// Tests and benches (`test-hooks`): `STRATA_ROW_BLOCKS_PER_SM` and `STRATA_ROW_ONE_LEVEL` replace
/// ROW_BLOCKS_PER_SM and ROW_ONE_LEVEL, so a bench can compare the choices on one build.
#[cfg(any(test, feature = "test-hooks"))]
fn row_knob(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).filter(|&v: &usize| v > 0).unwrap_or(default)
}

fn row_blocks_per_sm() -> usize {
    #[cfg(any(test, feature = "test-hooks"))]
    {
        static V: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
        *V.get_or_init(|| row_knob("STRATA_ROW_BLOCKS_PER_SM", ROW_BLOCKS_PER_SM))
    }
    #[cfg(not(any(test, feature = "test-hooks")))]
    ROW_BLOCKS_PER_SM
}

/// Blocks of a thread-block cluster of the one-row decode kernel where the device has clusters (sm_90 and
/// later): attn_rowc_*, whose splits merge in the cluster's distributed shared memory and then, with more than
/// one cluster, in one level through global memory. 1: attn_row_* on every device.
const ROW_CLUSTER: usize = 1;

fn row_cluster_default() -> usize {
    #[cfg(any(test, feature = "test-hooks"))]
    {
        static V: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
        *V.get_or_init(|| row_knob("STRATA_ROW_CLUSTER", ROW_CLUSTER))
    }
    #[cfg(not(any(test, feature = "test-hooks")))]
    ROW_CLUSTER
}

fn row_one_level() -> usize {
    #[cfg(any(test, feature = "test-hooks"))]
    {
        static V: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
        *V.get_or_init(|| row_knob("STRATA_ROW_ONE_LEVEL", ROW_ONE_LEVEL))
    }
    #[cfg(not(any(test, feature = "test-hooks")))]
    ROW_ONE_LEVEL
}
/// A chunk (keys per split) of attn_row_* is a multiple of this ...
const ROW_ALIGN: usize = 32;
/// ... and at least this many keys (below that the merge costs more than the split saves).
const ROW_MIN_CHUNK: usize = 64;
/// Most query heads per kv head the one-row decode kernel takes.
pub const ROW_MAX_GROUP: usize = 16;
/// Fewest key tiles one split covers (below that the combine costs more than the split saves).
const MIN_TILES_PER_SPLIT: usize = 4;
/// Blocks per SM the split count aims for.
const BLOCKS_PER_SM: usize = 4;

/// Dynamic shared memory of attn_simt_hd{HD}_*_q{MAXQ}: mirrors AttnSimtSmem in attention.cu.
fn simt_smem_bytes(head_dim: usize, maxq: usize) -> usize {
    let floats = maxq * head_dim + SIMT_TK * (head_dim + 4) + SIMT_TK * head_dim + maxq * (SIMT_TK + 1) + 2 * maxq;
    floats * 4
}

/// Key tile of attn_mma_hd{HD}_*: mirrors AttnMmaTile in attention.cu.
fn mma_tile(head_dim: usize) -> usize {
    if head_dim == 256 {
        32
    } else {
        64
    }
}

/// Dynamic shared memory of attn_mma_hd{HD}_*_{prec}: mirrors AttnMmaSmem in attention.cu.
fn mma_smem_bytes(head_dim: usize, split: bool) -> usize {
    let bk = mma_tile(head_dim);
    let q_part = MMA_BQ * (head_dim + 8) * 2;
    q_part * if split { 2 } else { 1 } + 2 * bk * (head_dim + 8) * 2 + 2 * bk * 4
}

/// Keys per warp tile of attn_dec_hd{HD}_*: mirrors AttnDecShape in attention.cu.
fn dec_tile(head_dim: usize) -> usize {
    if head_dim == 256 {
        16
    } else {
        32
    }
}

/// Dynamic shared memory of attn_dec_hd{HD}_*_n{NQB}: mirrors AttnDecShape in attention.cu.
fn dec_smem_bytes(head_dim: usize, nqb: usize) -> usize {
    let (nq, bkw) = (nqb * 8, dec_tile(head_dim));
    let q_part = nq * (head_dim + 8) * 2;
    let warp = 2 * bkw * (head_dim + 8) * 2 + 2 * nq * (bkw + 8) * 2 + 2 * bkw * 4;
    let merge = DEC_WARPS * nq * (head_dim + 2) * 4;
    2 * q_part + (DEC_WARPS * warp).max(merge)
}

/// Dynamic shared memory of attn_row_hd{HD}_{tag}_g{gb}: mirrors AttnRowShape in attention.cu.
fn row_smem_bytes(head_dim: usize, dtype: KvDtype, gb: usize) -> usize {
    let nt = ROW_THREADS as usize;
    let vb = dtype.value_bytes();
    let tk = (16384 / (head_dim * vb)).min(nt);
    let dsq = nt / tk;
    let dpt = head_dim / dsq;
    let krs = dsq * (dpt * vb + 16);
    let dv = if head_dim >= 128 { 4 } else { 2 };
    let ksub = nt / (head_dim / dv);
    let qgs = dsq * (dpt + 4);
    let tile = gb * qgs * 4 + tk * krs + tk * head_dim * vb + tk * gb * 4 + 2 * tk * 4;
    let red = ksub * gb * head_dim * 4;
    tile.max(red) + (2 * (nt / 32) * gb + 2 * gb + 4) * 4
}

/// Query parts (grid z) of attn_row_* for `group` query heads per kv head: at most ROW_QB heads each.
fn row_parts(group: usize) -> usize {
    group.div_ceil(ROW_QB).max(1)
}

/// Query heads per block of attn_row_* (the kernel's `ceil(group / parts)`; the last part may take fewer, none
/// takes none) and the instance's GB (that, rounded up to a power of two: 1, 2 or 4).
fn row_heads_per_block(group: usize) -> (usize, usize) {
    let qpb = group.max(1).div_ceil(row_parts(group));
    (qpb, qpb.next_power_of_two())
}

/// The split count attn_row_* aims for: ROW_BLOCKS_PER_SM blocks per SM over (kv heads x query parts x splits)
/// (about one wave).
fn row_target_splits(kv_heads: usize, parts: usize, sm_count: usize) -> usize {
    (row_blocks_per_sm() * sm_count.max(1)).div_ceil(kv_heads.max(1) * parts.max(1)).max(1)
}

/// The split count attn_rowc_* aims for in clusters of `cluster` blocks over `kv_parts` (kv heads x query parts):
/// whole clusters, at most `plain` (row_target_splits) splits, and at most as many clusters as the device runs
/// at once (`resident`, the occupancy API's count at that shape), so that no cluster waits for another to end;
/// 0 where not one cluster a (kv head, part) fits.
fn row_cluster_splits(plain: usize, cluster: usize, resident: usize, kv_parts: usize) -> usize {
    (plain / cluster.max(1)).min(resident / kv_parts.max(1)) * cluster
}

/// Keys per split of attn_row_* for keys `0..kend` with `target` splits at most: a multiple of ROW_ALIGN, at
/// least ROW_MIN_CHUNK.
fn row_chunk(kend: usize, target: usize) -> usize {
    kend.div_ceil(target.max(1)).next_multiple_of(ROW_ALIGN).max(ROW_MIN_CHUNK)
}

/// The split of keys `0..kend` for the one-row decode kernel (attn_row_*, attn_rowc_*) aiming for `target`
/// splits (row_target_splits, row_cluster_splits), each at least ROW_MIN_CHUNK keys; `splits = ceil(kend /
/// chunk)` (none empty; a launch in clusters rounds its grid up to whole clusters).
pub fn plan_row_splits(kend: usize, target: usize) -> SplitPlan {
    let chunk = row_chunk(kend, target);
    SplitPlan { splits: kend.max(1).div_ceil(chunk), chunk }
}

/// Partial rows (`[rows, heads, head_dim]` in part_acc, `[rows, heads, 2]` in part_ml) of an attn_row_* launch
/// over a grid of `grid_splits` splits: one per split and one per merge group (none for one split).
fn row_partial_rows(grid_splits: usize) -> usize {
    if grid_splits <= 1 {
        0
    } else {
        grid_splits + grid_splits.div_ceil(ROW_GROUP_SPLITS)
    }
}

/// Arrival counters of an attn_row_* launch: per (kv head, query part), one for the groups and one per group.
fn row_counters(kv_heads: usize, parts: usize, grid_splits: usize) -> usize {
    kv_heads * parts * (1 + grid_splits.div_ceil(ROW_GROUP_SPLITS))
}

/// The SIMT kernel for `nq_total` query vectors per kv head: the largest
/// query tile that is needed and fits `smem_max` (kernels exist for 8, 32,
/// 64 query vectors; 8 and 32 for head_dim 256).
fn simt_choice(head_dim: usize, nq_total: usize, smem_max: usize) -> (AttnKernel, usize, u32, usize, usize, usize) {
    let largest = if head_dim == 256 { 32 } else { 64 };
    let maxq = [64, 32, 8]
        .into_iter()
        .filter(|&m| m <= largest && (m == 8 || nq_total > if m == 64 { 32 } else { 8 }))
        .find(|&m| simt_smem_bytes(head_dim, m) <= smem_max)
        .unwrap_or(8);
    (AttnKernel::Simt, maxq, SIMT_THREADS, maxq, SIMT_TK, simt_smem_bytes(head_dim, maxq))
}

fn set_smem(f: &CudaFunction, bytes: usize) -> Result<()> {
    f.set_attribute(CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes as i32)?;
    Ok(())
}

/// How a launch splits the key range: `splits` splits of `chunk` keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SplitPlan {
    pub splits: usize,
    pub chunk: usize,
}

/// Splits of the key range `0..kend` so that `base_blocks` blocks (kv heads x
/// query tiles) times the splits fill the device: flash-decoding for few rows.
pub fn plan_splits(kend: usize, base_blocks: usize, sm_count: usize, tile: usize) -> SplitPlan {
    let tiles = kend.div_ceil(tile).max(1);
    let target = BLOCKS_PER_SM * sm_count.max(1);
    let want = target.div_ceil(base_blocks.max(1));
    let most = tiles.div_ceil(MIN_TILES_PER_SPLIT);
    let splits = want.clamp(1, most.max(1));
    let chunk_tiles = tiles.div_ceil(splits);
    let splits = tiles.div_ceil(chunk_tiles);
    SplitPlan { splits, chunk: chunk_tiles * tile }
}

/// Which attention kernel runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum AttnKernel {
    /// One row (batch-1 decode) with at most ROW_MAX_GROUP query heads per kv
    /// head: the one-row decode kernel (`Row`) on every device, unless its
    /// shared memory exceeds the device's. Otherwise, on compute capability
    /// 8.0 and later: the tensor-core decode kernel for up to
    /// DEC_MAX_QUERIES query vectors per kv head (rows x heads per kv head),
    /// the tensor-core prefill kernel above that; SIMT before 8.0 and for
    /// head_dim 16 and 32 (the tensor-core kernels take 64, 128, 256).
    #[default]
    Auto,
    /// The one-row decode kernel (rows == 1 only, at most ROW_MAX_GROUP query
    /// heads per kv head, any device): flash-decoding in f32 on CUDA cores,
    /// up to 4 query heads of a kv head per block (a larger group in parts), the split merge fused in.
    Row,
    /// The f32 CUDA-core kernel (any device).
    Simt,
    /// The tensor-core prefill kernel, 64 query vectors per block (compute capability 8.0 and later,
    /// head_dim 64, 128 or 256).
    Mma,
    /// The tensor-core decode kernel (compute capability 8.0 and later, head_dim 64, 128 or 256, at
    /// most DEC_MAX_QUERIES query vectors per kv head).
    Decode,
}

/// Operand precision of the tensor-core prefill kernel (the SIMT and decode kernels are f32-level).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum AttnPrecision {
    /// Q and P as bf16 hi + lo pairs (two mma each): matches f32 to ~1e-5.
    #[default]
    F32,
    /// Q and P as single bf16 (twice the tensor rate, ~3 significant digits).
    Bf16,
}

/// Kernel choice and precision of `attention_with`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct AttnConfig {
    pub kernel: AttnKernel,
    pub precision: AttnPrecision,
    /// The one-row decode kernel's thread-block clusters: 0 the default (ROW_CLUSTER), 1 none (attn_row_*), n
    /// clusters of n blocks (attn_rowc_*, at most 16) where the device runs them at that shape, else none.
    pub row_cluster: usize,
}

/// Reusable split-partial buffers of `attention_with_scratch` (flash-decoding
/// partials: `[splits, rows * heads, head_dim]` accumulators and
/// `[splits, rows * heads, 2]` (max, sum)). They grow when a launch needs
/// more and are never shrunk, so once sized, a call allocates nothing. Use a
/// scratch on the stream of the `Gpu` it was made on (launches on one stream
/// are ordered, so one scratch serves every layer in turn).
///
/// It also holds the arrival counters of the one-row decode kernel's fused
/// merge (u32, zeroed at creation; every launch leaves them at zero), so a
/// scratch must not serve two launches that run at the same time.
pub struct AttnScratch {
    part_acc: CudaSlice<f32>,
    part_ml: CudaSlice<f32>,
    counters: CudaSlice<u32>,
}

impl AttnScratch {
    /// A scratch sized for any launch of up to `max_rows` rows of `shape` on
    /// this device, whatever the context length (the split count is at most
    /// BLOCKS_PER_SM * sm_count / kv_heads, rounded up). `max_rows` 1 (decode)
    /// costs about `4 * sm_count / kv_heads * heads * head_dim * 4` bytes;
    /// 0 makes an empty one that grows on first use.
    pub fn new(gpu: &Gpu, shape: AttentionShape, max_rows: usize) -> Result<AttnScratch> {
        let sms = (gpu.sm_count() as usize).max(1);
        let mut most_splits = (BLOCKS_PER_SM * sms).div_ceil(shape.kv_heads.max(1));
        let parts = row_parts(shape.heads / shape.kv_heads.max(1));
        // (clusters take at most as many splits)
        let row_splits = row_target_splits(shape.kv_heads, parts, sms);
        if max_rows >= 1 {
            // The one-row kernel's split and group partials.
            most_splits = most_splits.max(row_partial_rows(row_splits));
        }
        let n_queries = max_rows * shape.heads;
        let (acc, ml) = (most_splits * n_queries * shape.head_dim, most_splits * n_queries * 2);
        Ok(AttnScratch {
            part_acc: Self::alloc(gpu, acc.max(1))?,
            part_ml: Self::alloc(gpu, ml.max(2))?,
            counters: gpu.alloc_zeros::<u32>(row_counters(shape.kv_heads, parts, row_splits).max(1))?,
        })
    }

    fn alloc(gpu: &Gpu, n: usize) -> Result<CudaSlice<f32>> {
        // SAFETY: uninitialized device memory; a split kernel writes every
        // partial the combine then reads (all n_queries rows of every split).
        Ok(unsafe { gpu.stream().alloc::<f32>(n) }?)
    }

    /// Grows the buffers to at least `acc` / `ml` floats and `counters` counters (new counters are zero).
    fn reserve(&mut self, gpu: &Gpu, acc: usize, ml: usize, counters: usize) -> Result<()> {
        if self.part_acc.len() < acc {
            self.part_acc = Self::alloc(gpu, acc)?;
        }
        if self.part_ml.len() < ml {
            self.part_ml = Self::alloc(gpu, ml)?;
        }
        if self.counters.len() < counters {
            self.counters = gpu.alloc_zeros::<u32>(counters)?;
        }
        Ok(())
    }

    /// Whether the buffers hold what an attn_row_* launch over `grid_splits` splits and `parts` query parts needs.
    fn fits_row(&self, shape: AttentionShape, parts: usize, grid_splits: usize) -> bool {
        let rows = row_partial_rows(grid_splits) * shape.heads;
        grid_splits <= 1
            || (self.part_acc.len() >= rows * shape.head_dim
                && self.part_ml.len() >= rows * 2
                && self.counters.len() >= row_counters(shape.kv_heads, parts, grid_splits))
    }

    /// Device bytes held.
    pub fn bytes(&self) -> usize {
        4 * (self.part_acc.len() + self.part_ml.len() + self.counters.len())
    }
}

/// Causal grouped-query attention of `rows` query rows (`q`: f32
/// `[rows, heads * head_dim]`, row t at position `start_pos + t`) over the
/// cache, whose positions `0..start_pos + rows` must already hold the keys
/// and values (kv_append first). Writes `out[0..rows * heads * head_dim]`.
/// Same result as `cpu::ops::attention` on the dequantized cache.
pub fn attention(
    gpu: &Gpu,
    q: &CudaSlice<f32>,
    kv: &DeviceKv,
    shape: AttentionShape,
    start_pos: usize,
    rows: usize,
    out: &mut CudaSlice<f32>,
) -> Result<()> {
    attention_with(gpu, q, kv, shape, start_pos, rows, out, AttnConfig::default())
}

/// `attention` with an explicit kernel and precision (tests, benchmarks).
#[allow(clippy::too_many_arguments)]
pub fn attention_with(
    gpu: &Gpu,
    q: &CudaSlice<f32>,
    kv: &DeviceKv,
    shape: AttentionShape,
    start_pos: usize,
    rows: usize,
    out: &mut CudaSlice<f32>,
    config: AttnConfig,
) -> Result<()> {
    let mut scratch = AttnScratch::new(gpu, shape, 0)?;
    attention_with_scratch(gpu, q, kv, shape, start_pos, rows, out, config, &mut scratch)
}

/// `attention_with` taking its split partials from `scratch` (grown if this
/// launch needs more): with a scratch from `AttnScratch::new(gpu, shape, 1)`,
/// a decode step (one row) allocates nothing.
#[allow(clippy::too_many_arguments)]
pub fn attention_with_scratch(
    gpu: &Gpu,
    q: &CudaSlice<f32>,
    kv: &DeviceKv,
    shape: AttentionShape,
    start_pos: usize,
    rows: usize,
    out: &mut CudaSlice<f32>,
    config: AttnConfig,
    scratch: &mut AttnScratch,
) -> Result<()> {
    let AttentionShape { heads, kv_heads, head_dim } = shape;
    if kv_heads != kv.kv_heads || head_dim != kv.head_dim || kv_heads == 0 || heads == 0 || heads % kv_heads != 0 {
        return Err(Error::InvalidArgument(format!(
            "attention: shape {shape:?} against a cache of {} kv heads of {}",
            kv.kv_heads, kv.head_dim
        )));
    }
    if rows == 0 {
        return Ok(());
    }
    let n = rows * heads * head_dim;
    if q.len() < n || out.len() < n {
        return Err(Error::InvalidArgument(format!(
            "attention: q/out hold {}/{} values, {rows} rows need {n}",
            q.len(),
            out.len()
        )));
    }
    let kend = start_pos + rows;
    if kend > kv.capacity {
        return Err(Error::InvalidArgument(format!(
            "attention: positions up to {kend} past the cache capacity {}",
            kv.capacity
        )));
    }
    let choice = choose_kernel(gpu, shape, rows, kv.dtype, config)?;
    let sp = i32_arg("start_pos", start_pos)?;
    let f = gpu.function(&choice.name(head_dim, kv.dtype))?;
    set_smem(&f, choice.smem)?;
    if choice.kernel == AttnKernel::Row {
        let plan = plan_row_splits(kend, choice.splits);
        let grid = plan.splits.next_multiple_of(choice.cluster);
        let prow = row_partial_rows(grid) * heads;
        scratch.reserve(gpu, prow * head_dim, prow * 2, row_counters(kv_heads, choice.qtiles, grid))?;
        return launch_row(gpu, &f, q, kv, shape, out, &choice, plan, sp, None, scratch);
    }
    let plan = plan_splits(kend, kv_heads * choice.qtiles, gpu.sm_count() as usize, choice.tile);
    // Partials only when the key range is split (else the kernel never touches them).
    if plan.splits > 1 {
        let n_queries = rows * heads;
        scratch.reserve(gpu, plan.splits * n_queries * head_dim, plan.splits * n_queries * 2, 0)?;
    }
    launch_attention(gpu, &f, q, kv, shape, rows, out, &choice, plan, sp, None, scratch)
}

/// A resolved kernel of one launch shape (everything but the split of the key range).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct KernelChoice {
    /// Simt, Mma, Decode or Row (never Auto).
    kernel: AttnKernel,
    /// Simt: query vectors per block (8, 32, 64); Decode: n-blocks of 8 (1, 2); Mma: 1 = f32 (hi/lo), 0 = bf16;
    /// Row: the instance's query heads per block (1, 2, 4).
    variant: usize,
    threads: u32,
    /// Query tiles (grid z; Row: the query parts of a GQA group).
    qtiles: usize,
    /// Key tile a split is a multiple of.
    tile: usize,
    /// Dynamic shared memory bytes.
    smem: usize,
    /// Row: blocks of a thread-block cluster (attn_rowc_*), 1 none (attn_row_*); 1 for every other kernel.
    cluster: usize,
    /// Row: the split target (a step plan's grid, the most splits a launch takes); 0 for every other kernel.
    splits: usize,
}

impl KernelChoice {
    fn name(&self, head_dim: usize, dtype: KvDtype) -> String {
        let tag = dtype.kernel_tag();
        match self.kernel {
            AttnKernel::Mma => {
                format!("attn_mma_hd{head_dim}_{tag}_{}", if self.variant == 1 { "f32" } else { "bf16" })
            }
            AttnKernel::Decode => format!("attn_dec_hd{head_dim}_{tag}_n{}", self.variant),
            AttnKernel::Row if self.cluster > 1 => format!("attn_rowc_hd{head_dim}_{tag}_g{}", self.variant),
            AttnKernel::Row => format!("attn_row_hd{head_dim}_{tag}_g{}", self.variant),
            _ => format!("attn_simt_hd{head_dim}_{tag}_q{}", self.variant),
        }
    }
}

/// The kernel `config` gives for `rows` query rows of `shape` over a cache of `dtype` on this device (checks the
/// shape against the device: tensor cores, head_dim, shared memory, grid).
fn choose_kernel(
    gpu: &Gpu,
    shape: AttentionShape,
    rows: usize,
    dtype: KvDtype,
    config: AttnConfig,
) -> Result<KernelChoice> {
    let AttentionShape { heads, kv_heads, head_dim } = shape;
    let group = heads / kv_heads;
    let nq_total = rows * group;
    let has_mma = gpu.compute_capability().0 >= 8;
    let tc_head_dim = TC_HEAD_DIMS.contains(&head_dim);
    // Shared memory a block may opt into (227 KB on sm_90, 99 KB on sm_86/89, 64 KB on sm_75).
    let smem_max =
        gpu.context().attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)? as usize;
    let (row_qpb, row_gb) = row_heads_per_block(group);
    let row_ok = rows == 1 && group <= ROW_MAX_GROUP;
    let kernel = match config.kernel {
        AttnKernel::Auto if row_ok && row_smem_bytes(head_dim, dtype, row_gb) <= smem_max => AttnKernel::Row,
        AttnKernel::Row if !row_ok => {
            return Err(Error::InvalidArgument(format!(
                "attention: the one-row decode kernel takes 1 row of at most {ROW_MAX_GROUP} query heads per kv \
                 head, not {rows} rows of {group}"
            )))
        }
        AttnKernel::Auto if !has_mma || !tc_head_dim => AttnKernel::Simt,
        AttnKernel::Auto if nq_total <= DEC_MAX_QUERIES => AttnKernel::Decode,
        AttnKernel::Auto => AttnKernel::Mma,
        AttnKernel::Mma | AttnKernel::Decode if !has_mma => {
            return Err(Error::InvalidArgument("attention: the tensor-core kernels need compute capability 8.0".into()))
        }
        AttnKernel::Mma | AttnKernel::Decode if !tc_head_dim => {
            return Err(Error::InvalidArgument(format!(
                "attention: the tensor-core kernels take head_dim 64, 128 or 256, not {head_dim}"
            )))
        }
        AttnKernel::Decode if nq_total > DEC_MAX_QUERIES => {
            return Err(Error::InvalidArgument(format!(
                "attention: the decode kernel takes at most {DEC_MAX_QUERIES} query vectors per kv head, not {nq_total}"
            )))
        }
        k => k,
    };
    // (kernel, variant, block threads, query vectors per block, key tile of a split, shared memory bytes)
    let mut choice = match kernel {
        AttnKernel::Row => {
            (AttnKernel::Row, row_gb, ROW_THREADS, row_qpb, ROW_ALIGN, row_smem_bytes(head_dim, dtype, row_gb))
        }
        AttnKernel::Mma => {
            let split = config.precision == AttnPrecision::F32;
            (AttnKernel::Mma, split as usize, MMA_THREADS, MMA_BQ, mma_tile(head_dim), mma_smem_bytes(head_dim, split))
        }
        AttnKernel::Decode => {
            let nqb = nq_total.div_ceil(8);
            // A split is whole rounds of the 4 warps' tiles.
            let tile = DEC_WARPS * dec_tile(head_dim);
            (AttnKernel::Decode, nqb, DEC_THREADS, DEC_MAX_QUERIES, tile, dec_smem_bytes(head_dim, nqb))
        }
        _ => simt_choice(head_dim, nq_total, smem_max),
    };
    if choice.5 > smem_max && config.kernel == AttnKernel::Auto {
        choice = simt_choice(head_dim, nq_total, smem_max);
    }
    let (kernel, variant, threads, bq, tile, smem) = choice;
    let qtiles = nq_total.div_ceil(bq);
    let mut choice = KernelChoice { kernel, variant, threads, qtiles, tile, smem, cluster: 1, splits: 0 };
    if smem > smem_max {
        return Err(Error::InvalidArgument(format!(
            "attention: {} needs {smem} bytes of shared memory, the device allows {smem_max}",
            choice.name(head_dim, dtype)
        )));
    }
    if qtiles > 65535 {
        return Err(Error::InvalidArgument(format!("attention: {rows} rows is too many for one launch")));
    }
    if kernel == AttnKernel::Row {
        let plain = row_target_splits(kv_heads, qtiles, (gpu.sm_count() as usize).max(1));
        (choice.cluster, choice.splits) = row_cluster(gpu, shape, dtype, choice, config.row_cluster, plain)?;
    }
    Ok(choice)
}

/// The cluster size and split target of a one-row launch: `wanted` (0: the default) blocks a cluster, capped at
/// 16 and at the plain kernel's split target `plain`, and row_cluster_splits splits, where the device has
/// clusters and runs one a (kv head, part) at once; else (1, plain): the plain attn_row_*.
fn row_cluster(
    gpu: &Gpu,
    shape: AttentionShape,
    dtype: KvDtype,
    choice: KernelChoice,
    wanted: usize,
    plain: usize,
) -> Result<(usize, usize)> {
    let wanted = if wanted == 0 { row_cluster_default() } else { wanted };
    let kv_parts = shape.kv_heads * choice.qtiles;
    let cluster = wanted.min(16).min(plain);
    if cluster < 2 || gpu.compute_capability().0 < 9 {
        return Ok((1, plain));
    }
    let clustered = KernelChoice { cluster, ..choice };
    let name = clustered.name(shape.head_dim, dtype);
    // The occupancy API counts the clusters of this shape that run at once (a grid of whole clusters).
    let cfg = LaunchConfig {
        grid_dim: (cluster as u32, shape.kv_heads as u32, choice.qtiles as u32),
        block_dim: (choice.threads, 1, 1),
        shared_mem_bytes: choice.smem as u32,
    };
    set_smem(&gpu.function(&name)?, choice.smem)?;
    // A shape the driver refuses (0) runs without clusters.
    let resident = gpu.active_clusters(&name, cfg, cluster as u32);
    Ok(match row_cluster_splits(plain, cluster, resident, kv_parts) {
        0 => (1, plain),
        splits => (cluster, splits),
    })
}

/// The split kernel over `plan.splits` splits (grid fixed) and, when the grid has more than one split, the combine.
/// `step`: None (start_pos `sp`, chunk `plan.chunk`) or the StepPos buffer (both read on the device). The partials
/// must fit `scratch` (checked by the callers).
#[allow(clippy::too_many_arguments)]
fn launch_attention(
    gpu: &Gpu,
    f: &CudaFunction,
    q: &CudaSlice<f32>,
    kv: &DeviceKv,
    shape: AttentionShape,
    rows: usize,
    out: &mut CudaSlice<f32>,
    choice: &KernelChoice,
    plan: SplitPlan,
    sp: i32,
    step: Option<&CudaSlice<i32>>,
    scratch: &mut AttnScratch,
) -> Result<()> {
    let AttentionShape { heads, kv_heads, head_dim } = shape;
    let cfg = LaunchConfig {
        grid_dim: (plan.splits as u32, kv_heads as u32, choice.qtiles as u32),
        block_dim: (choice.threads, 1, 1),
        shared_mem_bytes: choice.smem as u32,
    };
    let scale = 1.0f32 / (head_dim as f32).sqrt();
    let (h, kvh, nr, chunk) = (
        i32_arg("heads", heads)?,
        i32_arg("kv_heads", kv_heads)?,
        i32_arg("rows", rows)?,
        i32_arg("chunk", plan.chunk)?,
    );
    let n_queries = rows * heads;
    let null_step = 0u64;
    let AttnScratch { part_acc, part_ml, .. } = scratch;
    {
        let mut b = gpu.stream().launch_builder(f);
        b.arg(q).arg(&kv.k).arg(&kv.v).arg(&kv.k_scale).arg(&kv.v_scale).arg(&mut *out);
        b.arg(&mut *part_acc).arg(&mut *part_ml).arg(&h).arg(&kvh).arg(&sp).arg(&nr).arg(&chunk).arg(&scale);
        match step {
            Some(s) => b.arg(s),
            None => b.arg(&null_step),
        };
        // SAFETY: attn_simt_* / attn_mma_* / attn_dec_* (q, kc, vc, ks, vs, out, part_acc, part_ml, heads, kv_heads,
        // start_pos, rows, chunk, scale, step): read q[0..rows*heads*HD] (checked), cache positions
        // 0..start_pos+rows (<= capacity: checked by attention, kept by attention_at's caller) of kv heads <
        // kv_heads (= the cache's, checked) and write out[0..rows*heads*HD] (one split) or
        // part_acc[splits*rows*heads*HD] and part_ml[splits*rows*heads*2] (the scratch holds at least that,
        // reserved or checked by the callers); grid (splits, kv_heads, qtiles) with qtiles*bq >= rows*group
        // (attn_dec: qtiles = 1, rows*group <= 8*NQB) and splits*chunk >= start_pos+rows (step: StepPos::set's
        // chunk from step_chunk); dynamic shared memory as the kernel's AttnSimtSmem / AttnMmaSmem /
        // AttnDecShape; the mma and dec kernels only on compute capability >= 8.0; step null or a StepPos's 2 ints.
        unsafe { b.launch(cfg) }?;
    }
    if plan.splits > 1 {
        let f = gpu.function("attn_combine")?;
        let cfg = LaunchConfig {
            grid_dim: (n_queries as u32, 1, 1),
            block_dim: (head_dim.min(256) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let (s, nqi, hd) = (i32_arg("splits", plan.splits)?, i32_arg("queries", n_queries)?, head_dim as i32);
        let mut b = gpu.stream().launch_builder(&f);
        b.arg(&*part_acc).arg(&*part_ml).arg(&mut *out).arg(&s).arg(&nqi).arg(&hd).arg(&nr);
        match step {
            Some(st) => b.arg(st),
            None => b.arg(&null_step),
        };
        // SAFETY: attn_combine(part_acc, part_ml, out, splits, n_queries, head_dim, rows, step) reads the partials
        // the split kernel wrote and writes out[0..n_queries*head_dim] (checked by the callers).
        unsafe { b.launch(cfg) }?;
    }
    Ok(())
}

/// The one-row decode kernel over `plan.splits` splits (grid fixed), the split merge fused in. `step`: None
/// (start_pos `sp`, chunk `plan.chunk`, and then `plan.splits` must be `ceil((sp + 1) / chunk)`) or the StepPos
/// buffer (both read on the device). The partials and counters must fit `scratch` (checked by the callers).
#[allow(clippy::too_many_arguments)]
fn launch_row(
    gpu: &Gpu,
    f: &CudaFunction,
    q: &CudaSlice<f32>,
    kv: &DeviceKv,
    shape: AttentionShape,
    out: &mut CudaSlice<f32>,
    choice: &KernelChoice,
    plan: SplitPlan,
    sp: i32,
    step: Option<&CudaSlice<i32>>,
    scratch: &mut AttnScratch,
) -> Result<()> {
    let AttentionShape { heads, kv_heads, head_dim } = shape;
    // Whole clusters (the blocks past the key range take part in their cluster's merge).
    let splits = u32::try_from(plan.splits.next_multiple_of(choice.cluster)).ok().filter(|&s| s <= 65535);
    let kvh_grid = u32::try_from(kv_heads).ok().filter(|&k| k <= 65535);
    // The kernel gives part z the query heads [z * qpb, min((z + 1) * qpb, group)), qpb = ceil(group / parts):
    // qpb must fit its GB and no part be empty.
    let (group, parts) = (heads / kv_heads, choice.qtiles);
    let qpb = group.div_ceil(parts.max(1));
    let parts_ok = parts == row_parts(group) && qpb <= choice.variant && (parts - 1) * qpb < group;
    let (Some(splits), Some(kvh_grid), true) = (splits, kvh_grid, parts_ok) else {
        return Err(Error::InvalidArgument(format!(
            "attention: grid of {} splits x {kv_heads} kv heads x {parts} query parts of {qpb} (group {group}, \
             kernel g{})",
            plan.splits, choice.variant
        )));
    };
    let cfg = LaunchConfig {
        grid_dim: (splits, kvh_grid, parts as u32),
        block_dim: (choice.threads, 1, 1),
        shared_mem_bytes: choice.smem as u32,
    };
    let scale = 1.0f32 / (head_dim as f32).sqrt();
    let (h, kvh, chunk) = (i32_arg("heads", heads)?, i32_arg("kv_heads", kv_heads)?, i32_arg("chunk", plan.chunk)?);
    let AttnScratch { part_acc, part_ml, counters } = scratch;
    let mut a = KernelArgs::new();
    a.buf(gpu, q).buf(gpu, &kv.k).buf(gpu, &kv.v).buf(gpu, &kv.k_scale).buf(gpu, &kv.v_scale).buf_mut(gpu, out);
    a.buf_mut(gpu, part_acc).buf_mut(gpu, part_ml).buf_mut(gpu, counters);
    a.val(h).val(kvh).val(sp).val(chunk).val(scale);
    match step {
        Some(s) => a.buf(gpu, s),
        None => a.null(),
    };
    a.val(row_one_level() as i32).val(gpu.prewait(PREWAIT_ATTN) as i32);
    // SAFETY: attn_row_hd{HD}_{tag}_g{GB}(q, kc, vc, ks, vs, out, part_acc, part_ml, counters, heads, kv_heads,
    // start_pos, chunk, scale, step, one_level, prewait): reads q[0..heads*HD] (checked), cache positions 0..=start_pos (< capacity:
    // checked by attention, kept by attention_at's caller) of kv heads < kv_heads (= the cache's, checked), and
    // writes out[0..heads*HD]; with more than one split it writes and reads part_acc/part_ml rows
    // < splits + ceil(splits / 8) of heads*HD / heads*2 floats and counters[kv_heads * parts * (1 + ceil(splits /
    // 8))] (all held by the scratch: reserved or checked by the callers; the counters are zero between launches);
    // grid z = parts with ceil(group / parts) <= GB and no empty part (checked above); dynamic shared memory as
    // the kernel's AttnRowShape (row_smem_bytes,
    // attribute set by the callers); step null or a StepPos's 2 ints. The kernel waits for its predecessor
    // (strata_pdl_wait) before touching memory, except (prewait) the step ints (written by a copy before the step's
    // first kernel) and the cache's keys before start_pos. Those are written by an earlier forward (finished: a
    // forward ends by waiting for the device), by attn_kv_append_* (no trigger: finished before this one starts),
    // or by an attn_qkv_prep_* two or more kernels back; the kernel just before this one is attn_qkv_prep_* (which
    // then triggers only after its own wait, so every kernel before it has finished when this one starts) or, with
    // STRATA_DECODE_SKIP=prep, the q/k/v GEMV (the keys are then an earlier forward's).
    unsafe {
        if choice.cluster > 1 {
            gpu.launch_cluster(f, cfg, choice.cluster as u32, &mut a)
        } else {
            gpu.launch(f, cfg, &mut a)
        }
    }?;
    Ok(())
}

// ------------------------------------------------------------------------
// A captured decode step (CUDA-graph replay): the per-step values on the device.

/// Per-step values a captured decode step reads on the device: `[start_pos, chunk]` as i32.
pub struct StepPos {
    pub buf: CudaSlice<i32>,
}

impl StepPos {
    /// A zeroed one (start_pos 0, chunk 0: set it before the first launch that reads it).
    pub fn new(gpu: &Gpu) -> Result<StepPos> {
        Ok(StepPos { buf: gpu.alloc_zeros::<i32>(2)? })
    }

    /// Writes `start_pos` and `chunk` (from `step_chunk(plan, start_pos + rows)`): queued on the stream (ordered
    /// before the launches that follow on it); the host values are copied before return. `chunk` must be positive;
    /// both must fit in i32 (and start_pos + rows too).
    pub fn set(&mut self, gpu: &Gpu, start_pos: usize, chunk: usize) -> Result<()> {
        if chunk == 0 || start_pos >= i32::MAX as usize / 2 || chunk > i32::MAX as usize / 2 {
            return Err(Error::InvalidArgument(format!("StepPos::set: start_pos {start_pos}, chunk {chunk}")));
        }
        let vals = [start_pos as i32, chunk as i32];
        // Pageable host source: the driver stages it before returning (cuMemcpyHtoDAsync).
        gpu.stream().memcpy_htod(&vals, &mut self.buf)?;
        Ok(())
    }
}

/// The launch shape a captured decode attention keeps for every step: the kernel, the split count (fixed) and its
/// key tile.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepPlan {
    /// Splits of the grid (fixed): `(BLOCKS_PER_SM * sm_count).div_ceil(kv_heads * query tiles)`, the most
    /// `plan_splits` ever gives for this shape, so every key range splits exactly as the plain `attention` does
    /// (the one-row kernel: `(2 * sm_count).div_ceil(kv_heads * query parts)`, or in clusters row_cluster_splits:
    /// the most `plan_row_splits` gives).
    pub splits: usize,
    /// Key tile: a chunk is a multiple of it.
    pub tile: usize,
    choice: KernelChoice,
    shape: AttentionShape,
    rows: usize,
    dtype: KvDtype,
}

/// The plan for `rows` query rows (1 for decode) of `shape` over a cache of `kv_dtype` on this device: the kernel
/// `AttnKernel::Auto` picks for that many rows and a fixed split count (the most `plan_splits` gives for this shape:
/// `4 * sm_count / (kv_heads * query tiles)`, rounded up; for the one-row kernel, which Auto picks for one row,
/// the most `plan_row_splits` gives: `2 * sm_count / (kv_heads * query parts)` rounded up, the parts
/// `ceil(group / 4)`, or in thread-block clusters whole clusters of at most that many splits, no more clusters
/// than run at once; `AttnScratch::new(gpu, shape, rows)` holds
/// either). Also sets the kernel's shared-memory attribute (so `attention_at` makes no such call).
pub fn step_plan(gpu: &Gpu, shape: AttentionShape, rows: usize, kv_dtype: KvDtype) -> Result<StepPlan> {
    step_plan_with(gpu, shape, rows, kv_dtype, AttnConfig::default())
}

/// `step_plan` with the kernel `config` gives (tests, benchmarks; its precision applies to the tensor-core
/// prefill kernel, which a plan for one row never takes).
pub fn step_plan_with(
    gpu: &Gpu,
    shape: AttentionShape,
    rows: usize,
    kv_dtype: KvDtype,
    config: AttnConfig,
) -> Result<StepPlan> {
    let AttentionShape { heads, kv_heads, head_dim } = shape;
    if kv_heads == 0 || heads == 0 || heads % kv_heads != 0 || !HEAD_DIMS.contains(&head_dim) || rows == 0 {
        return Err(Error::InvalidArgument(format!("step_plan: shape {shape:?}, {rows} rows")));
    }
    let choice = choose_kernel(gpu, shape, rows, kv_dtype, config)?;
    let sms = (gpu.sm_count() as usize).max(1);
    let splits = if choice.kernel == AttnKernel::Row {
        choice.splits
    } else {
        (BLOCKS_PER_SM * sms).div_ceil(kv_heads * choice.qtiles).max(1)
    };
    if splits > 65535 {
        return Err(Error::InvalidArgument(format!("step_plan: {splits} splits")));
    }
    let f = gpu.function(&choice.name(head_dim, kv_dtype))?;
    set_smem(&f, choice.smem)?;
    gpu.function("attn_combine")?;
    Ok(StepPlan { splits, tile: choice.tile, choice, shape, rows, dtype: kv_dtype })
}

impl StepPlan {
    /// Blocks of a thread-block cluster of the plan's one-row kernel (1: none, and for every other kernel).
    pub fn row_cluster(&self) -> usize {
        self.choice.cluster
    }
}

/// The chunk (keys per split, a multiple of `plan.tile`) for keys `0..kend` (`kend = start_pos + rows`) with
/// `plan.splits` splits: exactly `plan_splits`'s chunk for that key range, so the ranges of the non-empty splits
/// are those of the plain `attention`; splits past the end are empty. `kend <= plan.splits * chunk`.
pub fn step_chunk(plan: &StepPlan, kend: usize) -> usize {
    if plan.choice.kernel == AttnKernel::Row {
        return row_chunk(kend, plan.splits);
    }
    let tiles = kend.div_ceil(plan.tile).max(1);
    let most = tiles.div_ceil(MIN_TILES_PER_SPLIT);
    let splits = plan.splits.clamp(1, most.max(1));
    tiles.div_ceil(splits) * plan.tile
}

/// `attention` with start_pos = `pos.buf[0]` and chunk = `pos.buf[1]` read on the device (`StepPos::set` with
/// `step_chunk(plan, start_pos + rows)` first), launched with `plan.splits` splits (grid fixed), then the combine
/// over `plan.splits` partials (a no-op on the device when split 0 holds every key; the one-row kernel merges
/// its splits itself, and its splits past the key range exit at once). Same bits as `attention`
/// at that start_pos. Positions `0..start_pos + rows` must lie within the cache (the caller's duty). Checks only
/// the shapes and buffer sizes: no allocation, synchronization or host copy (capturable).
#[allow(clippy::too_many_arguments)]
pub fn attention_at(
    gpu: &Gpu,
    q: &CudaSlice<f32>,
    kv: &DeviceKv,
    shape: AttentionShape,
    rows: usize,
    out: &mut CudaSlice<f32>,
    plan: &StepPlan,
    pos: &StepPos,
    scratch: &mut AttnScratch,
) -> Result<()> {
    let AttentionShape { heads, kv_heads, head_dim } = shape;
    let n = rows * heads * head_dim;
    let parts = plan.splits * rows * heads;
    let row = plan.choice.kernel == AttnKernel::Row;
    let scratch_ok = if row {
        scratch.fits_row(shape, plan.choice.qtiles, plan.splits)
    } else {
        plan.splits <= 1 || (scratch.part_acc.len() >= parts * head_dim && scratch.part_ml.len() >= parts * 2)
    };
    if shape != plan.shape
        || rows != plan.rows
        || kv.dtype != plan.dtype
        || kv_heads != kv.kv_heads
        || head_dim != kv.head_dim
        || q.len() < n
        || out.len() < n
        || pos.buf.len() < 2
        || !scratch_ok
    {
        return Err(Error::InvalidArgument(format!(
            "attention_at: shape {shape:?} x {rows} rows over a {:?} cache of {} kv heads of {}, plan {plan:?}, \
             q/out {}/{} values, scratch {}/{} floats",
            kv.dtype,
            kv.kv_heads,
            kv.head_dim,
            q.len(),
            out.len(),
            scratch.part_acc.len(),
            scratch.part_ml.len()
        )));
    }
    let f = gpu.function(&plan.choice.name(head_dim, kv.dtype))?;
    let split_plan = SplitPlan { splits: plan.splits, chunk: plan.tile };
    if row {
        return launch_row(gpu, &f, q, kv, shape, out, &plan.choice, split_plan, 0, Some(&pos.buf), scratch);
    }
    launch_attention(gpu, &f, q, kv, shape, rows, out, &plan.choice, split_plan, 0, Some(&pos.buf), scratch)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_cover_the_key_range() {
        for &(kend, base, sms) in &[(1, 4, 132), (33, 4, 132), (32768, 4, 132), (262144, 2, 132), (1500, 2048, 132)] {
            let p = plan_splits(kend, base, sms, SIMT_TK);
            assert!(p.splits >= 1 && p.chunk % SIMT_TK == 0);
            assert!(p.splits * p.chunk >= kend, "{kend} {p:?}");
            assert!((p.splits - 1) * p.chunk < kend, "empty last split: {kend} {p:?}");
        }
    }

    /// AttnScratch::new's bound: at most BLOCKS_PER_SM * sm_count / kv_heads
    /// (rounded up) splits, whatever the context length and query tiles.
    #[test]
    fn splits_bounded_for_scratch() {
        for sms in [1usize, 46, 132] {
            for kv_heads in [1usize, 2, 3, 4, 8] {
                let most = (BLOCKS_PER_SM * sms).div_ceil(kv_heads);
                for qtiles in [1usize, 2, 7] {
                    for kend in [1usize, 31, 32, 33, 1000, 4097, 40001, 262144] {
                        for tile in [SIMT_TK, 64, 128] {
                            let p = plan_splits(kend, kv_heads * qtiles, sms, tile);
                            assert!(p.splits <= most, "{kend} {kv_heads} {qtiles} {sms} {tile}: {p:?} > {most}");
                        }
                    }
                }
            }
        }
    }

    /// step_chunk with the fixed split count gives plan_splits's chunk (so the same split ranges as the plain
    /// launch), and its splits cover the keys within plan.splits.
    #[test]
    fn step_chunk_matches_plan_splits() {
        for sms in [1usize, 46, 132] {
            for kv_heads in [1usize, 2, 4, 8] {
                for tile in [SIMT_TK, 64, 128] {
                    let splits = (BLOCKS_PER_SM * sms).div_ceil(kv_heads);
                    let choice = KernelChoice {
                        kernel: AttnKernel::Simt,
                        variant: 8,
                        threads: SIMT_THREADS,
                        qtiles: 1,
                        tile,
                        smem: 0,
                        cluster: 1,
                        splits: 0,
                    };
                    let plan = StepPlan {
                        splits,
                        tile,
                        choice,
                        shape: AttentionShape { heads: kv_heads, kv_heads, head_dim: 64 },
                        rows: 1,
                        dtype: KvDtype::Int8,
                    };
                    for kend in (1usize..=700).chain([4095, 4096, 4097, 40000, 40001, 262144]) {
                        let p = plan_splits(kend, kv_heads, sms, tile);
                        let chunk = step_chunk(&plan, kend);
                        assert_eq!(chunk, p.chunk, "{sms} {kv_heads} {tile} {kend}");
                        assert!(p.splits <= splits && chunk % tile == 0 && chunk * splits >= kend);
                    }
                }
            }
        }
    }

    /// The one-row kernel's split plan covers the keys with no empty split, in chunks of whole ROW_ALIGN keys of
    /// at least ROW_MIN_CHUNK, never more splits than its StepPlan's fixed grid (which AttnScratch::new sizes), and
    /// step_chunk with that grid gives the same chunk as the plain launch's plan.
    #[test]
    fn row_splits_cover_the_key_range() {
        for sms in [1usize, 46, 132] {
            for (kv_heads, parts) in [(1usize, 1usize), (1, 4), (2, 2), (3, 1), (4, 2), (8, 1)] {
                let plain = row_target_splits(kv_heads, parts, sms);
                assert!(plain * kv_heads * parts < ROW_BLOCKS_PER_SM * sms + kv_heads * parts);
                row_splits_cover_the_key_range_in(kv_heads, parts, 1, plain, plain);
                // choose_kernel's clusters: at most the plain target, as many as run at once or fewer.
                for cluster in [3usize, 8, 16].into_iter().filter(|&c| c <= plain) {
                    for resident in [kv_heads * parts, 30, 1000] {
                        let target = row_cluster_splits(plain, cluster, resident, kv_heads * parts);
                        let what = format!("{sms} SMs, {kv_heads} x {parts}: {cluster} x {resident} resident");
                        assert!(target % cluster == 0 && target <= plain, "{what}: {target}");
                        assert!(target / cluster * kv_heads * parts <= resident, "{what}: {target}");
                        assert!(target >= cluster || resident < kv_heads * parts, "{what}: {target}");
                        if target > 0 {
                            row_splits_cover_the_key_range_in(kv_heads, parts, cluster, target, plain);
                        }
                    }
                }
            }
        }
    }

    fn row_splits_cover_the_key_range_in(kv_heads: usize, parts: usize, cluster: usize, target: usize, plain: usize) {
        let choice = KernelChoice {
            kernel: AttnKernel::Row,
            variant: 4,
            threads: ROW_THREADS,
            qtiles: parts,
            tile: ROW_ALIGN,
            smem: 0,
            cluster,
            splits: target,
        };
        let plan = StepPlan {
            splits: target,
            tile: ROW_ALIGN,
            choice,
            shape: AttentionShape { heads: 4 * parts * kv_heads, kv_heads, head_dim: 128 },
            rows: 1,
            dtype: KvDtype::Int8,
        };
        for kend in (1usize..=3000).chain([4128, 8195, 40001, 262144]) {
            let p = plan_row_splits(kend, target);
            let what = format!(
                "{kv_heads} kv heads x {parts} parts, {target} splits in clusters of {cluster}, {kend} keys: {p:?}"
            );
            assert!(p.chunk % ROW_ALIGN == 0 && p.chunk >= ROW_MIN_CHUNK, "{what}");
            assert!(p.splits * p.chunk >= kend && (p.splits - 1) * p.chunk < kend, "{what}");
            assert!(p.splits <= target, "{what}: more than {target} splits");
            assert_eq!(step_chunk(&plan, kend), p.chunk, "{what}");
            // The plain launch's grid (whole clusters) within what AttnScratch::new sizes.
            let grid = p.splits.next_multiple_of(cluster);
            assert!(grid <= target, "{what}: a grid of {grid}");
            assert!(row_partial_rows(grid) <= row_partial_rows(plain));
            assert!(row_counters(kv_heads, parts, grid) <= row_counters(kv_heads, parts, plain));
        }
    }

    /// Every one-row kernel fits the 64 KB of shared memory sm_75 allows (so Auto picks it on every device), and
    /// ROW_BLOCKS_PER_SM of them fit an SM of sm_80 and later (164 KB and more; 1 KB per block reserved).
    #[test]
    fn row_kernels_fit_every_device() {
        for hd in HEAD_DIMS {
            for dtype in [KvDtype::Int8, KvDtype::Bf16] {
                for gb in [1usize, 2, 4] {
                    let bytes = row_smem_bytes(hd, dtype, gb);
                    assert!(bytes <= 64 * 1024, "head_dim {hd} {dtype:?} group {gb}: {bytes} bytes");
                    assert!(ROW_BLOCKS_PER_SM * (bytes + 1024) <= 164 * 1024, "head_dim {hd} {dtype:?} group {gb}");
                }
            }
        }
    }

    /// The query parts of every group size 1..=ROW_MAX_GROUP: at most ROW_QB heads (and an instance of 1, 2 or 4)
    /// per block, none empty, the parts covering the group; the kernel's ceil(group / parts) is the same qpb.
    #[test]
    fn row_parts_cover_the_group() {
        for group in 1..=ROW_MAX_GROUP {
            let parts = row_parts(group);
            let (qpb, gb) = row_heads_per_block(group);
            assert!(qpb <= ROW_QB && qpb <= gb && [1, 2, 4].contains(&gb), "group {group}: {qpb} {gb}");
            assert_eq!(qpb, group.div_ceil(parts), "group {group}");
            assert_eq!(group.div_ceil(qpb), parts, "group {group}: choose_kernel's qtiles");
            assert!(parts * qpb >= group && (parts - 1) * qpb < group, "group {group}: {parts} parts of {qpb}");
        }
        assert_eq!((row_parts(8), row_heads_per_block(8)), (2, (4, 4)));
        assert_eq!((row_parts(10), row_heads_per_block(10)), (3, (4, 4)));
        assert_eq!((row_parts(3), row_heads_per_block(3)), (1, (3, 4)));
    }

    /// The plans of the profiled shapes on an H200 (132 SMs): Qwen3-30B-A3B (4 kv heads, group 8: 2 parts) at
    /// 4128 keys: 33 splits of 128 (264 blocks, 2 per SM); at 16 keys one split; Qwen3-Next (2 kv heads, group
    /// 8) at 4128 keys: 65 splits of 64.
    #[test]
    fn row_plans_of_the_models() {
        assert_eq!(row_target_splits(4, 2, 132), 33);
        assert_eq!(plan_row_splits(4128, 33), SplitPlan { splits: 33, chunk: 128 });
        assert_eq!(plan_row_splits(16, 33), SplitPlan { splits: 1, chunk: 64 });
        assert_eq!(row_target_splits(2, 2, 132), 66);
        assert_eq!(plan_row_splits(4128, 66), SplitPlan { splits: 65, chunk: 64 });
        // In clusters of 16 (of 11), all resident: 32 (33) splits, 2 (3) clusters a (kv head, part).
        assert_eq!(row_cluster_splits(33, 16, 1000, 8), 32);
        assert_eq!(plan_row_splits(4128, 32), SplitPlan { splits: 26, chunk: 160 });
        assert_eq!(row_cluster_splits(33, 11, 1000, 8), 33);
        // Clusters of 8 where 30 run at once: 3 a (kv head, part), 24 splits.
        assert_eq!(row_cluster_splits(33, 8, 30, 8), 24);
        assert_eq!(row_cluster_splits(33, 8, 7, 8), 0);
    }

    #[test]
    fn int8_block_quantization() {
        let x = [0.5f32, -1.27, 0.0, 1.27, 0.004];
        let mut q = [0i8; 5];
        let s = quantize_int8_block(&x, &mut q);
        assert_eq!(s, 1.27 / 127.0);
        assert_eq!(q, [50, -127, 0, 127, 0]);
        let mut z = [1i8; 3];
        assert_eq!(quantize_int8_block(&[0.0; 3], &mut z), 0.0);
        assert_eq!(z, [0; 3]);
    }
}
