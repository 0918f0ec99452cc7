//! CUDA launch wrappers for kernels/deltanet.cu (see kernels/README.md): the
//! Gated DeltaNet mixer core of Qwen3-Next, everything between in_proj
//! (qkvz, ba) and out_proj, mirroring `backend::cpu::deltanet` step by step:
//!
//! `conv_silu` (split_qkvz + causal_conv1d + SiLU over cat(q, k, v), the conv
//! state advanced) -> `delta_rule_recurrent` (gates + l2norm + the recurrent
//! rule, token by token: decode and the reference path) or
//! `delta_rule_chunked` (the chunked WY form, chunk 64: prefill) ->
//! `gated_rmsnorm` (with z) -> core `[T, Hv*dv]`. `deltanet_core` runs them all.
//!
//! State and weights stay in the CPU layouts (`DeltaNetState`: conv
//! `[conv_dim, K-1]`, recurrent `[Hv, dk, dv]`, f32), so a checkpoint copies
//! them to and from the host unchanged. Every wrapper checks lengths and
//! shapes and returns `Error::InvalidArgument` before it launches anything;
//! everything is queued on `gpu.stream()` (nothing here synchronizes except
//! `DeviceDeltaState::download`). Input and output buffers may be longer
//! than `tokens` rows (buffers sized for the largest batch): the first rows are
//! used. State buffers must have exactly the state's length.
//!
//! Scratch: `DeltaNetScratch` (the caller keeps one per device, sized for its
//! largest call) holds the conv output, the pre-norm core and the chunked
//! form's per-chunk matrices; `deltanet_core` allocates one per call.

use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};

use super::{CudaFunction, CudaSlice, Gpu, LaunchConfig, PushKernelArg};
use crate::backend::cpu::deltanet::{DeltaNetShape, DeltaNetState, DELTA_RULE_CHUNK};
use crate::error::{Error, Result};

/// Largest conv kernel width (`DN_MAX_CONV_K`).
const MAX_CONV_KERNEL: usize = 8;
/// Largest key head dim: 8 warps x 32 state rows a thread (`dn_*_r32`).
const MAX_KEY_HEAD_DIM: usize = 256;
/// Value columns per block of the recurrent rule kernels (`DN_COLS`).
const COLS_PER_BLOCK: usize = 32;
/// Value columns per block of the chunked form's state kernels (`DN_SCOLS`).
const STATE_COLS_PER_BLOCK: usize = 16;
/// Threads of the rule kernels (`DN_THREADS`).
const RULE_THREADS: u32 = 256;
/// Tokens per block of `dn_conv_silu`.
const CONV_TILE: usize = 32;
/// Threads of the conv kernels.
const CONV_THREADS: u32 = 128;
/// Threads (8 warps, one row each) of the row kernels (gated RMSNorm, l2norm).
const ROW_THREADS: u32 = 256;
/// Shared memory a block may use without opting in.
const DEFAULT_SMEM: usize = 48 * 1024;

fn invalid(msg: String) -> Error {
    Error::InvalidArgument(msg)
}

fn i32_arg(what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| invalid(format!("deltanet: {what} = {v} does not fit a 32-bit kernel argument")))
}

fn need(what: &str, len: usize, want: usize) -> Result<()> {
    if len < want {
        return Err(invalid(format!("deltanet: {what} holds {len} elements, {want} needed")));
    }
    Ok(())
}

fn same(what: &str, len: usize, want: usize) -> Result<()> {
    if len != want {
        return Err(invalid(format!("deltanet: {what} holds {len} elements, expected {want}")));
    }
    Ok(())
}

/// The shapes the kernels support: Hv a multiple of Hk, 2 <= K <= 8, dk <= 256,
/// all sizes non-zero, and every flat index within 32 bits per row.
fn check_shape(s: DeltaNetShape) -> Result<()> {
    let ok = s.key_heads > 0
        && s.value_heads > 0
        && s.value_heads % s.key_heads == 0
        && s.key_head_dim > 0
        && s.value_head_dim > 0
        && (2..=MAX_CONV_KERNEL).contains(&s.conv_kernel)
        && s.key_head_dim <= MAX_KEY_HEAD_DIM;
    if !ok {
        return Err(invalid(format!(
            "deltanet: unsupported shape {s:?} (value_heads a multiple of key_heads, 2 <= conv_kernel <= \
             {MAX_CONV_KERNEL}, key_head_dim <= {MAX_KEY_HEAD_DIM})"
        )));
    }
    i32_arg("qkvz_dim", s.qkvz_dim())?;
    Ok(())
}

