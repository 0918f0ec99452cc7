//! A sampled decode step's draw on the device (kernels/sampling.cu): the
//! token `sampling::Sampler` picks from one row of logits, by the same
//! arithmetic (so the same token), queued right after the logits so that
//! the next step does not wait for a draw on the host.

use super::{Gpu, KernelArgs, LaunchConfig};
use crate::error::{Error, Result};
use crate::sampling::{SamplingParams, MAX_LOGITS};
use cudarc::driver::CudaSlice;

/// Buckets of weight (16 an octave, 2^-40 .. 1): SAMP_BUCKETS.
const BUCKETS: usize = 641;
/// Bytes of `SampState` (kernels/sampling.cu): the largest logit's key,
/// then a count (u32) and a mass (u64) per bucket, padded to 8.
const STATE_BYTES: usize = 8 + (4 * BUCKETS).next_multiple_of(8) + 8 * BUCKETS;
const WEIGHT_THREADS: u32 = 256;
const PICK_THREADS: u32 = 1024;
/// `samp_pick`'s token when its input was not finite logits.
pub const DRAW_NONE: u32 = u32::MAX;

fn invalid(msg: String) -> Error {
    Error::InvalidArgument(msg)
}

/// The device buffers of the draws of one row of `vocab` logits.
pub struct DrawScratch {
    vocab: usize,
    state: CudaSlice<u64>,
    bits: CudaSlice<u32>,
    /// Two lists of keys (`samp_pick`'s selections).
    keys: [CudaSlice<u64>; 2],
    /// The token and whether the draw used `u` (`draw`'s result).
    pub out: CudaSlice<u32>,
}

impl DrawScratch {
    pub fn new(gpu: &Gpu, vocab: usize) -> Result<DrawScratch> {
        if vocab == 0 || vocab > MAX_LOGITS {
            return Err(invalid(format!("draw: {vocab} logits (1 to {MAX_LOGITS})")));
        }
        Ok(DrawScratch {
            vocab,
            state: gpu.alloc_zeros(STATE_BYTES / 8)?,
            bits: gpu.alloc_zeros(vocab)?,
            keys: [gpu.alloc_zeros(vocab)?, gpu.alloc_zeros(vocab)?],
            out: gpu.alloc_zeros(2)?,
        })
    }

    pub fn vocab(&self) -> usize {
        self.vocab
    }
}

/// Queues the draw of `params` with `u` (the random stream's next number)
/// from `logits` (one row, `s.vocab()` values, finite: else the token is
/// `DRAW_NONE`) into `s.out`: the token `Sampler::pick` gives, and 1 if the
/// draw used `u`. `params` must be valid (`Sampler::new` accepts them).
pub fn draw(gpu: &Gpu, logits: &CudaSlice<f32>, params: &SamplingParams, u: f64, s: &mut DrawScratch) -> Result<()> {
    let v = s.vocab;
    if logits.len() < v {
        return Err(invalid(format!("draw: {} logits for a vocabulary of {v}", logits.len())));
    }
    if !(0.0..1.0).contains(&u) {
        return Err(invalid(format!("draw: u {u} outside [0, 1)")));
    }
    let v_u = v as u32;
    let greedy = params.is_greedy();
    gpu.stream().memset_zeros(&mut s.state)?;
    let blocks = v.div_ceil(WEIGHT_THREADS as usize * 4).clamp(1, gpu.sm_count().max(1) as usize * 4) as u32;
    let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (WEIGHT_THREADS, 1, 1), shared_mem_bytes: 0 };
    let f = gpu.function("samp_max")?;
    let mut a = KernelArgs::new();
    a.buf(gpu, logits).val(v_u).buf_mut(gpu, &mut s.state);
    // SAFETY: samp_max(const float* logits [V], u32 V, SampState* st); st is STATE_BYTES, zeroed above; it waits
    // (strata_pdl_wait) before touching memory.
    unsafe { gpu.launch(&f, cfg, &mut a) }?;
    if !greedy {
        let f = gpu.function("samp_weights")?;
        let mut a = KernelArgs::new();
        a.buf(gpu, logits).val(v_u).val(params.temperature).buf_mut(gpu, &mut s.state).buf_mut(gpu, &mut s.bits);
        // SAFETY: samp_weights(const float* logits [V], u32 V, float T, SampState* st, u32* bits [V]); it waits
        // before touching global memory.
        unsafe { gpu.launch(&f, cfg, &mut a) }?;
    }
    let top_k = params.top_k.min(u32::MAX as usize) as u32;
    let (top_p, min_p) = (params.top_p, params.min_p);
    let f = gpu.function("samp_pick")?;
    let cfg = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (PICK_THREADS, 1, 1), shared_mem_bytes: 0 };
    let [keys_a, keys_c] = &mut s.keys;
    let mut a = KernelArgs::new();
    a.buf(gpu, logits).buf(gpu, &s.bits).val(v_u).buf(gpu, &s.state).val(greedy as i32).val(top_k).val(top_p);
    a.val(min_p).val(u).buf_mut(gpu, keys_a).buf_mut(gpu, keys_c).buf_mut(gpu, &mut s.out);
    // SAFETY: samp_pick(const float* logits [V], const u32* bits [V], u32 V, const SampState* st, int greedy,
    // u32 top_k, float top_p, float min_p, double u, u64* a [V], u64* c [V], u32* out [2]); one block; it waits
    // before touching memory.
    unsafe { gpu.launch(&f, cfg, &mut a) }?;
    Ok(())
}
