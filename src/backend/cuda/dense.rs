//! CUDA launch wrappers for kernels/dense.cu (see kernels/README.md): the
//! dense BF16 projections (own GEMV for T <= 8 rows, cuBLAS above), RMSNorm,
//! RoPE, the elementwise ops of both architectures, the embedding gather,
//! the non-finite guard and greedy argmax. Each wrapper checks lengths and
//! shapes and returns `Error::InvalidArgument` before it launches anything;
//! everything is queued on `gpu.stream()` (nothing here synchronizes).
//!
//! Wrappers that take explicit row counts (`matmul`, `rope`, `embed`,
//! `argmax`) use the first rows of buffers that may be longer (buffers
//! sized for the largest batch); the others take whole buffers.

use half::bf16;

use super::{CudaSlice, DevicePtr, DevicePtrMut, Gpu, KernelArgs, LaunchConfig, PushKernelArg};
use crate::backend::Rope;
use crate::error::{Error, Result};

/// Warps per block of the GEMV kernels (`DENSE_GEMV_WARPS`).
const GEMV_WARPS: usize = 8;
/// Rows of W per warp group of `dense_gemv_t{T}` (the `ROWS` of `DENSE_GEMV_KERNEL`).
const GEMV_ROWS_PER_GROUP: usize = 4;
/// Threads and elements per block of `dense_argmax_partial`.
const ARGMAX_THREADS: u32 = 256;
const ARGMAX_CHUNK: usize = 256 * 16;
/// Largest row count of the GEMV kernels; above it `matmul` goes to cuBLAS.
pub const GEMV_MAX_ROWS: usize = 8;

fn invalid(msg: String) -> Error {
    Error::InvalidArgument(msg)
}

fn check_i32(what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| invalid(format!("{what} = {v} does not fit a 32-bit kernel argument")))
}

fn need(what: &str, len: usize, want: usize) -> Result<()> {
    if len < want {
        return Err(invalid(format!("{what} holds {len} elements, {want} needed")));
    }
    Ok(())
}

fn same(what: &str, len: usize, want: usize) -> Result<()> {
    if len != want {
        return Err(invalid(format!("{what} holds {len} elements, expected {want}")));
    }
    Ok(())
}

/// Threads of a one-block-per-row kernel: about 8 elements a thread, 32..1024.
fn row_block_threads(width: usize) -> u32 {
    width.div_ceil(8).next_multiple_of(32).clamp(32, 1024) as u32
}

// ---------------------------------------------------------------------------
// Dense projections.

/// How a projection writes `out`: overwrite it, or add to it (the residual
/// add after o_proj / down_proj fused into the projection: `out += x W^T`,
/// the same f32 add as `add` after `matmul`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Write {
    Store,
    Add,
}

/// `out [T, N] = x [T, K] * W^T` for BF16 `w [N, K]` with f32 accumulation
/// (a linear layer's `y = x W^T`). T <= 8 (decode, speculative verify): the
/// own GEMV (`gemv`), exact f32 products of the bf16 weights and f32 x. T > 8:
/// x is rounded to bf16 into a scratch buffer allocated here and cuBLAS runs
/// the GEMM (`gemm`); pass your own scratch to `matmul_with_scratch`.
/// `out` must not overlap `x`.
pub fn matmul(
    gpu: &Gpu,
    x: &CudaSlice<f32>,
    w: &CudaSlice<bf16>,
    t: usize,
    n: usize,
    k: usize,
    out: &mut CudaSlice<f32>,
) -> Result<()> {
    matmul_alloc(gpu, x, w, t, n, k, out, Write::Store)
}

/// `out [T, N] += x [T, K] * W^T` (`matmul` fused with the residual add).
pub fn matmul_add(
    gpu: &Gpu,
    x: &CudaSlice<f32>,
    w: &CudaSlice<bf16>,
    t: usize,
    n: usize,
    k: usize,
    out: &mut CudaSlice<f32>,
) -> Result<()> {
    matmul_alloc(gpu, x, w, t, n, k, out, Write::Add)
}

#[allow(clippy::too_many_arguments)]
fn matmul_alloc(
    gpu: &Gpu,
    x: &CudaSlice<f32>,
    w: &CudaSlice<bf16>,
    t: usize,
    n: usize,
    k: usize,
    out: &mut CudaSlice<f32>,
    write: Write,
) -> Result<()> {
    if t <= GEMV_MAX_ROWS {
        return gemv(gpu, x, w, t, n, k, out, write);
    }
    check_matmul(x, w, t, n, k, out)?;
    // SAFETY: uninitialized device memory; gemm's conversion writes all t*k elements before cuBLAS reads them.
    let mut scratch = unsafe { gpu.stream().alloc::<bf16>(t * k) }?;
    gemm(gpu, x, w, t, n, k, out, &mut scratch, write)
}

/// `matmul` with the caller's bf16 scratch of at least `T * K` elements for
/// the cuBLAS path (unused for T <= 8).
#[allow(clippy::too_many_arguments)]
pub fn matmul_with_scratch(
    gpu: &Gpu,
    x: &CudaSlice<f32>,
    w: &CudaSlice<bf16>,
    t: usize,
    n: usize,
    k: usize,
    out: &mut CudaSlice<f32>,
    scratch: &mut CudaSlice<bf16>,
) -> Result<()> {
    project_with(gpu, x, w, t, n, k, out, scratch, Write::Store, GemmPrecision::Bf16)
}

/// `matmul_add` with the caller's bf16 scratch (see `matmul_with_scratch`).
#[allow(clippy::too_many_arguments)]
pub fn matmul_add_with_scratch(
    gpu: &Gpu,
    x: &CudaSlice<f32>,
    w: &CudaSlice<bf16>,
    t: usize,
    n: usize,
    k: usize,
    out: &mut CudaSlice<f32>,
    scratch: &mut CudaSlice<bf16>,
) -> Result<()> {
    project_with(gpu, x, w, t, n, k, out, scratch, Write::Add, GemmPrecision::Bf16)
}

fn check_matmul(
    x: &CudaSlice<f32>,
    w: &CudaSlice<bf16>,
    t: usize,
    n: usize,
    k: usize,
    out: &CudaSlice<f32>,
) -> Result<()> {
    if n == 0 || k == 0 {
        return Err(invalid(format!("matmul: empty weight [{n}, {k}]")));
    }
    same("matmul: w", w.len(), n * k)?;
    need("matmul: x", x.len(), t * k)?;
    need("matmul: out", out.len(), t * n)?;
    check_i32("matmul: N", n)?;
    check_i32("matmul: K", k)?;
    check_i32("matmul: T", t)?;
    Ok(())
}

/// Tests: the K split every GEMV launch uses instead of `gemv_ksplit`'s
/// choice (0: none), for timing the choices against each other; starts as
/// `STRATA_GEMV_KSPLIT` (a build with `test-hooks`: the bench can compare).
#[cfg(any(test, feature = "test-hooks"))]
static KSPLIT_OVERRIDE: std::sync::LazyLock<std::sync::atomic::AtomicUsize> = std::sync::LazyLock::new(|| {
    let v = std::env::var("STRATA_GEMV_KSPLIT").ok().and_then(|v| v.parse().ok()).unwrap_or(0);
    std::sync::atomic::AtomicUsize::new(v)
});