/// The r16 variant of a rule kernel (16 state rows a thread) for dk <= 128, else r32.
fn rule_function(gpu: &Gpu, base: &str, dk: usize) -> Result<CudaFunction> {
    gpu.function(&format!("{base}_{}", if dk <= 128 { "r16" } else { "r32" }))
}

/// Dynamic shared memory of `dn_chunk_prep`: kv [64][max(dk, dv)+1], qs [64][max(dk+1, 68)],
/// am [64][68], pa [64][65], cum, beta (dk = dv = 128: 100,608 bytes, under the 99 KB of sm_86/89).
fn prep_shared_bytes(s: DeltaNetShape) -> usize {
    let (c, ld) = (DELTA_RULE_CHUNK, s.key_head_dim + 1);
    4 * (c * ld.max(s.value_head_dim + 1) + c * ld.max(c + 4) + c * (c + 4) + c * (c + 1) + 2 * c)
}

/// The state rows a `dn_chunk_state_*` block is built for (`MAXDK`): 128 (r16) or 256 (r32).
fn state_max_dk(s: DeltaNetShape) -> usize {
    if s.key_head_dim <= 128 {
        128
    } else {
        256
    }
}

/// Dynamic shared memory of `dn_chunk_state_*`: the state slice [MAXDK][16], wb and qb
/// [64][MAXDK+4], vb [64][16], kdec [64] (dk 128: 80 KB, two blocks an SM).
fn state_shared_bytes(s: DeltaNetShape) -> usize {
    let (c, m, sc) = (DELTA_RULE_CHUNK, state_max_dk(s), STATE_COLS_PER_BLOCK);
    4 * (m * sc + 2 * c * (m + 4) + c * sc + c)
}

/// Row stride of the chunked form's W and Q' scratch: dk rounded up to 4 (float4 rows).
fn padded_key_dim(s: DeltaNetShape) -> usize {
    s.key_head_dim.next_multiple_of(4)
}

/// Whether this device gives a block the shared memory of the chunked form
/// (dk = dv = 128: prep 98 KiB, state 78 KiB; every CC >= 8.0 device does, sm_75's 64 KB does not).
pub fn chunked_form_fits(gpu: &Gpu, shape: DeltaNetShape) -> Result<bool> {
    let optin = gpu.context().attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?;
    Ok(prep_shared_bytes(shape).max(state_shared_bytes(shape)) <= optin.max(0) as usize)
}

/// Opts `f` into `bytes` of dynamic shared memory when above the default.
fn allow_shared(f: &CudaFunction, bytes: usize, name: &str) -> Result<()> {
    if bytes > DEFAULT_SMEM {
        f.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes as i32)
            .map_err(|e| Error::Cuda(format!("{name}: {bytes} bytes of shared memory: {e}")))?;
    }
    Ok(())
}

/// The device state of one Gated DeltaNet layer, in EXACTLY the CPU layouts
/// (conv `[conv_dim, K-1]`, recurrent `[Hv, dk, dv]`, f32), so checkpoints
/// copy it to/from a host `DeltaNetState` unchanged.
pub struct DeviceDeltaState {
    pub conv: CudaSlice<f32>,
    pub recurrent: CudaSlice<f32>,
}

impl DeviceDeltaState {
    /// The state before the first token: zeros.
    pub fn new(gpu: &Gpu, shape: DeltaNetShape) -> Result<Self> {
        check_shape(shape)?;
        Ok(DeviceDeltaState {
            conv: gpu.alloc_zeros(shape.conv_state_len())?,
            recurrent: gpu.alloc_zeros(shape.recurrent_state_len())?,
        })
    }

    /// A device copy of a host state (any shape; `deltanet_core` checks it).
    pub fn upload(gpu: &Gpu, state: &DeltaNetState) -> Result<Self> {
        Ok(DeviceDeltaState { conv: gpu.upload(&state.conv)?, recurrent: gpu.upload(&state.recurrent)? })
    }

    /// The host copy (waits for the stream).
    pub fn download(&self, gpu: &Gpu) -> Result<DeltaNetState> {
        Ok(DeltaNetState { conv: gpu.download(&self.conv)?, recurrent: gpu.download(&self.recurrent)? })
    }

