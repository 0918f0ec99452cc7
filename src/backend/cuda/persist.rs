//! CUDA launch wrappers for kernels/persist.cu: persistent grids whose blocks
//! stay resident across a chain of dependent steps, meet at a barrier across
//! the grid, and stream the weights of the steps ahead into shared memory
//! meanwhile (see the kernel file). `GemvChain` measures that design on a
//! chain of BF16 GEMVs against the same chain as `dense::gemv` launches
//! (the GPU suite's `persist_gemv_chain_timing`; docs/performance.md).

use half::bf16;

use super::{CudaSlice, DevicePtr, Gpu, LaunchConfig, PushKernelArg};
use crate::error::{Error, Result};

/// Most matrices of a chain (`PERSIST_MAX_M`).
pub const MAX_CHAIN: usize = 64;
/// The widest input of a chain's matrix (`PERSIST_MAX_K`).
pub const MAX_K: usize = 4096;
/// Most rows of one matrix a block owns (`PERSIST_MAX_ROWS`).
const MAX_ROWS: usize = 64;
/// Threads of a block, ring slot bytes and slots (`PERSIST_THREADS`, `_CHUNK`, `_STAGES`).
const THREADS: u32 = 512;
const CHUNK: usize = 16384;
const STAGES: usize = 11;

fn invalid(msg: String) -> Error {
    Error::InvalidArgument(msg)
}

/// A chain `y_{m+1} = W_m y_m` of BF16 matrices on one device, ready to
/// run as one persistent launch (`persist_gemv_chain`).
pub struct GemvChain {
    /// Two u64 a matrix: its device address, then `n | k << 32`.
    table: CudaSlice<u64>,
    /// (n, k) of each matrix.
    dims: Vec<(usize, usize)>,
    /// The grid barrier's two counters.
    bar: CudaSlice<u32>,
    blocks: usize,
}

impl GemvChain {
    /// The chain of `mats` (`W_m` with its `[n, k]`): consecutive shapes
    /// must chain (`k_{m+1} = n_m`); every k a multiple of 512 up to
    /// `MAX_K` (a ring slot holds whole rows); each of the device's blocks
    /// (one per SM) owns at most 64 rows of a matrix. The matrices must
    /// outlive the chain (it holds their addresses).
    pub fn new(gpu: &Gpu, mats: &[(&CudaSlice<bf16>, usize, usize)]) -> Result<GemvChain> {
        if mats.is_empty() || mats.len() > MAX_CHAIN {
            return Err(invalid(format!("GemvChain: {} matrices, want 1..={MAX_CHAIN}", mats.len())));
        }
        if gpu.compute_capability().0 < 8 {
            return Err(invalid("GemvChain: the persistent kernel needs sm_80 or later (cp.async)".into()));
        }
        let blocks = gpu.sm_count() as usize;
        let mut table = Vec::with_capacity(2 * mats.len());
        let mut dims = Vec::with_capacity(mats.len());
        for (m, &(w, n, k)) in mats.iter().enumerate() {
            if k == 0 || k % 512 != 0 || k > MAX_K || n == 0 || n.div_ceil(blocks) > MAX_ROWS {
                return Err(invalid(format!(
                    "GemvChain: matrix {m} is [{n}, {k}]: k must be a multiple of 512 up to {MAX_K}, n at most \
                     {} on {blocks} SMs",
                    MAX_ROWS * blocks
                )));
            }
            if w.len() != n * k {
                return Err(invalid(format!("GemvChain: matrix {m} has {} elements, want {n} x {k}", w.len())));
            }
            if let Some(&(pn, _)) = dims.last() {
                if pn != k {
                    return Err(invalid(format!("GemvChain: matrix {m} takes {k} inputs, the one before gives {pn}")));
                }
            }
            let (ptr, _sync) = w.device_ptr(gpu.stream());
            table.push(ptr);
            table.push(n as u64 | (k as u64) << 32);
            dims.push((n, k));
        }
        Ok(GemvChain { table: gpu.upload(&table)?, dims, bar: gpu.alloc_zeros(2)?, blocks })
    }

    /// The widest vector of the chain (the length `ya` and `yb` need).
    pub fn width(&self) -> usize {
        self.dims.iter().map(|&(n, k)| n.max(k)).max().unwrap_or(0)
    }

    /// Bytes of weights one run reads.
    pub fn weight_bytes(&self) -> usize {
        self.dims.iter().map(|&(n, k)| 2 * n * k).sum()
    }

    /// Runs the chain from `y_0` in `ya`: `y_m` lands in `ya` for even m,
    /// `yb` for odd, so the result is in `yb` for an odd chain length, `ya`
    /// for an even one. Needs the device to itself while it runs (its
    /// barrier waits for every block; a plain launch of one block per SM).
    pub fn run(&mut self, gpu: &Gpu, ya: &mut CudaSlice<f32>, yb: &mut CudaSlice<f32>) -> Result<()> {
        let w = self.width();
        if ya.len() < w || yb.len() < w {
            return Err(invalid(format!("GemvChain::run: vectors of {} and {}, want {w}", ya.len(), yb.len())));
        }
        let f = gpu.function("persist_gemv_chain")?;
        let smem = STAGES * CHUNK + MAX_K * 4;
        f.set_attribute(
            cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem as i32,
        )?;
        let cfg = LaunchConfig {
            grid_dim: (self.blocks as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let m = self.dims.len() as i32;
        let mut b = gpu.stream().launch_builder(&f);
        b.arg(&self.table).arg(&m).arg(ya).arg(yb).arg(&mut self.bar);
        // SAFETY: persist_gemv_chain(const PersistGemv* chain [m] (two u64 each: address, n | k << 32), int m,
        // float* ya, float* yb, unsigned* bar [2]); shapes checked in new (chaining, k, rows per block), the
        // vectors' lengths above; the matrices outlive the chain (new's contract); one block per SM, each
        // resident (its shared memory allows one), the device otherwise idle (run's contract).
        unsafe { b.launch(cfg) }?;
        Ok(())
    }
}