/// Tests: forces the K split of every GEMV launch (a power of two <= 8), or
/// `None` for the heuristic again.
#[cfg(any(test, feature = "test-hooks"))]
pub fn force_gemv_ksplit(ks: Option<usize>) {
    KSPLIT_OVERRIDE.store(ks.unwrap_or(0), std::sync::atomic::Ordering::Relaxed);
}

/// The GEMV kernels' split of K between the warps of a block: the largest
/// power of two (<= 8, <= the 256-wide steps of K) that keeps the grid
/// within GEMV_MAX_WAVES waves of 4 blocks per SM. Measured on the H200
/// (the suite's `dense_timing`): a decode projection is latency-bound, and
/// more, shorter warps per row finish sooner (qkv 5120 x 2048: 7.4 us split
/// 8 ways, 8.1 us 4 ways, 10.4 us 2 ways), while the LM head (151936 rows)
/// has rows enough without a split.
fn gemv_ksplit(n: usize, k: usize, sm_count: usize) -> usize {
    #[cfg(any(test, feature = "test-hooks"))]
    {
        let forced = KSPLIT_OVERRIDE.load(std::sync::atomic::Ordering::Relaxed);
        let forced = if forced.is_power_of_two() { forced } else { 0 };
        if forced != 0 {
            return forced.min(GEMV_WARPS);
        }
    }
    let steps = k.div_ceil(256);
    let blocks = |ks: usize| n.div_ceil(GEMV_WARPS / ks * GEMV_ROWS_PER_GROUP);
    let mut ks = 1;
    while ks < GEMV_WARPS && ks * 2 <= steps && blocks(ks * 2) <= GEMV_MAX_WAVES * 4 * sm_count {
        ks *= 2;
    }
    ks
}

/// Waves (of 4 blocks per SM) a K split may grow a GEMV's grid to.
const GEMV_MAX_WAVES: usize = 4;

/// Blocks per SM of `dense_gemv_t1` and `dense_gemv_norm_t1` (their launch bounds).
const GEMV_T1_BLOCKS_PER_SM: usize = 4;

/// Rows per warp group of the staged one-row GEMVs (`dense_gemv_staged_[norm_]t1_r{R}`), fewest first, and
/// their kernels.
const GEMV_STAGED_ROWS: [usize; 3] = [4, 8, 16];
const GEMV_STAGED_KERNELS: [&str; 3] =
    ["dense_gemv_staged_t1_r4", "dense_gemv_staged_t1_r8", "dense_gemv_staged_t1_r16"];
const GEMV_STAGED_NORM_KERNELS: [&str; 3] =
    ["dense_gemv_staged_norm_t1_r4", "dense_gemv_staged_norm_t1_r8", "dense_gemv_staged_norm_t1_r16"];

/// When a one-row GEMV takes a staged kernel (every weight requested into shared memory before the
/// programmatic wait): STAGED_DEFAULT, or `force_gemv_staged` / `STRATA_GEMV_STAGED` in a `test-hooks` build.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Staged {
    Never,
    /// Where the plain kernel's grid takes more than one wave and a staged one's fits in one.
    BeyondOneWave,
    /// Wherever a staged kernel's grid fits one wave (tests and benches only).
    #[cfg_attr(not(any(test, feature = "test-hooks")), allow(dead_code))]
    Always,
}

/// Tests and benches (`test-hooks`): the staged mode every one-row GEMV uses instead of STAGED_DEFAULT
/// (0: none; 1 Never, 2 BeyondOneWave, 3 Always); starts as `STRATA_GEMV_STAGED` (`0`, `1` or `2`: Never,
/// BeyondOneWave, Always).
#[cfg(any(test, feature = "test-hooks"))]
static STAGED_OVERRIDE: std::sync::LazyLock<std::sync::atomic::AtomicU8> = std::sync::LazyLock::new(|| {
    let v = match std::env::var("STRATA_GEMV_STAGED").as_deref() {
        Ok("0") => 1,
        Ok("1") => 2,
        Ok("2") => 3,
        _ => 0,
    };
    std::sync::atomic::AtomicU8::new(v)
});

/// Tests: forces the staged mode of every one-row GEMV: `Some(0)` never, `Some(1)` beyond one wave (the
/// default), `Some(2)` always; `None`: the default again.
#[cfg(any(test, feature = "test-hooks"))]
pub fn force_gemv_staged(mode: Option<u8>) {
    let v = mode.map_or(0, |m| m.min(2) + 1);
    STAGED_OVERRIDE.store(v, std::sync::atomic::Ordering::Relaxed);
}

/// The staged mode of one-row GEMVs.
const STAGED_DEFAULT: Staged = Staged::BeyondOneWave;

fn staged_mode() -> Staged {
    #[cfg(any(test, feature = "test-hooks"))]
    {
        match STAGED_OVERRIDE.load(std::sync::atomic::Ordering::Relaxed) {
            1 => return Staged::Never,
            2 => return Staged::BeyondOneWave,
            3 => return Staged::Always,
            _ => {}
        }
    }
    STAGED_DEFAULT
}

/// Dynamic shared memory of a staged one-row GEMV: DENSE_GEMV_WARPS warps x steps x rows x 512 bytes, a step
/// being 32 lanes x 16 bytes of each row (`dense_gemv_body`'s STAGED layout).
fn gemv_staged_smem(k: usize, ks: usize, rows: usize) -> usize {
    GEMV_WARPS * (k / 8).div_ceil(32 * ks) * rows * 512
}

/// The staged kernel (name, rows per warp group, dynamic shared bytes) a one-row GEMV of `n x k` split `ks`
/// ways takes, if any (`staged_mode`): the fewest rows whose grid the device runs in one wave.
fn gemv_staged(gpu: &Gpu, n: usize, k: usize, ks: usize, norm: bool) -> Result<Option<(&'static str, usize, usize)>> {
    let name = |rows: usize| {
        let i = GEMV_STAGED_ROWS.iter().position(|&r| r == rows).expect("a staged row count");
        if norm {
            GEMV_STAGED_NORM_KERNELS[i]
        } else {
            GEMV_STAGED_KERNELS[i]
        }
    };
    let per_sm = |rows: usize, smem: usize| gpu.blocks_per_sm(name(rows), (GEMV_WARPS * 32) as u32, smem);
    let choice = staged_choice(staged_mode(), n, k, ks, gpu.sm_count() as usize, per_sm)?;
    Ok(choice.map(|(rows, smem)| (name(rows), rows, smem)))
}

/// `gemv_staged`'s rule: (rows per warp group, dynamic shared bytes) of the staged kernel for `n x k` split `ks`
/// ways on `sms` SMs under `mode`, where `per_sm(rows, smem)` is how many blocks of that kernel an SM runs.
fn staged_choice(
    mode: Staged,
    n: usize,
    k: usize,
    ks: usize,
    sms: usize,
    mut per_sm: impl FnMut(usize, usize) -> Result<usize>,
) -> Result<Option<(usize, usize)>> {
    let blocks = |rows: usize| n.div_ceil(GEMV_WARPS / ks * rows);
    if mode == Staged::Never
        || k % 8 != 0
        || (mode == Staged::BeyondOneWave && blocks(GEMV_ROWS_PER_GROUP) <= GEMV_T1_BLOCKS_PER_SM * sms)
    {
        return Ok(None);
    }
    for rows in GEMV_STAGED_ROWS {
        let smem = gemv_staged_smem(k, ks, rows);
        if blocks(rows) <= per_sm(rows, smem)? * sms {
            return Ok(Some((rows, smem)));
        }
    }
    Ok(None)
}