    /// Device-to-device copy of `other` into `self` (snapshots); both of one shape.
    pub fn copy_from(&mut self, gpu: &Gpu, other: &DeviceDeltaState) -> Result<()> {
        same("DeviceDeltaState::copy_from conv", self.conv.len(), other.conv.len())?;
        same("DeviceDeltaState::copy_from recurrent", self.recurrent.len(), other.recurrent.len())?;
        gpu.stream().memcpy_dtod(&other.conv, &mut self.conv)?;
        gpu.stream().memcpy_dtod(&other.recurrent, &mut self.recurrent)?;
        Ok(())
    }
}

/// Device copies of a layer's small weights, all f32: conv1d `[conv_dim, K]`
/// (the pack's `[conv_dim, 1, K]` flattened), dt_bias `[Hv]`, a_log `[Hv]`,
/// norm `[dv]` (the gated RMSNorm's plain weight).
pub struct DeltaNetDeviceWeights {
    pub conv1d: CudaSlice<f32>,
    pub dt_bias: CudaSlice<f32>,
    pub a_log: CudaSlice<f32>,
    pub norm: CudaSlice<f32>,
    pub shape: DeltaNetShape,
}

impl DeltaNetDeviceWeights {
    pub fn new(
        gpu: &Gpu,
        conv1d: &[f32],
        dt_bias: &[f32],
        a_log: &[f32],
        norm: &[f32],
        shape: DeltaNetShape,
    ) -> Result<Self> {
        check_shape(shape)?;
        same("conv1d", conv1d.len(), shape.conv_dim() * shape.conv_kernel)?;
        same("dt_bias", dt_bias.len(), shape.value_heads)?;
        same("a_log", a_log.len(), shape.value_heads)?;
        same("norm", norm.len(), shape.value_head_dim)?;
        Ok(DeltaNetDeviceWeights {
            conv1d: gpu.upload(conv1d)?,
            dt_bias: gpu.upload(dt_bias)?,
            a_log: gpu.upload(a_log)?,
            norm: gpu.upload(norm)?,
            shape,
        })
    }
}

/// Which form of the delta rule `deltanet_core_with` runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeltaRuleForm {
    /// One token: recurrent; more: chunked (as `gated_deltanet_layer` does).
    Auto,
    /// Token by token for any T (the reference-equal path).
    Recurrent,
    /// Chunks of 64 for any T.
    Chunked,
}

/// Scratch of the chunked form for up to `max_tokens` tokens
/// (`dn_chunk_prep`'s outputs): cum (the cumulative log decay within each
/// chunk) `[Hv, T]`, W = Tm (beta e^c k) and Q' = e^c q - attn Tm (beta e^c k)
/// `[Hv, T, dk4]` (dk rounded up to 4), U = Tm (beta v) `[Hv, T, dv]`.
pub struct DeltaRuleChunkScratch {
    shape: DeltaNetShape,
    max_tokens: usize,
    cum: CudaSlice<f32>,
    w: CudaSlice<f32>,
    qp: CudaSlice<f32>,
    u: CudaSlice<f32>,
}

impl DeltaRuleChunkScratch {
    pub fn new(gpu: &Gpu, shape: DeltaNetShape, max_tokens: usize) -> Result<Self> {
        check_shape(shape)?;
        let t = max_tokens.max(1);
        let wq = shape.value_heads * t * padded_key_dim(shape);
        Ok(DeltaRuleChunkScratch {
            shape,
            max_tokens: t,
            cum: gpu.alloc_zeros(t * shape.value_heads)?,
            w: gpu.alloc_zeros(wq)?,
            qp: gpu.alloc_zeros(wq)?,
            u: gpu.alloc_zeros(t * shape.value_dim())?,
        })
    }
}

/// Scratch of `deltanet_core_with` for up to `max_tokens` tokens of one
/// shape: qkv `[T, conv_dim]` (the conv output; the chunked form l2-normalizes
/// q, k in place), core `[T, Hv*dv]` (the rule's output before the norm) and
/// the chunked form's `DeltaRuleChunkScratch`. About
/// `T * (conv_dim + 2 * value_dim + Hv + 2 * Hv * dk4)` floats
/// (4096 tokens at 80B: ~400 MB; one token: ~100 KB). The caller keeps one per
/// device and shape, sized for its largest call.
pub struct DeltaNetScratch {
    shape: DeltaNetShape,
    max_tokens: usize,
    qkv: CudaSlice<f32>,
    core: CudaSlice<f32>,
    chunks: DeltaRuleChunkScratch,
}

