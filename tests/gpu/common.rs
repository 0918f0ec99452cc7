//! What every GPU test module shares.

// Each test module uses some of these helpers, the suite as a whole all.
#![allow(dead_code)]

use std::sync::Arc;

use strata::backend::cuda::{CudaSlice, Gpu};
use strata::rng::Rng;

/// A named test: Ok on success, Err with what went wrong.
pub type GpuTest = (&'static str, fn(&Arc<Gpu>) -> Result<(), String>);

/// Any error as the message of a failed test: `gpu.sync().map_err(e)?`.
pub fn e<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

/// `n` normal values times `scale`, the same for the same seed.
pub fn rand_f32(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    (0..n).map(|_| rng.normal() * scale).collect()
}

/// A device buffer of `n` NaNs: an output a kernel must overwrite entirely.
pub fn poisoned(gpu: &Gpu, n: usize) -> Result<CudaSlice<f32>, String> {
    let mut d = gpu.alloc_zeros::<f32>(n).map_err(e)?;
    gpu.fill_f32(&mut d, f32::NAN).map_err(e)?;
    Ok(d)
}

/// `got` matches `want` when max |got - want| <= rel_tol * max |want|
/// (the relative error of the whole tensor, so tiny entries do not need to
/// match digit by digit); any NaN or infinity in `got` fails. The message
/// names the worst index and both values.
pub fn check_close(what: &str, got: &[f32], want: &[f32], rel_tol: f32) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!("{what}: {} values, want {}", got.len(), want.len()));
    }
    if let Some(i) = got.iter().position(|v| !v.is_finite()) {
        return Err(format!("{what}: got[{i}] = {} (want {})", got[i], want[i]));
    }
    let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let (worst, diff) =
        got.iter().zip(want).map(|(g, w)| (g - w).abs()).enumerate().fold((0, 0.0f32), |best, (i, d)| {
            if d > best.1 {
                (i, d)
            } else {
                best
            }
        });
    let rel = if scale > 0.0 { diff / scale } else { diff };
    if rel > rel_tol {
        return Err(format!(
            "{what}: max |got - want| / max |want| = {rel:.3e} > {rel_tol:.1e} (worst at [{worst}]: got {}, want {}; \
             max |want| = {scale:.4e})",
            got[worst], want[worst]
        ));
    }
    Ok(())
}