/// Tests: the kernel a one-row GEMV of `n x k` launches now (with the input norm inside: `norm`) and its
/// grid's blocks.
#[cfg(any(test, feature = "test-hooks"))]
pub fn gemv_choice(gpu: &Gpu, n: usize, k: usize, norm: bool) -> Result<(String, usize)> {
    let ks = gemv_ksplit(n, k, gpu.sm_count() as usize);
    let plain = if norm { "dense_gemv_norm_t1" } else { "dense_gemv_t1" };
    let (name, rows, _) = gemv_staged(gpu, n, k, ks, norm)?.unwrap_or((plain, GEMV_ROWS_PER_GROUP, 0));
    Ok((name.to_string(), n.div_ceil(GEMV_WARPS / ks * rows)))
}

/// `out [T, N] (+)= x [T, K] * W^T` for T in 1..=8 with the own GEMV kernels
/// (any K; the fast kernels need K % 8 == 0, others take the simple kernel).
#[allow(clippy::too_many_arguments)]
pub fn gemv(
    gpu: &Gpu,
    x: &CudaSlice<f32>,
    w: &CudaSlice<bf16>,
    t: usize,
    n: usize,
    k: usize,
    out: &mut CudaSlice<f32>,
    write: Write,
) -> Result<()> {
    check_matmul(x, w, t, n, k, out)?;
    if t > GEMV_MAX_ROWS {
        return Err(invalid(format!("gemv: T = {t} rows, at most {GEMV_MAX_ROWS}")));
    }
    if t == 0 {
        return Ok(());
    }
    let (n_i, k_i, acc_i) = (n as i32, k as i32, (write == Write::Add) as i32);
    if k % 8 != 0 {
        let f = gpu.function("dense_matmul_simple")?;
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(GEMV_WARPS) as u32, t as u32, 1),
            block_dim: ((GEMV_WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = gpu.stream().launch_builder(&f);
        b.arg(x).arg(w).arg(out).arg(&n_i).arg(&k_i).arg(&acc_i);
        // SAFETY: dense_matmul_simple(const float* x [T,K], const bf16* w [N,K], float* out [T,N], int N, int K,
        // int accumulate);
        // lengths checked above, grid.y = T.
        unsafe { b.launch(cfg) }?;
        return Ok(());
    }
    let ks = gemv_ksplit(n, k, gpu.sm_count() as usize);
    let staged = if t == 1 { gemv_staged(gpu, n, k, ks, false)? } else { None };
    let (f, rows, smem) = match staged {
        Some((name, rows, smem)) => (gpu.function(name)?, rows, smem),
        None => (gpu.function(&format!("dense_gemv_t{t}"))?, GEMV_ROWS_PER_GROUP, 0),
    };
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(GEMV_WARPS / ks * rows) as u32, 1, 1),
        block_dim: ((GEMV_WARPS * 32) as u32, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    let mut a = KernelArgs::new();
    a.buf(gpu, x).buf(gpu, w).buf_mut(gpu, out).val(n_i).val(k_i).val(ks as i32).val(acc_i);
    // SAFETY: dense_gemv_tT and dense_gemv_staged_t1_rR(const float* x [T,K], const bf16* w [N,K], float* out
    // [T,N], int N, int K, int ksplit, int accumulate);
    // K % 8 == 0 keeps every 16-byte load inside its row and aligned (cudarc buffers are 256-byte aligned);
    // rows past N are clamped in the kernel and never stored; a staged kernel's dynamic shared memory is
    // gemv_staged_smem's (allowed by blocks_per_sm). Only W is read before strata_pdl_wait.
    unsafe { gpu.launch(&f, cfg, &mut a) }?;
    Ok(())
}

/// The RMSNorm a projection of a decode row applies to its input
/// (`gemv_rmsnorm`): `rmsnorm(x, w, eps)`, and optionally the non-finite
/// guard of x (`check`: flags and slot, as `rmsnorm_checked`).
pub struct NormIn<'a> {
    pub w: &'a CudaSlice<f32>,
    pub eps: f32,
    pub check: Option<(&'a mut CudaSlice<u32>, usize)>,
}

impl NormIn<'_> {
    /// `out = rmsnorm(x)` on its own launch (`rmsnorm`, or `rmsnorm_checked`
    /// with the guard).
    pub fn apply(self, gpu: &Gpu, x: &CudaSlice<f32>, out: &mut CudaSlice<f32>) -> Result<()> {
        match self.check {
            Some((flags, slot)) => rmsnorm_checked(gpu, x, self.w, self.eps, out, flags, slot),
            None => rmsnorm(gpu, x, self.w, self.eps, out),
        }
    }
}

/// `out [1, N] (+)= rmsnorm(x) [1, K] * W^T` with the norm inside the GEMV
/// (`dense_gemv_norm_t1`: every block normalizes x itself, so the norm costs
/// no launch). `normed` receives `rmsnorm(x)` when `store_normed` (later
/// kernels read it), and serves as the norm's output on the fallback path
/// (K % 8 != 0, or K not the norm's width: `rmsnorm` / `rmsnorm_checked`,
/// then `gemv`). The result equals `rmsnorm` then `gemv` up to the order of
/// the sum of squares.
#[allow(clippy::too_many_arguments)]
pub fn gemv_rmsnorm(
    gpu: &Gpu,
    x: &CudaSlice<f32>,
    norm: NormIn<'_>,
    normed: &mut CudaSlice<f32>,
    store_normed: bool,
    w: &CudaSlice<bf16>,
    n: usize,
    k: usize,
    out: &mut CudaSlice<f32>,
    write: Write,
) -> Result<()> {
    same("gemv_rmsnorm: x", x.len(), k)?;
    same("gemv_rmsnorm: normed", normed.len(), k)?;
    if let Some((flags, slot)) = &norm.check {
        if *slot >= flags.len() {
            return Err(invalid(format!("gemv_rmsnorm: slot {slot} of {} flags", flags.len())));
        }
    }
    if k % 8 != 0 || norm.w.len() != k {
        norm.apply(gpu, x, normed)?;
        return gemv(gpu, normed, w, 1, n, k, out, write);
    }
    check_matmul(x, w, 1, n, k, out)?;
    let (n_i, k_i, acc_i) = (n as i32, k as i32, (write == Write::Add) as i32);
    let ks = gemv_ksplit(n, k, gpu.sm_count() as usize);
    let staged = gemv_staged(gpu, n, k, ks, true)?;
    let (name, rows, smem) = staged.unwrap_or(("dense_gemv_norm_t1", GEMV_ROWS_PER_GROUP, 0));
    let f = gpu.function(name)?;
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(GEMV_WARPS / ks * rows) as u32, 1, 1),
        block_dim: ((GEMV_WARPS * 32) as u32, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    let slot_i = norm.check.as_ref().map_or(0, |(_, slot)| *slot as i32);
    let mut a = KernelArgs::new();
    a.buf(gpu, x).buf(gpu, norm.w).val(norm.eps);
    match norm.check {
        Some((flags, _)) => a.buf_mut(gpu, flags),
        None => a.null(),
    };
    a.val(slot_i);
    if store_normed {
        a.buf_mut(gpu, normed);
    } else {
        a.null();
    }
    a.buf(gpu, w).buf_mut(gpu, out).val(n_i).val(k_i).val(ks as i32).val(acc_i);
    // SAFETY: dense_gemv_norm_t1 and dense_gemv_staged_norm_t1_rR(const float* x [K], const float* g [K], float
    // eps, u32* flags (null or holding slot), int slot, float* normed (null or [K]), const bf16* w [N,K], float*
    // out [N], int N, int K, int ksplit, int accumulate): lengths checked above; K % 8 == 0 keeps the 16-byte
    // loads of W, x and g aligned and in bounds (cudarc buffers are 256-byte aligned); a staged kernel's dynamic
    // shared memory is gemv_staged_smem's (allowed by blocks_per_sm). Only W is read before strata_pdl_wait.
    unsafe { gpu.launch(&f, cfg, &mut a) }?;
    Ok(())
}