impl DeltaNetScratch {
    pub fn new(gpu: &Gpu, shape: DeltaNetShape, max_tokens: usize) -> Result<Self> {
        check_shape(shape)?;
        let t = max_tokens.max(1);
        Ok(DeltaNetScratch {
            shape,
            max_tokens: t,
            qkv: gpu.alloc_zeros(t * shape.conv_dim())?,
            core: gpu.alloc_zeros(t * shape.value_dim())?,
            chunks: DeltaRuleChunkScratch::new(gpu, shape, t)?,
        })
    }

    pub fn max_tokens(&self) -> usize {
        self.max_tokens
    }
}

/// Split + depthwise causal conv1d + SiLU (`split_qkvz` then `causal_conv1d`
/// over cat(q, k, v)): `mixed_qkvz [T, qkvz_dim]` -> `qkv [T, conv_dim]`
/// (rows cat(q, k, v), post-SiLU), `conv_state [conv_dim, K-1]` advanced by T tokens.
#[allow(clippy::too_many_arguments)]
pub fn conv_silu(
    gpu: &Gpu,
    mixed_qkvz: &CudaSlice<f32>,
    conv1d: &CudaSlice<f32>,
    shape: DeltaNetShape,
    tokens: usize,
    conv_state: &mut CudaSlice<f32>,
    qkv: &mut CudaSlice<f32>,
) -> Result<()> {
    check_shape(shape)?;
    if tokens == 0 {
        return Ok(());
    }
    let cd = shape.conv_dim();
    need("mixed_qkvz", mixed_qkvz.len(), tokens * shape.qkvz_dim())?;
    same("conv1d", conv1d.len(), cd * shape.conv_kernel)?;
    same("conv state", conv_state.len(), shape.conv_state_len())?;
    need("qkv", qkv.len(), tokens * cd)?;
    let t = i32_arg("tokens", tokens)?;
    let tile = CONV_TILE as i32;
    let (dk, gv, kd) =
        (shape.key_head_dim as i32, (shape.group() * shape.value_head_dim) as i32, shape.key_dim() as i32);
    let (cd_i, qkvz, k) = (cd as i32, shape.qkvz_dim() as i32, shape.conv_kernel as i32);
    let tiles = tokens.div_ceil(CONV_TILE);
    if tiles > 65535 {
        return Err(invalid(format!("deltanet conv: {tokens} tokens is more than one launch takes")));
    }
    let update = i32::from(tiles == 1);
    let blocks = cd.div_ceil(CONV_THREADS as usize) as u32;
    let f = gpu.function("dn_conv_silu")?;
    let cfg =
        LaunchConfig { grid_dim: (blocks, tiles as u32, 1), block_dim: (CONV_THREADS, 1, 1), shared_mem_bytes: 0 };
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(mixed_qkvz).arg(conv1d).arg(&mut *conv_state).arg(&mut *qkv);
    b.arg(&t).arg(&tile).arg(&dk).arg(&gv).arg(&kd).arg(&cd_i).arg(&qkvz).arg(&k).arg(&update);
    // SAFETY: dn_conv_silu reads mixed [T, qkvz_dim], weight [conv_dim, K], state
    // [conv_dim, K-1] and writes out [T, conv_dim] (lengths checked above).
    unsafe { b.launch(cfg) }?;
    if update == 0 {
        let f = gpu.function("dn_conv_state")?;
        let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (CONV_THREADS, 1, 1), shared_mem_bytes: 0 };
        let mut b = gpu.stream().launch_builder(&f);
        b.arg(mixed_qkvz).arg(&mut *conv_state);
        b.arg(&t).arg(&dk).arg(&gv).arg(&kd).arg(&cd_i).arg(&qkvz).arg(&k);
        // SAFETY: dn_conv_state reads mixed [T, qkvz_dim] and rewrites state [conv_dim, K-1].
        unsafe { b.launch(cfg) }?;
    }
    Ok(())
}

