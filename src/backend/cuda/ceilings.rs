//! Measured ceilings of a device, the yardsticks the bench reports kernels
//! against: HBM bandwidth, BF16 tensor-core rate, pinned host-to-device
//! bandwidth (a copy), and the rate of reads in place from page-locked host
//! memory (what mapped decode's kernels do with experts in no slot). Each
//! is the median of several runs timed with CUDA events on the device's
//! stream, over random non-zero data (some memory systems compress zeros).

use cudarc::cublas::sys::cublasOperation_t;
use cudarc::cublas::{Gemm, GemmConfig};
use cudarc::driver::sys::CUevent_flags;

use super::{CudaSlice, Gpu, KernelArgs, HOST_DEVICE_MAP};
use crate::error::Result;

/// Timed runs per ceiling (after one warm-up run).
const REPEATS: usize = 9;
/// Bytes of the device-to-device copy: large enough that no cache holds it.
const HBM_COPY_BYTES: usize = 2 << 30;
/// Side of the square BF16 GEMM.
const GEMM_N: usize = 8192;
/// Bytes of the pinned host-to-device copy.
const H2D_BYTES: usize = 1 << 30;
/// Bytes of page-locked host memory read in place.
const IN_PLACE_BYTES: usize = 256 << 20;

/// The median of `REPEATS` timings (seconds) of `work` on the stream, after
/// one untimed warm-up call.
fn median_seconds(gpu: &Gpu, mut work: impl FnMut() -> Result<()>) -> Result<f64> {
    let ctx = gpu.context();
    let start = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
    let end = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
    work()?;
    gpu.sync()?;
    let mut times = Vec::with_capacity(REPEATS);
    for _ in 0..REPEATS {
        start.record(gpu.stream())?;
        work()?;
        end.record(gpu.stream())?;
        times.push(start.elapsed_ms(&end)? as f64 / 1e3);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[REPEATS / 2])
}

/// HBM bandwidth in bytes/s: a 2 GiB device-to-device copy, counting the
/// bytes read plus the bytes written.
pub fn hbm_bandwidth(gpu: &Gpu) -> Result<f64> {
    let words = HBM_COPY_BYTES / 4;
    let mut src: CudaSlice<u32> = gpu.alloc_zeros(words)?;
    gpu.fill_random_u32(&mut src, 0x5eed_0001)?;
    let mut dst: CudaSlice<u32> = gpu.alloc_zeros(words)?;
    let stream = gpu.stream().clone();
    let seconds = median_seconds(gpu, || Ok(stream.memcpy_dtod(&src, &mut dst)?))?;
    Ok(2.0 * HBM_COPY_BYTES as f64 / seconds)
}

/// BF16 tensor-core rate in FLOP/s: cuBLAS `C = A B` with 8192 x 8192 BF16
/// matrices and f32 accumulation (2 n^3 FLOP).
pub fn bf16_tensor_rate(gpu: &Gpu) -> Result<f64> {
    let blas = gpu.blas()?;
    let n = GEMM_N;
    let mut a: CudaSlice<half::bf16> = gpu.alloc_zeros(n * n)?;
    let mut b: CudaSlice<half::bf16> = gpu.alloc_zeros(n * n)?;
    gpu.fill_uniform_bf16(&mut a, 0x5eed_0002)?;
    gpu.fill_uniform_bf16(&mut b, 0x5eed_0003)?;
    let mut c: CudaSlice<half::bf16> = gpu.alloc_zeros(n * n)?;
    let cfg = GemmConfig {
        transa: cublasOperation_t::CUBLAS_OP_N,
        transb: cublasOperation_t::CUBLAS_OP_N,
        m: n as i32,
        n: n as i32,
        k: n as i32,
        alpha: half::bf16::ONE,
        lda: n as i32,
        ldb: n as i32,
        beta: half::bf16::ZERO,
        ldc: n as i32,
    };
    // SAFETY: a, b, c each hold n * n elements, matching m = n = k = lda = ldb = ldc = n.
    let seconds = median_seconds(gpu, || Ok(unsafe { blas.gemm(cfg, &a, &b, &mut c) }?))?;
    Ok(2.0 * (n as f64).powi(3) / seconds)
}

/// Page-locked host to device bandwidth in bytes/s: a 1 GiB copy.
pub fn h2d_pinned_bandwidth(gpu: &Gpu) -> Result<f64> {
    // SAFETY: the memory is written below before it is read.
    let mut host = unsafe { gpu.context().alloc_pinned_with_flags::<u8>(H2D_BYTES, 0) }?;
    let mut rng = crate::rng::Rng::new(0x5eed_0004);
    rng.fill_bytes(host.as_mut_slice()?);
    let mut dev: CudaSlice<u8> = gpu.alloc_zeros(H2D_BYTES)?;
    let stream = gpu.stream().clone();
    let seconds = median_seconds(gpu, || Ok(stream.memcpy_htod(&host, &mut dev)?))?;
    Ok(H2D_BYTES as f64 / seconds)
}

/// Reads in place from page-locked host memory in bytes/s: a kernel that
/// reads 256 MiB mapped into the device once, 16 bytes a lane
/// (`infra_read_u4`), as mapped decode's expert GEMVs read an expert in no
/// slot. Slower than the copy on some hosts (docs/performance.md).
pub fn host_read_in_place_bandwidth(gpu: &Gpu) -> Result<f64> {
    // SAFETY: the memory is written below before the kernel reads it.
    let mut host = unsafe { gpu.context().alloc_pinned_with_flags::<u8>(IN_PLACE_BYTES, HOST_DEVICE_MAP) }?;
    let mut rng = crate::rng::Rng::new(0x5eed_0005);
    rng.fill_bytes(host.as_mut_slice()?);
    let addr = gpu.mapped_host_address(host.as_mut_ptr()?)?;
    let mut sink: CudaSlice<u32> = gpu.alloc_zeros(1)?;
    let f = gpu.function("infra_read_u4")?;
    let words = IN_PLACE_BYTES / 16;
    let cfg = gpu.grid_stride_config(words);
    let seconds = median_seconds(gpu, || {
        let mut a = KernelArgs::new();
        a.val(addr).val(words as u64).buf_mut(gpu, &mut sink);
        // SAFETY: infra_read_u4(const uint4* x, u64 n, u32* sink) reads x[0..n), the mapped allocation's
        // IN_PLACE_BYTES (held by `host` until after the stream is synchronized below), and XORs into sink[0].
        unsafe { gpu.launch(&f, cfg, &mut a) }
    })?;
    gpu.sync()?;
    drop(host);
    Ok(IN_PLACE_BYTES as f64 / seconds)
}