/// `out [T, N] (+)= bf16(x) [T, K] * W^T` through cuBLAS (bf16 inputs, f32
/// compute and output; `Write::Add` is beta = 1) for any T: x is first
/// rounded to bf16 into `scratch` (at least `T * K` elements), so results
/// differ from the f32 reference by about the bf16 rounding of x (~1e-3
/// relative).
#[allow(clippy::too_many_arguments)]
pub fn gemm(
    gpu: &Gpu,
    x: &CudaSlice<f32>,
    w: &CudaSlice<bf16>,
    t: usize,
    n: usize,
    k: usize,
    out: &mut CudaSlice<f32>,
    scratch: &mut CudaSlice<bf16>,
    write: Write,
) -> Result<()> {
    check_matmul(x, w, t, n, k, out)?;
    need("gemm: scratch", scratch.len(), t * k)?;
    if t == 0 {
        return Ok(());
    }
    convert_to_bf16(gpu, x, scratch, t * k)?;
    let beta = if write == Write::Add { 1.0f32 } else { 0.0 };
    cublas_gemm(gpu, w, &scratch.slice(..t * k), t, n, k, out, beta)
}

/// Operand precision of the cuBLAS path (rows > 8): x rounded to bf16, or
/// x as bf16 hi + lo with two GEMMs into the same f32 output (about 16
/// significant bits of x; the weights are bf16 either way).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GemmPrecision {
    #[default]
    Bf16,
    Split,
}

/// `gemm` with a choice of operand precision; `Split` needs a scratch of
/// `2 * T * K` (hi, then lo).
#[allow(clippy::too_many_arguments)]
pub fn gemm_with(
    gpu: &Gpu,
    x: &CudaSlice<f32>,
    w: &CudaSlice<bf16>,
    t: usize,
    n: usize,
    k: usize,
    out: &mut CudaSlice<f32>,
    scratch: &mut CudaSlice<bf16>,
    write: Write,
    precision: GemmPrecision,
) -> Result<()> {
    if precision == GemmPrecision::Bf16 {
        return gemm(gpu, x, w, t, n, k, out, scratch, write);
    }
    check_matmul(x, w, t, n, k, out)?;
    need("gemm: scratch (hi and lo)", scratch.len(), 2 * t * k)?;
    if t == 0 {
        return Ok(());
    }
    let f = gpu.function("dense_split_bf16")?;
    let n64 = (t * k) as u64;
    {
        let (mut hi, mut lo) = scratch.split_at_mut(t * k);
        let mut b = gpu.stream().launch_builder(&f);
        b.arg(x).arg(&mut hi).arg(&mut lo).arg(&n64);
        // SAFETY: dense_split_bf16(const float*, bf16* hi, bf16* lo, u64 n): x holds t*k floats, hi and lo
        // t*k bf16 each (the two halves of scratch, checked above).
        unsafe { b.launch(gpu.grid_stride_config(t * k)) }?;
    }
    let first = if write == Write::Add { 1.0f32 } else { 0.0 };
    cublas_gemm(gpu, w, &scratch.slice(..t * k), t, n, k, out, first)?;
    cublas_gemm(gpu, w, &scratch.slice(t * k..2 * t * k), t, n, k, out, 1.0)
}

/// `out (T x N, f32) = beta * out + xb (T x K, bf16) * W^T` through cuBLAS.
#[allow(clippy::too_many_arguments)]
fn cublas_gemm(
    gpu: &Gpu,
    w: &CudaSlice<bf16>,
    xb: &super::CudaView<'_, bf16>,
    t: usize,
    n: usize,
    k: usize,
    out: &mut CudaSlice<f32>,
    beta: f32,
) -> Result<()> {
    let blas = gpu.blas()?;
    let stream = gpu.stream();
    let alpha = 1.0f32;
    use cudarc::cublas::{result, sys};
    let (a, _ra) = w.device_ptr(stream);
    let (bx, _rb) = xb.device_ptr(stream);
    let (c, _rc) = out.device_ptr_mut(stream);
    // SAFETY: w holds N*K bf16, xb T*K bf16, out T*N f32 (the callers check); cuBLAS runs on gpu.stream().
    unsafe {
        result::gemm_ex(
            *blas.handle(),
            sys::cublasOperation_t::CUBLAS_OP_T,
            sys::cublasOperation_t::CUBLAS_OP_N,
            n as i32,
            t as i32,
            k as i32,
            (&alpha) as *const f32 as *const _,
            a as *const _,
            sys::cudaDataType_t::CUDA_R_16BF,
            k as i32,
            bx as *const _,
            sys::cudaDataType_t::CUDA_R_16BF,
            k as i32,
            (&beta) as *const f32 as *const _,
            c as *mut _,
            sys::cudaDataType_t::CUDA_R_32F,
            n as i32,
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }?;
    Ok(())
}

/// `matmul_with_scratch` / `matmul_add_with_scratch` with the cuBLAS
/// path's precision (the scratch holds `2 * T * K` for `Split`).
#[allow(clippy::too_many_arguments)]
pub fn project_with(
    gpu: &Gpu,
    x: &CudaSlice<f32>,
    w: &CudaSlice<bf16>,
    t: usize,
    n: usize,
    k: usize,
    out: &mut CudaSlice<f32>,
    scratch: &mut CudaSlice<bf16>,
    write: Write,
    precision: GemmPrecision,
) -> Result<()> {
    if t <= GEMV_MAX_ROWS {
        gemv(gpu, x, w, t, n, k, out, write)
    } else {
        gemm_with(gpu, x, w, t, n, k, out, scratch, write, precision)
    }
}

/// `out = bf16(x)` elementwise (round to nearest even, as `half::bf16::from_f32`).
pub fn f32_to_bf16(gpu: &Gpu, x: &CudaSlice<f32>, out: &mut CudaSlice<bf16>) -> Result<()> {
    same("f32_to_bf16: out", out.len(), x.len())?;
    convert_to_bf16(gpu, x, out, x.len())
}

/// The first `n` elements of x into out (lengths checked by the callers).
fn convert_to_bf16(gpu: &Gpu, x: &CudaSlice<f32>, out: &mut CudaSlice<bf16>, n: usize) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let f = gpu.function("dense_f32_to_bf16")?;
    let n64 = n as u64;
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(x).arg(out).arg(&n64);
    // SAFETY: dense_f32_to_bf16(const float*, bf16*, u64 n); both buffers hold at least n elements.
    unsafe { b.launch(gpu.grid_stride_config(n)) }?;
    Ok(())
}