fn check_rule_args(
    shape: DeltaNetShape,
    tokens: usize,
    qkv: usize,
    mixed_ba: usize,
    w: &DeltaNetDeviceWeights,
    recurrent: usize,
    core: usize,
) -> Result<()> {
    check_shape(shape)?;
    if w.shape != shape {
        return Err(invalid(format!("deltanet: weights of shape {:?} used with shape {shape:?}", w.shape)));
    }
    need("qkv", qkv, tokens * shape.conv_dim())?;
    need("mixed_ba", mixed_ba, tokens * shape.ba_dim())?;
    same("recurrent state", recurrent, shape.recurrent_state_len())?;
    need("core", core, tokens * shape.value_dim())?;
    i32_arg("tokens", tokens)?;
    Ok(())
}

/// The gated delta rule token by token (`deltanet_gates`, then
/// `gated_delta_rule_recurrent` with its l2norm of q, k and the dk^-0.5 of q):
/// `qkv [T, conv_dim]` (the conv output), `mixed_ba [T, 2*Hv]` (the in_proj_ba
/// output; the gates are computed inside) -> `core [T, Hv*dv]`, `recurrent
/// [Hv, dk, dv]` advanced. One block per (value head, 32 value columns), the
/// state in registers for all T tokens.
#[allow(clippy::too_many_arguments)]
pub fn delta_rule_recurrent(
    gpu: &Gpu,
    qkv: &CudaSlice<f32>,
    mixed_ba: &CudaSlice<f32>,
    w: &DeltaNetDeviceWeights,
    shape: DeltaNetShape,
    tokens: usize,
    recurrent: &mut CudaSlice<f32>,
    core: &mut CudaSlice<f32>,
) -> Result<()> {
    check_rule_args(shape, tokens, qkv.len(), mixed_ba.len(), w, recurrent.len(), core.len())?;
    if tokens == 0 {
        return Ok(());
    }
    let f = rule_function(gpu, "dn_rule_recurrent", shape.key_head_dim)?;
    let cols = shape.value_head_dim.div_ceil(COLS_PER_BLOCK) as u32;
    let cfg = LaunchConfig {
        grid_dim: (shape.value_heads as u32, cols, 1),
        block_dim: (RULE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let (t, hk, hv) = (tokens as i32, shape.key_heads as i32, shape.value_heads as i32);
    let (dk, dv) = (shape.key_head_dim as i32, shape.value_head_dim as i32);
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(qkv).arg(mixed_ba).arg(&w.a_log).arg(&w.dt_bias).arg(&mut *recurrent).arg(&mut *core);
    b.arg(&t).arg(&hk).arg(&hv).arg(&dk).arg(&dv);
    // SAFETY: reads qkv [T, conv_dim], mixed_ba [T, 2Hv], a_log, dt_bias [Hv];
    // rewrites state [Hv, dk, dv]; writes core [T, Hv*dv] (lengths checked).
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// The gated delta rule in chunks of 64 (`deltanet_gates`, then
/// `gated_delta_rule_chunked`): same inputs and results as
/// `delta_rule_recurrent`, up to rounding. `qkv`'s q and k columns are
/// l2-normalized in place (q also scaled by dk^-0.5); the per-chunk
/// matrices go to `scratch` (which must hold `tokens`).
#[allow(clippy::too_many_arguments)]
pub fn delta_rule_chunked(
    gpu: &Gpu,
    qkv: &mut CudaSlice<f32>,
    mixed_ba: &CudaSlice<f32>,
    w: &DeltaNetDeviceWeights,
    shape: DeltaNetShape,
    tokens: usize,
    scratch: &mut DeltaRuleChunkScratch,
    recurrent: &mut CudaSlice<f32>,
    core: &mut CudaSlice<f32>,
) -> Result<()> {
    check_rule_args(shape, tokens, qkv.len(), mixed_ba.len(), w, recurrent.len(), core.len())?;
    if scratch.shape != shape || scratch.max_tokens < tokens {
        return Err(invalid(format!(
            "deltanet: scratch for {} tokens of {:?} used for {tokens} tokens of {shape:?}",
            scratch.max_tokens, scratch.shape
        )));
    }
    if tokens == 0 {
        return Ok(());
    }
    let (t, hk, hv) = (tokens as i32, shape.key_heads as i32, shape.value_heads as i32);
    let (dk, dv, cd) = (shape.key_head_dim as i32, shape.value_head_dim as i32, shape.conv_dim() as i32);
    let chunks = tokens.div_ceil(DELTA_RULE_CHUNK);

    // l2norm of q and k (q times dk^-0.5, computed as the CPU does).
    let q_scale = (shape.key_head_dim as f64).powf(-0.5) as f32;
    let rows = tokens * shape.key_heads * 2;
    let f = gpu.function("dn_qk_l2norm")?;
    let cfg = LaunchConfig {
        grid_dim: (rows.div_ceil(ROW_THREADS as usize / 32) as u32, 1, 1),
        block_dim: (ROW_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(&mut *qkv).arg(&t).arg(&hk).arg(&dk).arg(&cd).arg(&q_scale);
    // SAFETY: rewrites the q, k columns of qkv [T, conv_dim] in place.
    unsafe { b.launch(cfg) }?;

    // Per (chunk, head): cum, W, Q', U and O0 (into core).
    let prep_smem = prep_shared_bytes(shape);
    let f = gpu.function("dn_chunk_prep")?;
    allow_shared(&f, prep_smem, "dn_chunk_prep")?;
    let cfg = LaunchConfig {
        grid_dim: (chunks as u32, shape.value_heads as u32, 1),
        block_dim: (RULE_THREADS, 1, 1),
        shared_mem_bytes: prep_smem as u32,
    };
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(&*qkv).arg(mixed_ba).arg(&w.a_log).arg(&w.dt_bias);
    b.arg(&mut scratch.cum).arg(&mut scratch.w).arg(&mut scratch.qp).arg(&mut scratch.u).arg(&mut *core);
    b.arg(&t).arg(&hk).arg(&hv).arg(&dk).arg(&dv);
    // SAFETY: reads qkv, mixed_ba, a_log, dt_bias; writes cum [Hv, T], w, qp
    // [Hv, T, dk4], u [Hv, T, dv] (scratch holds max_tokens >= T) and core [T, Hv*dv].
    unsafe { b.launch(cfg) }?;

    // Sequential over chunks per (head, 16 columns).
    let state_smem = state_shared_bytes(shape);
    let name = if shape.key_head_dim <= 128 { "dn_chunk_state_r16" } else { "dn_chunk_state_r32" };
    let f = gpu.function(name)?;
    allow_shared(&f, state_smem, name)?;
    let cols = shape.value_head_dim.div_ceil(STATE_COLS_PER_BLOCK) as u32;
    let cfg = LaunchConfig {
        grid_dim: (shape.value_heads as u32, cols, 1),
        block_dim: (RULE_THREADS, 1, 1),
        shared_mem_bytes: state_smem as u32,
    };
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(&*qkv).arg(&scratch.cum).arg(&scratch.w).arg(&scratch.qp).arg(&scratch.u);
    b.arg(&mut *recurrent).arg(&mut *core);
    b.arg(&t).arg(&hk).arg(&hv).arg(&dk).arg(&dv);
    // SAFETY: reads qkv and the prep outputs; rewrites state [Hv, dk, dv]; adds Q' S
    // to core [T, Hv*dv] (which dn_chunk_prep filled with O0).
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// Gated RMSNorm with z (`gated_rmsnorm`): per (token, value head) row of dv,
/// `out = (norm * (core / sqrt(mean(core^2) + eps))) * silu(z)`, z read from
/// `mixed_qkvz [T, qkvz_dim]` (as `split_qkvz` places it). `out [T, Hv*dv]`.
#[allow(clippy::too_many_arguments)]
pub fn gated_rmsnorm(
    gpu: &Gpu,
    core: &CudaSlice<f32>,
    mixed_qkvz: &CudaSlice<f32>,
    norm: &CudaSlice<f32>,
    shape: DeltaNetShape,
    eps: f32,
    tokens: usize,
    out: &mut CudaSlice<f32>,
) -> Result<()> {
    check_shape(shape)?;
    if tokens == 0 {
        return Ok(());
    }
    need("core", core.len(), tokens * shape.value_dim())?;
    need("mixed_qkvz", mixed_qkvz.len(), tokens * shape.qkvz_dim())?;
    same("norm", norm.len(), shape.value_head_dim)?;
    need("out", out.len(), tokens * shape.value_dim())?;
    let rows = tokens * shape.value_heads;
    let rows_i = i32_arg("tokens * value_heads", rows)?;
    let (hv, dk, dv) = (shape.value_heads as i32, shape.key_head_dim as i32, shape.value_head_dim as i32);
    let (group, qkvz) = (shape.group() as i32, shape.qkvz_dim() as i32);
    let f = gpu.function("dn_gated_rmsnorm")?;
    let cfg = LaunchConfig {
        grid_dim: (rows.div_ceil(ROW_THREADS as usize / 32) as u32, 1, 1),
        block_dim: (ROW_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(core).arg(mixed_qkvz).arg(norm).arg(&mut *out);
    b.arg(&rows_i).arg(&hv).arg(&dk).arg(&dv).arg(&group).arg(&qkvz).arg(&eps);
    // SAFETY: reads core [T, Hv*dv], mixed [T, qkvz_dim], norm [dv]; writes out [T, Hv*dv].
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// `mixed_qkvz [T, qkvz_dim]` and `mixed_ba [T, ba_dim]` (the in_proj outputs)
/// -> `out [T, value_dim]` (the gated-RMSNorm output, input of out_proj),
/// advancing `state`: what `gated_deltanet_layer` does between its matmuls.
/// One token takes the recurrent form, more the chunked form (where the device
/// has its shared memory: `chunked_form_fits`). Allocates its
/// scratch; keep a `DeltaNetScratch` and call `deltanet_core_with` to avoid that.
#[allow(clippy::too_many_arguments, non_snake_case)]
pub fn deltanet_core(
    gpu: &Gpu,
    mixed_qkvz: &CudaSlice<f32>,
    mixed_ba: &CudaSlice<f32>,
    w: &DeltaNetDeviceWeights,
    shape: DeltaNetShape,
    eps: f32,
    T: usize,
    state: &mut DeviceDeltaState,
    out: &mut CudaSlice<f32>,
) -> Result<()> {
    let mut scratch = DeltaNetScratch::new(gpu, shape, T)?;
    deltanet_core_with(gpu, mixed_qkvz, mixed_ba, w, shape, eps, T, state, out, &mut scratch, DeltaRuleForm::Auto)
}

/// `deltanet_core` with the caller's scratch (holding at least `tokens`) and
/// a choice of the rule's form.
#[allow(clippy::too_many_arguments)]
pub fn deltanet_core_with(
    gpu: &Gpu,
    mixed_qkvz: &CudaSlice<f32>,
    mixed_ba: &CudaSlice<f32>,
    w: &DeltaNetDeviceWeights,
    shape: DeltaNetShape,
    eps: f32,
    tokens: usize,
    state: &mut DeviceDeltaState,
    out: &mut CudaSlice<f32>,
    scratch: &mut DeltaNetScratch,
    form: DeltaRuleForm,
) -> Result<()> {
    check_shape(shape)?;
    if w.shape != shape || scratch.shape != shape {
        return Err(invalid(format!(
            "deltanet: weights ({:?}) or scratch ({:?}) of another shape than {shape:?}",
            w.shape, scratch.shape
        )));
    }
    if scratch.max_tokens < tokens {
        return Err(invalid(format!("deltanet: scratch holds {} tokens, {tokens} given", scratch.max_tokens)));
    }
    // Every check before the first launch, so an error leaves the state as it was.
    need("mixed_qkvz", mixed_qkvz.len(), tokens * shape.qkvz_dim())?;
    need("mixed_ba", mixed_ba.len(), tokens * shape.ba_dim())?;
    need("out", out.len(), tokens * shape.value_dim())?;
    same("conv state", state.conv.len(), shape.conv_state_len())?;
    same("recurrent state", state.recurrent.len(), shape.recurrent_state_len())?;
    if tokens == 0 {
        return Ok(());
    }
    conv_silu(gpu, mixed_qkvz, &w.conv1d, shape, tokens, &mut state.conv, &mut scratch.qkv)?;
    let chunked = match form {
        // Devices without the chunked form's shared memory (sm_75) stay token by token.
        DeltaRuleForm::Auto => tokens > 1 && chunked_form_fits(gpu, shape)?,
        DeltaRuleForm::Recurrent => false,
        DeltaRuleForm::Chunked => true,
    };
    let DeltaNetScratch { qkv, core, chunks, .. } = scratch;
    if chunked {
        delta_rule_chunked(gpu, qkv, mixed_ba, w, shape, tokens, chunks, &mut state.recurrent, core)?;
    } else {
        delta_rule_recurrent(gpu, qkv, mixed_ba, w, shape, tokens, &mut state.recurrent, core)?;
    }
    gated_rmsnorm(gpu, core, mixed_qkvz, &w.norm, shape, eps, tokens, out)
}