// ---------------------------------------------------------------------------
// Norms.

fn check_norm(what: &str, x_len: usize, w_len: usize, out_len: usize) -> Result<(usize, i32, i32)> {
    let width = w_len;
    if width == 0 || x_len % width != 0 {
        return Err(invalid(format!("{what}: x holds {x_len} elements, not rows of the weight's {width}")));
    }
    same(&format!("{what}: out"), out_len, x_len)?;
    let rows = x_len / width;
    Ok((rows, check_i32(&format!("{what}: rows"), rows)?, check_i32(&format!("{what}: width"), width)?))
}

/// `out = x / sqrt(mean(x^2) + eps) * w` for each row of `x [rows, w.len()]`
/// (`ops::rmsnorm`; the per-head q/k norms are rows of head_dim).
/// Zero-centered norms pass `1 + w`, as the engine stores them.
pub fn rmsnorm(gpu: &Gpu, x: &CudaSlice<f32>, w: &CudaSlice<f32>, eps: f32, out: &mut CudaSlice<f32>) -> Result<()> {
    rmsnorm_launch(gpu, x, w, eps, out, None)
}

/// `rmsnorm` fused with the non-finite guard of its input: also
/// `flags[slot] = min(flags[slot], first flat index of a NaN/inf in x)`, as
/// `first_nonfinite(gpu, x, w.len(), flags, slot)` (the engine checks each
/// layer's output in the next layer's input norm: one launch fewer a layer).
pub fn rmsnorm_checked(
    gpu: &Gpu,
    x: &CudaSlice<f32>,
    w: &CudaSlice<f32>,
    eps: f32,
    out: &mut CudaSlice<f32>,
    flags: &mut CudaSlice<u32>,
    slot: usize,
) -> Result<()> {
    if slot >= flags.len() {
        return Err(invalid(format!("rmsnorm_checked: slot {slot} of {} flags", flags.len())));
    }
    if x.len() >= NONFINITE_NONE as usize {
        return Err(invalid(format!("rmsnorm_checked: {} elements do not fit a 32-bit index", x.len())));
    }
    let width = w.len();
    if !norm_vec_fits(width) {
        // No vector kernel for this width: the two launches.
        rmsnorm_launch(gpu, x, w, eps, out, None)?;
        return first_nonfinite(gpu, x, width, flags, slot);
    }
    rmsnorm_launch(gpu, x, w, eps, out, Some((flags, slot)))
}

/// float4s a thread of dense_rmsnorm_vec holds (DENSE_NORM_VEC), and its
/// most threads a block (DENSE_NORM_VEC_THREADS).
const NORM_VEC: usize = 8;
const NORM_VEC_THREADS: usize = 512;

/// Whether dense_rmsnorm_vec takes rows of `width`.
fn norm_vec_fits(width: usize) -> bool {
    width % 4 == 0 && width / 4 <= NORM_VEC * NORM_VEC_THREADS
}

fn rmsnorm_launch(
    gpu: &Gpu,
    x: &CudaSlice<f32>,
    w: &CudaSlice<f32>,
    eps: f32,
    out: &mut CudaSlice<f32>,
    check: Option<(&mut CudaSlice<u32>, usize)>,
) -> Result<()> {
    let (rows, rows_i, width_i) = check_norm("rmsnorm", x.len(), w.len(), out.len())?;
    if rows == 0 {
        return Ok(());
    }
    let width = w.len();
    let n4 = width / 4;
    // rmsnorm_checked passes a check only for widths the vector kernel takes.
    if norm_vec_fits(width) && (width > 512 || check.is_some()) {
        // Two float4s a thread where the block allows (every load issued up front).
        let threads = n4.div_ceil(2).next_multiple_of(32).clamp(32, NORM_VEC_THREADS);
        let threads = threads.max(n4.div_ceil(NORM_VEC).next_multiple_of(32));
        let cfg =
            LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (threads as u32, 1, 1), shared_mem_bytes: 0 };
        let f = gpu.function("dense_rmsnorm_vec")?;
        let slot_i = check.as_ref().map_or(0, |(_, slot)| *slot as i32);
        let mut a = KernelArgs::new();
        a.buf(gpu, x).buf(gpu, w).buf_mut(gpu, out).val(width_i).val(eps);
        match check {
            Some((flags, _)) => a.buf_mut(gpu, flags),
            None => a.null(),
        };
        a.val(slot_i);
        // SAFETY: dense_rmsnorm_vec(const float* x, const float* w, float* out, int width, float eps, u32* flags,
        // int slot): one block per row; x and out hold rows*width, w width (checked), width % 4 == 0 and
        // width / 4 <= 8 * threads; flags null or holding slot (checked by rmsnorm_checked); 16-byte aligned rows
        // (whole allocations, width % 4 == 0). Only w is read before strata_pdl_wait.
        unsafe { gpu.launch(&f, cfg, &mut a) }?;
        return Ok(());
    }
    debug_assert!(check.is_none(), "rmsnorm_checked falls back to two launches for width {width}");
    let (f, cfg) = if width <= 512 {
        let cfg = LaunchConfig {
            grid_dim: (rows.div_ceil(GEMV_WARPS) as u32, 1, 1),
            block_dim: ((GEMV_WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        (gpu.function("dense_rmsnorm_warp")?, cfg)
    } else {
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (row_block_threads(width), 1, 1),
            shared_mem_bytes: 0,
        };
        (gpu.function("dense_rmsnorm_block")?, cfg)
    };
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(x).arg(w).arg(out).arg(&rows_i).arg(&width_i).arg(&eps);
    // SAFETY: dense_rmsnorm_{warp,block}(const float* x, const float* w, float* out, int rows, int width,
    // float eps); x and out hold rows*width, w width (checked).
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// The residual add fused with the next norm: `x += y`, then
/// `out = rmsnorm(x)` (same numbers as `add` then `rmsnorm`).
pub fn add_rmsnorm(
    gpu: &Gpu,
    x: &mut CudaSlice<f32>,
    y: &CudaSlice<f32>,
    w: &CudaSlice<f32>,
    eps: f32,
    out: &mut CudaSlice<f32>,
) -> Result<()> {
    let (rows, rows_i, width_i) = check_norm("add_rmsnorm", x.len(), w.len(), out.len())?;
    same("add_rmsnorm: y", y.len(), x.len())?;
    if rows == 0 {
        return Ok(());
    }
    let f = gpu.function("dense_add_rmsnorm")?;
    let cfg = LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (row_block_threads(w.len()), 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(x).arg(y).arg(w).arg(out).arg(&rows_i).arg(&width_i).arg(&eps);
    // SAFETY: dense_add_rmsnorm(float* x, const float* y, const float* w, float* out, int rows, int width,
    // float eps); x, y, out hold rows*width, w width (checked).
    unsafe { b.launch(cfg) }?;
    Ok(())
}

// ---------------------------------------------------------------------------
// RoPE.

/// A `Rope` on the device: the inverse frequencies of the rotated pairs,
/// the attention factor and the rotated dims per head.
#[derive(Debug)]
pub struct RopeTable {
    pub inv_freq: CudaSlice<f32>,
    pub attention_factor: f32,
    pub rotary_dim: usize,
}

impl RopeTable {
    pub fn new(gpu: &Gpu, rope: &Rope) -> Result<RopeTable> {
        if rope.rotary_dim % 2 != 0 || rope.inv_freq.len() != rope.rotary_dim / 2 || rope.rotary_dim == 0 {
            return Err(invalid(format!(
                "RopeTable: rotary_dim {} with {} inverse frequencies",
                rope.rotary_dim,
                rope.inv_freq.len()
            )));
        }
        Ok(RopeTable {
            inv_freq: gpu.upload(&rope.inv_freq)?,
            attention_factor: rope.attention_factor,
            rotary_dim: rope.rotary_dim,
        })
    }
}

/// NeoX rotary embedding in place on the first `t` rows of
/// `x [t, heads, head_dim]`, row `i` at position `start_pos + i`
/// (`ops::rope`): pairs `(i, i + rotary_dim/2)` of the first `rotary_dim`
/// dims of each head, the rest pass through.
pub fn rope(
    gpu: &Gpu,
    x: &mut CudaSlice<f32>,
    t: usize,
    heads: usize,
    head_dim: usize,
    start_pos: usize,
    table: &RopeTable,
) -> Result<()> {
    if table.rotary_dim > head_dim {
        return Err(invalid(format!("rope: rotary_dim {} > head_dim {head_dim}", table.rotary_dim)));
    }
    need("rope: x", x.len(), t * heads * head_dim)?;
    let half = table.rotary_dim / 2;
    let pairs = t * heads * half;
    if pairs == 0 {
        return Ok(());
    }
    let (heads_i, hd_i, half_i) =
        (check_i32("rope: heads", heads)?, check_i32("rope: head_dim", head_dim)?, half as i32);
    let (pairs64, start64) = (pairs as u64, start_pos as u64);
    let f = gpu.function("dense_rope")?;
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(x)
        .arg(&table.inv_freq)
        .arg(&pairs64)
        .arg(&heads_i)
        .arg(&hd_i)
        .arg(&half_i)
        .arg(&start64)
        .arg(&table.attention_factor);
    // SAFETY: dense_rope(float* x, const float* inv_freq [half], u64 pairs, int heads, int head_dim, int half,
    // u64 start_pos, float attention_factor); x holds t*heads*head_dim (checked), pair i + half < head_dim.
    unsafe { b.launch(gpu.grid_stride_config(pairs)) }?;
    Ok(())
}

/// The per-head q/k norm and RoPE in one launch: `out = rope(rmsnorm(x))`
/// for `x, out [T, heads, head_dim]`, `w [head_dim]`, row `i` at position
/// `start_pos + i` (the same numbers as `rmsnorm` then `rope`).
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_rope(
    gpu: &Gpu,
    x: &CudaSlice<f32>,
    w: &CudaSlice<f32>,
    eps: f32,
    heads: usize,
    start_pos: usize,
    table: &RopeTable,
    out: &mut CudaSlice<f32>,
) -> Result<()> {
    rmsnorm_rope_launch(gpu, x, w, eps, heads, start_pos as u64, None, table, out)
}

/// `rmsnorm_rope` with start_pos read from `pos.buf[0]` on the device (a captured decode step): checks only the
/// shapes; no allocation, synchronization or host copy.
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_rope_at(
    gpu: &Gpu,
    x: &CudaSlice<f32>,
    w: &CudaSlice<f32>,
    eps: f32,
    heads: usize,
    pos: &crate::backend::cuda::attention::StepPos,
    table: &RopeTable,
    out: &mut CudaSlice<f32>,
) -> Result<()> {
    need("rmsnorm_rope_at: step", pos.buf.len(), 1)?;
    rmsnorm_rope_launch(gpu, x, w, eps, heads, 0, Some(&pos.buf), table, out)
}

#[allow(clippy::too_many_arguments)]
fn rmsnorm_rope_launch(
    gpu: &Gpu,
    x: &CudaSlice<f32>,
    w: &CudaSlice<f32>,
    eps: f32,
    heads: usize,
    start64: u64,
    step: Option<&CudaSlice<i32>>,
    table: &RopeTable,
    out: &mut CudaSlice<f32>,
) -> Result<()> {
    let head_dim = w.len();
    let (rows, rows_i, hd_i) = check_norm("rmsnorm_rope", x.len(), head_dim, out.len())?;
    if heads == 0 || rows % heads != 0 {
        return Err(invalid(format!("rmsnorm_rope: {rows} head rows are not rows of {heads} heads")));
    }
    if table.rotary_dim > head_dim {
        return Err(invalid(format!("rmsnorm_rope: rotary_dim {} > head_dim {head_dim}", table.rotary_dim)));
    }
    if rows == 0 {
        return Ok(());
    }
    let heads_i = check_i32("rmsnorm_rope: heads", heads)?;
    let half_i = (table.rotary_dim / 2) as i32;
    let f = gpu.function("dense_rmsnorm_rope")?;
    let cfg = LaunchConfig {
        grid_dim: (rows.div_ceil(GEMV_WARPS) as u32, 1, 1),
        block_dim: ((GEMV_WARPS * 32) as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let null_step = 0u64;
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(x)
        .arg(w)
        .arg(out)
        .arg(&rows_i)
        .arg(&heads_i)
        .arg(&hd_i)
        .arg(&eps)
        .arg(&table.inv_freq)
        .arg(&half_i)
        .arg(&start64)
        .arg(&table.attention_factor);
    match step {
        Some(s) => b.arg(s),
        None => b.arg(&null_step),
    };
    // SAFETY: dense_rmsnorm_rope(const float* x, const float* w, float* out, int rows, int heads, int head_dim,
    // float eps, const float* inv_freq [half], int half, u64 start_pos, float attention_factor, const int* step);
    // x and out hold rows*head_dim, w head_dim (checked), 2*half <= head_dim; step null or a StepPos's ints.
    unsafe { b.launch(cfg) }?;
    Ok(())
}

// ---------------------------------------------------------------------------
// Elementwise.

/// `x += y` (`ops::add`).
pub fn add(gpu: &Gpu, x: &mut CudaSlice<f32>, y: &CudaSlice<f32>) -> Result<()> {
    same("add: y", y.len(), x.len())?;
    let n = x.len();
    if n == 0 {
        return Ok(());
    }
    let f = gpu.function("dense_add")?;
    let n64 = n as u64;
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(x).arg(y).arg(&n64);
    // SAFETY: dense_add(float* x, const float* y, u64 n); both hold n.
    unsafe { b.launch(gpu.grid_stride_config(n)) }?;
    Ok(())
}

/// `out = silu(gate) * up` elementwise (the dense MLP's activation).
pub fn silu_mul(gpu: &Gpu, gate: &CudaSlice<f32>, up: &CudaSlice<f32>, out: &mut CudaSlice<f32>) -> Result<()> {
    same("silu_mul: up", up.len(), gate.len())?;
    same("silu_mul: out", out.len(), gate.len())?;
    let n = gate.len();
    if n == 0 {
        return Ok(());
    }
    let f = gpu.function("dense_silu_mul")?;
    let n64 = n as u64;
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(gate).arg(up).arg(out).arg(&n64);
    // SAFETY: dense_silu_mul(const float* gate, const float* up, float* out, u64 n); all hold n.
    unsafe { b.launch(gpu.grid_stride_config(n)) }?;
    Ok(())
}

/// `attn *= sigmoid(gate)` elementwise (`next_ops::apply_output_gate`).
pub fn output_gate(gpu: &Gpu, attn: &mut CudaSlice<f32>, gate: &CudaSlice<f32>) -> Result<()> {
    same("output_gate: gate", gate.len(), attn.len())?;
    let n = attn.len();
    if n == 0 {
        return Ok(());
    }
    let f = gpu.function("dense_output_gate")?;
    let n64 = n as u64;
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(attn).arg(gate).arg(&n64);
    // SAFETY: dense_output_gate(float* attn, const float* gate, u64 n); both hold n.
    unsafe { b.launch(gpu.grid_stride_config(n)) }?;
    Ok(())
}

/// `x = sigmoid(x)` in place (`next_ops::sigmoid`).
pub fn sigmoid(gpu: &Gpu, x: &mut CudaSlice<f32>) -> Result<()> {
    let n = x.len();
    if n == 0 {
        return Ok(());
    }
    let f = gpu.function("dense_sigmoid")?;
    let n64 = n as u64;
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(x).arg(&n64);
    // SAFETY: dense_sigmoid(float* x, u64 n).
    unsafe { b.launch(gpu.grid_stride_config(n)) }?;
    Ok(())
}

/// The shared expert's gated add: `out[t, :] += sigmoid(logit[t]) * y[t, :]`
/// for `out, y [T, width]`, `logit [T]` (the engine's `shared_expert`).
pub fn sigmoid_scale_add(
    gpu: &Gpu,
    out: &mut CudaSlice<f32>,
    y: &CudaSlice<f32>,
    logit: &CudaSlice<f32>,
    width: usize,
) -> Result<()> {
    same("sigmoid_scale_add: y", y.len(), out.len())?;
    same("sigmoid_scale_add: out", out.len(), logit.len() * width)?;
    let n = out.len();
    if n == 0 {
        return Ok(());
    }
    let width_i = check_i32("sigmoid_scale_add: width", width)?;
    let f = gpu.function("dense_sigmoid_scale_add")?;
    let n64 = n as u64;
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(out).arg(y).arg(logit).arg(&n64).arg(&width_i);
    // SAFETY: dense_sigmoid_scale_add(float* out, const float* y, const float* logit, u64 n, int width);
    // out, y hold n = T*width, logit T.
    unsafe { b.launch(gpu.grid_stride_config(n)) }?;
    Ok(())
}

/// Splits `qg [T, heads * 2 * head_dim]` (per head `[q_h | gate_h]`) into
/// `q` and `gate [T, heads * head_dim]` (`next_ops::split_q_gate`).
pub fn split_q_gate(
    gpu: &Gpu,
    qg: &CudaSlice<f32>,
    heads: usize,
    head_dim: usize,
    q: &mut CudaSlice<f32>,
    gate: &mut CudaSlice<f32>,
) -> Result<()> {
    let width = heads * head_dim;
    if width == 0 || q.len() % width != 0 {
        return Err(invalid(format!("split_q_gate: q holds {} elements, not rows of {width}", q.len())));
    }
    same("split_q_gate: gate", gate.len(), q.len())?;
    same("split_q_gate: qg", qg.len(), 2 * q.len())?;
    let n = q.len();
    if n == 0 {
        return Ok(());
    }
    let hd_i = check_i32("split_q_gate: head_dim", head_dim)?;
    let f = gpu.function("dense_split_q_gate")?;
    let n64 = n as u64;
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(qg).arg(q).arg(gate).arg(&n64).arg(&hd_i);
    // SAFETY: dense_split_q_gate(const float* qg [2n], float* q [n], float* gate [n], u64 n, int hd).
    unsafe { b.launch(gpu.grid_stride_config(n)) }?;
    Ok(())
}

/// `out [T, H] = table[ids[t]]` widened to f32, for the BF16 embedding
/// table `[V, H]` (V = table.len() / H). An id >= V cannot be checked here
/// (ids live on the device): its row becomes NaN, which the non-finite
/// guard reports.
pub fn embed(
    gpu: &Gpu,
    table: &CudaSlice<bf16>,
    ids: &CudaSlice<u32>,
    t: usize,
    hidden: usize,
    out: &mut CudaSlice<f32>,
) -> Result<()> {
    if hidden == 0 || table.len() % hidden != 0 {
        return Err(invalid(format!("embed: table holds {} elements, not rows of {hidden}", table.len())));
    }
    need("embed: ids", ids.len(), t)?;
    need("embed: out", out.len(), t * hidden)?;
    let vocab = u32::try_from(table.len() / hidden).map_err(|_| invalid("embed: vocabulary over 2^32".into()))?;
    let n = t * hidden;
    if n == 0 {
        return Ok(());
    }
    let h_i = check_i32("embed: hidden", hidden)?;
    let f = gpu.function("dense_embed")?;
    let n64 = n as u64;
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(table).arg(ids).arg(out).arg(&n64).arg(&h_i).arg(&vocab);
    // SAFETY: dense_embed(const bf16* table [V,H], const u32* ids [T], float* out [T,H], u64 n, int H, u32 V);
    // ids >= V are not read through.
    unsafe { b.launch(gpu.grid_stride_config(n)) }?;
    Ok(())
}

// ---------------------------------------------------------------------------
// Non-finite guard and argmax.

/// The flag value meaning "no NaN/inf seen".
pub const NONFINITE_NONE: u32 = u32::MAX;

/// Sets every slot of `flags` to `NONFINITE_NONE` (before a forward).
pub fn reset_flags(gpu: &Gpu, flags: &mut CudaSlice<u32>) -> Result<()> {
    let n = flags.len();
    if n == 0 {
        return Ok(());
    }
    let f = gpu.function("dense_fill_u32")?;
    let (v, n64) = (NONFINITE_NONE, n as u64);
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(flags).arg(&v).arg(&n64);
    // SAFETY: dense_fill_u32(u32* out, u32 value, u64 n).
    unsafe { b.launch(gpu.grid_stride_config(n)) }?;
    Ok(())
}

/// `flags[slot] = min(flags[slot], first flat index of a NaN/inf in x)`
/// for `x [rows, width]`; the engine reads the slots once after a forward:
/// `NONFINITE_NONE` means all finite, otherwise the bad row is
/// `index / width` (see `nonfinite_row`).
pub fn first_nonfinite(
    gpu: &Gpu,
    x: &CudaSlice<f32>,
    width: usize,
    flags: &mut CudaSlice<u32>,
    slot: usize,
) -> Result<()> {
    if width == 0 || x.len() % width != 0 {
        return Err(invalid(format!("first_nonfinite: x holds {} elements, not rows of {width}", x.len())));
    }
    if slot >= flags.len() {
        return Err(invalid(format!("first_nonfinite: slot {slot} of {} flags", flags.len())));
    }
    if x.len() >= NONFINITE_NONE as usize {
        return Err(invalid(format!("first_nonfinite: {} elements do not fit a 32-bit index", x.len())));
    }
    let n = x.len();
    if n == 0 {
        return Ok(());
    }
    let f = gpu.function("dense_first_nonfinite")?;
    let mut a = KernelArgs::new();
    a.buf(gpu, x).val(n as u64).buf_mut(gpu, flags).val(slot as i32);
    // SAFETY: dense_first_nonfinite(const float* x, u64 n, u32* flags, int slot); slot < flags.len(); it waits
    // for its predecessor (strata_pdl_wait) before touching memory.
    unsafe { gpu.launch(&f, gpu.grid_stride_config(n), &mut a) }?;
    Ok(())
}

/// The row and column of a flag value read back from `first_nonfinite`.
pub fn nonfinite_row(flag: u32, width: usize) -> Option<(usize, usize)> {
    (flag != NONFINITE_NONE).then(|| (flag as usize / width, flag as usize % width))
}

/// `out[r] = argmax(logits[r, :])` for the first `rows` rows of
/// `logits [rows, vocab]`: the largest value, the lowest index on ties
/// (`sampling::argmax`); the logits must be finite.
pub fn argmax(gpu: &Gpu, logits: &CudaSlice<f32>, rows: usize, vocab: usize, out: &mut CudaSlice<u32>) -> Result<()> {
    if vocab == 0 {
        return Err(invalid("argmax: empty vocabulary".into()));
    }
    need("argmax: logits", logits.len(), rows * vocab)?;
    need("argmax: out", out.len(), rows)?;
    if rows == 0 {
        return Ok(());
    }
    let v_i = check_i32("argmax: vocab", vocab)?;
    let chunks = vocab.div_ceil(ARGMAX_CHUNK);
    if rows > u16::MAX as usize {
        return Err(invalid(format!("argmax: {rows} rows (grid.y at most 65535)")));
    }
    // SAFETY: uninitialized; dense_argmax_partial writes every (row, chunk) before dense_argmax_final reads it.
    let mut part_v = unsafe { gpu.stream().alloc::<f32>(rows * chunks) }?;
    let mut part_i = unsafe { gpu.stream().alloc::<u32>(rows * chunks) }?;
    let f = gpu.function("dense_argmax_partial")?;
    let cfg = LaunchConfig {
        grid_dim: (chunks as u32, rows as u32, 1),
        block_dim: (ARGMAX_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(logits).arg(&mut part_v).arg(&mut part_i).arg(&v_i);
    // SAFETY: dense_argmax_partial(const float* logits [rows, V], float* part_v, u32* part_i [rows * chunks],
    // int V); grid = (chunks, rows).
    unsafe { b.launch(cfg) }?;
    let f = gpu.function("dense_argmax_final")?;
    let cfg = LaunchConfig {
        grid_dim: (rows.div_ceil(GEMV_WARPS) as u32, 1, 1),
        block_dim: ((GEMV_WARPS * 32) as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let (rows_i, chunks_i) = (rows as i32, chunks as i32);
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(&part_v).arg(&part_i).arg(out).arg(&rows_i).arg(&chunks_i);
    // SAFETY: dense_argmax_final(const float* part_v, const u32* part_i [rows * chunks], u32* out [rows], int rows,
    // int chunks); one warp per row.
    unsafe { b.launch(cfg) }?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The staged rule at the 30b-a3b decode shapes on 132 SMs, with an occupancy model of the H100/H200:
    /// 48 registers a thread (5 blocks of 256 threads), 228 KB of shared memory an SM (1 KB reserved a block,
    /// 1 KB of static shared memory), at most 227 KB a block.
    #[test]
    fn staged_takes_the_fewest_rows_that_fit_one_wave() {
        let per_sm = |_rows: usize, smem: usize| -> Result<usize> {
            Ok(if smem + 1024 > 227 << 10 { 0 } else { (5usize).min((228 << 10) / (smem + 2048)) })
        };
        let sms = 132;
        let choose = |mode, n, k| staged_choice(mode, n, k, gemv_ksplit(n, k, sms), sms, per_sm).unwrap();
        // q/k/v (5120 x 2048): 1280 plain blocks, 2.4 waves; 4 rows a group need 1280 blocks at 5 an SM (660),
        // 8 rows 640: one wave at 32 KB a block.
        assert_eq!(gemv_ksplit(5120, 2048, sms), 8);
        assert_eq!(choose(Staged::BeyondOneWave, 5120, 2048), Some((8, 8 * 8 * 512)));
        // o_proj (2048 x 4096) and the router (128 x 2048) fit one plain wave: staged only when always asked.
        assert_eq!(choose(Staged::BeyondOneWave, 2048, 4096), None);
        assert_eq!(choose(Staged::Always, 2048, 4096), Some((4, 8 * 2 * 4 * 512)));
        assert_eq!(choose(Staged::BeyondOneWave, 128, 2048), None);
        // The LM head (151936 x 2048) fits no one wave; K not a multiple of 8 never stages.
        assert_eq!(choose(Staged::Always, 151_936, 2048), None);
        assert_eq!(choose(Staged::Always, 64, 100), None);
        assert_eq!(choose(Staged::Never, 5120, 2048), None);
    }

    #[test]
    fn ksplit_fills_the_gpu_for_small_n() {
        // lm_head: plenty of rows, no split.
        assert_eq!(gemv_ksplit(151_936, 2048, 132), 1);
        // N = 2048, K = 2048: 64 blocks unsplit -> split 8 ways (512 blocks).
        assert_eq!(gemv_ksplit(2048, 2048, 132), 8);
        assert_eq!(gemv_ksplit(4096, 2048, 132), 8);
        // The stacked q/k/v of 30b-a3b: 1280 blocks, 2.4 waves.
        assert_eq!(gemv_ksplit(5120, 2048, 132), 8);
        // 8 ways would be 5.8 waves.
        assert_eq!(gemv_ksplit(12288, 2048, 132), 4);
        // The shared-expert gate (N = 1) splits K across all warps.
        assert_eq!(gemv_ksplit(1, 2048, 132), 8);
        // Never more warps than 256-wide steps of K.
        assert_eq!(gemv_ksplit(1, 512, 132), 2);
        assert_eq!(gemv_ksplit(1, 8, 132), 1);
    }

    #[test]
    fn row_block_threads_bounds() {
        assert_eq!(row_block_threads(1), 32);
        assert_eq!(row_block_threads(2048), 256);
        assert_eq!(row_block_threads(5000), 640);
        assert_eq!(row_block_threads(8192), 1024);
        assert_eq!(row_block_threads(100_000), 1024);
    }
}
