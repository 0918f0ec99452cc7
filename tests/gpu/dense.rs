//! GPU tests of kernels/dense.cu against the CPU reference
//! (strata::backend::cpu::{ops, next_ops}, Rope, the greedy sampler) on
//! fresh random inputs, outputs poisoned with NaN before each launch.
//!
//! Tolerances (check_close: max |got - want| / max |want|):
//! - GEMV (T <= 8): the same bf16-decoded weights and f32 x on both sides,
//!   f32 accumulation; only the summation order differs: 1e-5.
//! - cuBLAS (T > 8): x is rounded to bf16 on the device. Against the CPU on
//!   the same bf16-rounded x: 1e-4 (f32 accumulation, other order / tiles);
//!   against the CPU on the f32 x: 1e-2 (the bf16 rounding of x, ~2^-9).
//! - RMSNorm: summation order of mean(x^2) only: 1e-5.
//! - RoPE: the same f32 angle; device cosf/sinf are within 2 ulp of the
//!   host's: 1e-5. Dims past rotary_dim must be untouched (bit-exact).
//! - exp-based ops (silu, sigmoid): expf within 2 ulp of the host's: 1e-6.
//! - add, split, embed, bf16 rounding, the guard, argmax: exact.

use std::sync::Arc;
use std::time::Instant;

use half::bf16;
use rayon::prelude::*;
use strata::backend::cpu::{next_ops, ops};
use strata::backend::cuda::dense::{self, RopeTable, Write, NONFINITE_NONE};
use strata::backend::cuda::{CudaSlice, Gpu};
use strata::backend::{Matrix, Rope};
use strata::model::{Arch, ModelConfig, RopeScaling};
use strata::sampling::Sampler;

use super::common::{check_close, e, poisoned, rand_f32, GpuTest};

pub const TESTS: &[GpuTest] = &[
    ("dense_matmul_gemv_small_t", matmul_gemv_small_t),
    ("dense_matmul_cublas_large_t", matmul_cublas_large_t),
    ("dense_matmul_add_residual", matmul_add_residual),
    ("dense_matmul_rejects_bad_shapes", matmul_rejects_bad_shapes),
    ("dense_rmsnorm_widths", rmsnorm_widths),
    ("dense_add_rmsnorm_fused", add_rmsnorm_fused),
    ("dense_rmsnorm_checked_flags", rmsnorm_checked_flags),
    ("dense_gemv_rmsnorm_fused", gemv_rmsnorm_fused),
    ("dense_gemv_staged_matches_plain", gemv_staged_matches_plain),
    ("dense_rope_full_partial_yarn", rope_full_partial_yarn),
    ("dense_rmsnorm_rope_fused", rmsnorm_rope_fused),
    ("dense_rmsnorm_rope_step_pointer", rmsnorm_rope_step_pointer),
    ("dense_elementwise_ops", elementwise_ops),
    ("dense_split_q_gate_layout", split_q_gate_layout),
    ("dense_embed_gathers_rows", embed_gathers_rows),
    ("dense_f32_to_bf16_rounding", f32_to_bf16_rounding),
    ("dense_first_nonfinite_guard", first_nonfinite_guard),
    ("dense_argmax_ties_lowest_index", argmax_ties_lowest_index),
    ("dense_timing", timing),
];

/// Random weights `[n, k]` as bf16 and their exact f32 values.
fn bf16_weights(seed: u64, n: usize, k: usize, scale: f32) -> (Vec<bf16>, Matrix) {
    let w: Vec<bf16> = rand_f32(seed, n * k, scale).into_iter().map(bf16::from_f32).collect();
    let dec = w.iter().map(|v| v.to_f32()).collect();
    (w, Matrix::new(n, k, dec))
}

fn round_bf16(x: &[f32]) -> Vec<f32> {
    x.iter().map(|&v| bf16::from_f32(v).to_f32()).collect()
}

/// A poisoned output with `extra` NaNs past the `n` the kernel writes; the
/// tail must still be NaN afterwards (no stores past the output).
fn check_tail(what: &str, got: &[f32], n: usize) -> Result<(), String> {
    if let Some(i) = got[n..].iter().position(|v| !v.is_nan()) {
        return Err(format!("{what}: wrote past the output at [{}] = {}", n + i, got[n + i]));
    }
    Ok(())
}

/// Each dot product against its exact (f64) value over the same operands:
/// |got - exact| <= tol * sum_k |x_k w_k|, the scale of f32 accumulation
/// error whatever the sign cancellation (a dropped or wrongly rounded term
/// of size ~|x w| exceeds it by far).
fn check_dots(what: &str, got: &[f32], x: &[f32], w: &Matrix, tol: f64) -> Result<(), String> {
    let (n, k) = (w.rows, w.cols);
    let worst = got
        .par_chunks(n)
        .zip(x.par_chunks(k))
        .enumerate()
        .flat_map_iter(|(t, (grow, xr))| {
            (0..n).map(move |j| {
                let (mut exact, mut mag) = (0.0f64, 0.0f64);
                for (&a, &b) in xr.iter().zip(w.row(j)) {
                    let p = a as f64 * b as f64;
                    exact += p;
                    mag += p.abs();
                }
                let ratio = (grow[j] as f64 - exact).abs() / (tol * mag).max(f64::MIN_POSITIVE);
                (ratio, t, j, grow[j], exact)
            })
        })
        .reduce(|| (0.0, 0, 0, 0.0, 0.0), |a, b| if b.0 > a.0 || b.0.is_nan() { b } else { a });
    if worst.0.is_nan() || worst.0 > 1.0 {
        return Err(format!(
            "{what}: [{}, {}] = {}, exact {} (error {:.2} x the bound {tol:.0e} * sum |x w|)",
            worst.1, worst.2, worst.3, worst.4, worst.0
        ));
    }
    Ok(())
}

/// `dense::gemv_rmsnorm` against `ops::rmsnorm` then the exact dot products:
/// fused (K % 8 == 0) and fallback (K % 8 != 0) paths, small and real N, the
/// normed row stored or not, the guard of x set or left alone.
fn gemv_rmsnorm_fused(gpu: &Arc<Gpu>) -> Result<(), String> {
    for (n, k) in [(1usize, 2048usize), (5, 136), (128, 2048), (5120, 2048), (4097, 2048), (33, 100)] {
        let (w, wm) = bf16_weights(80 + n as u64, n, k, 0.05);
        let wd = gpu.upload(&w).map_err(e)?;
        let g: Vec<f32> = rand_f32(81, k, 0.3).iter().map(|v| 1.0 + v).collect();
        let gd = gpu.upload(&g).map_err(e)?;
        // A residual stream of large magnitude: a skipped norm is off by ~30x.
        let x = rand_f32(82 + k as u64, k, 30.0);
        let xd = gpu.upload(&x).map_err(e)?;
        let mut want_h = vec![0.0f32; k];
        ops::rmsnorm(&x, &g, 1e-6, &mut want_h);
        for (store, checked) in [(true, true), (false, false), (true, false)] {
            let what = format!("gemv_rmsnorm N={n} K={k} store {store} checked {checked}");
            let mut normed = poisoned(gpu, k)?;
            let mut out = poisoned(gpu, n)?;
            let mut flags = gpu.alloc_zeros::<u32>(2).map_err(e)?;
            dense::reset_flags(gpu, &mut flags).map_err(e)?;
            let norm = dense::NormIn { w: &gd, eps: 1e-6, check: checked.then_some((&mut flags, 1)) };
            dense::gemv_rmsnorm(gpu, &xd, norm, &mut normed, store, &wd, n, k, &mut out, Write::Store).map_err(e)?;
            check_dots(&what, &gpu.download(&out).map_err(e)?, &want_h, &wm, 1e-5)?;
            if store {
                check_close(&format!("{what}: normed"), &gpu.download(&normed).map_err(e)?, &want_h, 1e-5)?;
            }
            let got = gpu.download(&flags).map_err(e)?;
            if got != [NONFINITE_NONE, NONFINITE_NONE] {
                return Err(format!("{what}: flags {got:?} for a finite x"));
            }
        }
        // The guard: the first bad element's index in the checked slot, nothing without a check.
        let mut bad = x.clone();
        bad[k - 3] = f32::INFINITY;
        bad[k / 2 + 1] = f32::NAN;
        let bd = gpu.upload(&bad).map_err(e)?;
        for checked in [true, false] {
            let mut normed = poisoned(gpu, k)?;
            let mut out = poisoned(gpu, n)?;
            let mut flags = gpu.alloc_zeros::<u32>(2).map_err(e)?;
            dense::reset_flags(gpu, &mut flags).map_err(e)?;
            let norm = dense::NormIn { w: &gd, eps: 1e-6, check: checked.then_some((&mut flags, 1)) };
            dense::gemv_rmsnorm(gpu, &bd, norm, &mut normed, false, &wd, n, k, &mut out, Write::Store).map_err(e)?;
            let want = if checked { (k / 2 + 1) as u32 } else { NONFINITE_NONE };
            let got = gpu.download(&flags).map_err(e)?;
            if got != [NONFINITE_NONE, want] {
                return Err(format!("gemv_rmsnorm N={n} K={k} checked {checked}: flags {got:?}, want slot 1 = {want}"));
            }
        }
    }
    // A slot past the flags is refused before any launch.
    let (x, g) = (gpu.upload(&rand_f32(1, 64, 1.0)).map_err(e)?, gpu.upload(&rand_f32(2, 64, 1.0)).map_err(e)?);
    let wd = gpu.upload(&[bf16::ONE; 64]).map_err(e)?;
    let (mut normed, mut out) = (poisoned(gpu, 64)?, poisoned(gpu, 1)?);
    let mut flags = gpu.alloc_zeros::<u32>(2).map_err(e)?;
    let norm = dense::NormIn { w: &g, eps: 1e-6, check: Some((&mut flags, 2)) };
    if dense::gemv_rmsnorm(gpu, &x, norm, &mut normed, false, &wd, 1, 64, &mut out, Write::Store).is_ok() {
        return Err("gemv_rmsnorm accepted slot 2 of 2 flags".into());
    }
    Ok(())
}

/// The staged one-row GEMVs (every weight requested into shared memory before the wait) against the plain
/// kernels: bit for bit (the same sums in the same order), plain and with the input norm, stored and added to a
/// residual, and against the exact dot products. Shapes: the 30b-a3b decode projections (qkv takes a staged
/// kernel by default), N not a multiple of a block's rows, K not a multiple of a step, several steps a warp.
/// A `test-hooks` build forces each mode (`dense::force_gemv_staged`); without, the default path only.
fn gemv_staged_matches_plain(gpu: &Arc<Gpu>) -> Result<(), String> {
    #[cfg(feature = "test-hooks")]
    {
        let mut staged_seen = 0;
        for (n, k) in
            [(5120usize, 2048usize), (2048, 4096), (128, 2048), (4097, 2048), (33, 2056), (3, 8), (9000, 1024)]
        {
            let (w, wm) = bf16_weights(90 + n as u64, n, k, 0.05);
            let wd = gpu.upload(&w).map_err(e)?;
            let g: Vec<f32> = rand_f32(91, k, 0.3).iter().map(|v| 1.0 + v).collect();
            let gd = gpu.upload(&g).map_err(e)?;
            let x = rand_f32(92 + k as u64, k, 3.0);
            let xd = gpu.upload(&x).map_err(e)?;
            let resid = rand_f32(93, n, 1.0);
            let mut want_normed = vec![0.0f32; k];
            ops::rmsnorm(&x, &g, 1e-6, &mut want_normed);
            // [plain, normed] x [store, add] per mode.
            let mut runs: Vec<(String, Vec<Vec<f32>>)> = Vec::new();
            for mode in [0u8, 2] {
                dense::force_gemv_staged(Some(mode));
                let result = (|| -> Result<(String, Vec<Vec<f32>>), String> {
                    let kernel = format!(
                        "{} / {}",
                        dense::gemv_choice(gpu, n, k, false).map_err(e)?.0,
                        dense::gemv_choice(gpu, n, k, true).map_err(e)?.0
                    );
                    let mut outs = Vec::new();
                    for (normed_in, write) in
                        [(false, Write::Store), (false, Write::Add), (true, Write::Store), (true, Write::Add)]
                    {
                        let mut out = match write {
                            Write::Add => gpu.upload(&resid).map_err(e)?,
                            Write::Store => poisoned(gpu, n)?,
                        };
                        if normed_in {
                            let mut normed = poisoned(gpu, k)?;
                            let norm = dense::NormIn { w: &gd, eps: 1e-6, check: None };
                            dense::gemv_rmsnorm(gpu, &xd, norm, &mut normed, false, &wd, n, k, &mut out, write)
                                .map_err(e)?;
                        } else {
                            dense::gemv(gpu, &xd, &wd, 1, n, k, &mut out, write).map_err(e)?;
                        }
                        outs.push(gpu.download(&out).map_err(e)?);
                    }
                    Ok((kernel, outs))
                })();
                dense::force_gemv_staged(None);
                runs.push(result?);
            }
            let (plain, staged) = (&runs[0], &runs[1]);
            if staged.0.contains("staged") {
                staged_seen += 1;
            }
            for (i, (a, b)) in plain.1.iter().zip(&staged.1).enumerate() {
                let what = format!("N={n} K={k} case {i} ({} against {})", staged.0, plain.0);
                if let Some(j) = (0..n).find(|&j| a[j].to_bits() != b[j].to_bits()) {
                    return Err(format!("{what}: [{j}] = {} staged, {} plain", b[j], a[j]));
                }
                // Against the exact dots (the residual taken off again for the added cases).
                let got: Vec<f32> =
                    if i % 2 == 1 { b.iter().zip(&resid).map(|(v, r)| v - r).collect() } else { b.clone() };
                let xin = if i >= 2 { &want_normed } else { &x };
                let tol = if i % 2 == 1 { 1e-4 } else { 1e-5 };
                check_dots(&what, &got, xin, &wm, tol)?;
            }
        }
        // The 30b-a3b qkv (5120 x 2048) must have taken a staged kernel in the forced mode at least.
        if staged_seen == 0 {
            return Err("no shape took a staged kernel with the staged mode forced on".into());
        }
    }
    #[cfg(not(feature = "test-hooks"))]
    let _ = gpu;
    Ok(())
}

/// `dense::matmul` (the path it picks for each T) against `ops::matmul`
/// and the exact dot products, for one random weight `[n, k]` and each T.
fn check_matmul(gpu: &Gpu, ts: &[usize], n: usize, k: usize, seed: u64) -> Result<(), String> {
    let (w, wm) = bf16_weights(seed, n, k, 0.05);
    let wd = gpu.upload(&w).map_err(e)?;
    for &t in ts {
        let what = format!("matmul T={t} N={n} K={k}");
        let x = rand_f32(seed + t as u64, t * k, 1.0);
        let xd = gpu.upload(&x).map_err(e)?;
        let mut out = poisoned(gpu, t * n + 5)?;
        dense::matmul(gpu, &xd, &wd, t, n, k, &mut out).map_err(e)?;
        let got = gpu.download(&out).map_err(e)?;
        check_tail(&what, &got, t * n)?;
        let got = &got[..t * n];
        let mut want = vec![0.0f32; t * n];
        if t <= dense::GEMV_MAX_ROWS {
            // f32 x and f32 accumulation: only the order of the sums differs.
            check_dots(&format!("{what} (GEMV)"), got, &x, &wm, 1e-6)?;
            // Relative to max |want|: meaningless for a handful of outputs
            // that may all be near 0 (check_dots covers those).
            if t * n >= 64 {
                ops::matmul(&x, &wm, &mut want);
                check_close(&format!("{what} (GEMV vs ops::matmul)"), got, &want, 1e-5)?;
            }
        } else {
            // cuBLAS multiplies bf16(x): exact against the rounded x, ~2^-9 off the f32 x.
            let xr = round_bf16(&x);
            check_dots(&format!("{what} (cuBLAS vs bf16(x))"), got, &xr, &wm, 1e-5)?;
            if t * n >= 64 {
                ops::matmul(&xr, &wm, &mut want);
                check_close(&format!("{what} (cuBLAS vs ops::matmul on bf16(x))"), got, &want, 1e-4)?;
                ops::matmul(&x, &wm, &mut want);
                check_close(&format!("{what} (cuBLAS vs ops::matmul on f32 x)"), got, &want, 1e-2)?;
            }
        }
    }
    Ok(())
}

fn matmul_gemv_small_t(gpu: &Arc<Gpu>) -> Result<(), String> {
    // lm_head-like (vocab truncated), the shared-expert gate (N = 1), q/o
    // projections, odd N, K not a multiple of 256, K not a multiple of 8
    // (the simple kernel), K = 8192.
    let shapes = [(30000, 2048), (1, 2048), (4096, 2048), (1027, 512), (37, 264), (5, 100), (2048, 8192), (3, 8)];
    for (i, (n, k)) in shapes.into_iter().enumerate() {
        check_matmul(gpu, &[1, 2, 3, 4, 5, 6, 7, 8], n, k, 10 + 100 * i as u64)?;
    }
    Ok(())
}

fn matmul_cublas_large_t(gpu: &Arc<Gpu>) -> Result<(), String> {
    check_matmul(gpu, &[9, 64], 30000, 2048, 1000)?;
    check_matmul(gpu, &[9, 300], 1, 2048, 1100)?;
    check_matmul(gpu, &[64, 300], 4096, 2048, 1200)?;
    check_matmul(gpu, &[300, 17], 1027, 520, 1300)?;
    // The cuBLAS path at small T with the caller's scratch (the engine may pass one).
    let (t, n, k) = (3, 515, 2048);
    let x = rand_f32(7, t * k, 1.0);
    let (w, wm) = bf16_weights(8, n, k, 0.05);
    let (xd, wd) = (gpu.upload(&x).map_err(e)?, gpu.upload(&w).map_err(e)?);
    let mut scratch = gpu.alloc_zeros::<bf16>(t * k + 3).map_err(e)?;
    let mut out = poisoned(gpu, t * n)?;
    dense::gemm(gpu, &xd, &wd, t, n, k, &mut out, &mut scratch, Write::Store).map_err(e)?;
    let mut want = vec![0.0f32; t * n];
    ops::matmul(&round_bf16(&x), &wm, &mut want);
    check_close("gemm T=3 (cuBLAS vs bf16(x))", &gpu.download(&out).map_err(e)?, &want, 1e-4)?;
    // matmul_with_scratch at T = 3 takes the GEMV (exact x).
    let mut out = poisoned(gpu, t * n)?;
    dense::matmul_with_scratch(gpu, &xd, &wd, t, n, k, &mut out, &mut scratch).map_err(e)?;
    ops::matmul(&x, &wm, &mut want);
    check_close("matmul_with_scratch T=3", &gpu.download(&out).map_err(e)?, &want, 1e-5)
}

/// `matmul_add` (out += x W^T, the residual add fused) against
/// `ops::matmul` then `ops::add`, on the GEMV (exact x), the simple kernel
/// and cuBLAS (bf16 x) paths.
fn matmul_add_residual(gpu: &Arc<Gpu>) -> Result<(), String> {
    for (t, n, k, tol) in [(1, 2048, 4096, 1e-5), (8, 2048, 512, 1e-5), (3, 77, 100, 1e-5), (64, 2048, 1024, 1e-2)] {
        let what = format!("matmul_add T={t} N={n} K={k}");
        let x = rand_f32(2000 + t as u64, t * k, 1.0);
        let resid = rand_f32(2100 + t as u64, t * n, 1.0);
        let (w, wm) = bf16_weights(2200 + t as u64, n, k, 0.05);
        let (xd, wd) = (gpu.upload(&x).map_err(e)?, gpu.upload(&w).map_err(e)?);
        let mut out = gpu.upload(&resid).map_err(e)?;
        dense::matmul_add(gpu, &xd, &wd, t, n, k, &mut out).map_err(e)?;
        let mut o = vec![0.0f32; t * n];
        ops::matmul(&x, &wm, &mut o);
        let mut want = resid.clone();
        ops::add(&mut want, &o);
        check_close(&what, &gpu.download(&out).map_err(e)?, &want, tol)?;
        // The same through the caller's scratch.
        let mut out2 = gpu.upload(&resid).map_err(e)?;
        let mut scratch = gpu.alloc_zeros::<bf16>(t * k).map_err(e)?;
        dense::matmul_add_with_scratch(gpu, &xd, &wd, t, n, k, &mut out2, &mut scratch).map_err(e)?;
        check_close(&format!("{what} with scratch"), &gpu.download(&out2).map_err(e)?, &want, tol)?;
        if t > dense::GEMV_MAX_ROWS {
            // Tight on the rounded x: beta = 1 adds the residual in f32.
            ops::matmul(&round_bf16(&x), &wm, &mut o);
            let mut want = resid.clone();
            ops::add(&mut want, &o);
            check_close(&format!("{what} vs bf16(x)"), &gpu.download(&out).map_err(e)?, &want, 1e-5)?;
        }
    }
    Ok(())
}

fn matmul_rejects_bad_shapes(gpu: &Arc<Gpu>) -> Result<(), String> {
    let x = gpu.upload(&rand_f32(1, 2 * 64, 1.0)).map_err(e)?;
    let w = gpu.upload(&vec![bf16::from_f32(1.0); 16 * 64]).map_err(e)?;
    let mut out = poisoned(gpu, 2 * 16)?;
    let bad = [
        dense::matmul(gpu, &x, &w, 2, 16, 32, &mut out), // w is not [16, 32]
        dense::matmul(gpu, &x, &w, 3, 16, 64, &mut out), // x too short
        dense::matmul(gpu, &x, &w, 2, 8, 128, &mut out), // x too short for K
        dense::gemv(gpu, &x, &w, 2, 16, 64, &mut poisoned(gpu, 31)?, Write::Store), // out too short
    ];
    for (i, r) in bad.into_iter().enumerate() {
        match r {
            Err(strata::error::Error::InvalidArgument(_)) => {}
            other => return Err(format!("bad call {i}: {other:?}, want InvalidArgument")),
        }
    }
    let y = gpu.upload(&rand_f32(2, 5, 1.0)).map_err(e)?;
    let mut x2 = gpu.upload(&rand_f32(3, 6, 1.0)).map_err(e)?;
    if dense::add(gpu, &mut x2, &y).is_ok() {
        return Err("add accepted different lengths".into());
    }
    Ok(())
}

fn rmsnorm_widths(gpu: &Arc<Gpu>) -> Result<(), String> {
    // Per-head widths (rows = T * heads) and hidden widths; 5000 is odd-sized.
    for (rows, width) in [(96, 128), (7, 256), (5, 2048), (3, 5000), (2, 8192), (33, 64), (1, 3)] {
        let x = rand_f32(rows as u64 * 31 + width as u64, rows * width, 2.0);
        let w: Vec<f32> = rand_f32(width as u64, width, 0.2).iter().map(|v| 1.0 + v).collect();
        let eps = 1e-6;
        let (xd, wd) = (gpu.upload(&x).map_err(e)?, gpu.upload(&w).map_err(e)?);
        let mut out = poisoned(gpu, rows * width)?;
        dense::rmsnorm(gpu, &xd, &wd, eps, &mut out).map_err(e)?;
        let mut want = vec![0.0; rows * width];
        ops::rmsnorm(&x, &w, eps, &mut want);
        check_close(&format!("rmsnorm {rows}x{width}"), &gpu.download(&out).map_err(e)?, &want, 1e-5)?;
    }
    // A large eps matters (it enters inside the square root).
    let x = rand_f32(5, 4 * 128, 0.01);
    let w = rand_f32(6, 128, 1.0);
    let (xd, wd) = (gpu.upload(&x).map_err(e)?, gpu.upload(&w).map_err(e)?);
    let mut out = poisoned(gpu, x.len())?;
    dense::rmsnorm(gpu, &xd, &wd, 0.5, &mut out).map_err(e)?;
    let mut want = vec![0.0; x.len()];
    ops::rmsnorm(&x, &w, 0.5, &mut want);
    check_close("rmsnorm eps 0.5", &gpu.download(&out).map_err(e)?, &want, 1e-5)
}

/// rmsnorm with the fused non-finite guard: the same output as rmsnorm, and
/// the flag holds the first flat index of a NaN/inf (or stays NONFINITE_NONE),
/// also through the unfused fallback (width 130, not a multiple of 4).
fn rmsnorm_checked_flags(gpu: &Arc<Gpu>) -> Result<(), String> {
    for (rows, width) in [(1usize, 2048usize), (3, 2048), (2, 4096), (4, 130), (1, 8192)] {
        let w: Vec<f32> = rand_f32(70, width, 0.2).iter().map(|v| 1.0 + v).collect();
        let wd = gpu.upload(&w).map_err(e)?;
        // Clean input, then NaN and inf at chosen places (the first one wins).
        let bad_cases: [&[(usize, f32)]; 3] =
            [&[], &[(width + 5, f32::NAN), (2, f32::INFINITY)], &[(width - 1, f32::NEG_INFINITY)]];
        for (ci, bad) in bad_cases.iter().enumerate() {
            let mut x = rand_f32(71 + ci as u64, rows * width, 1.5);
            for &(i, v) in bad.iter() {
                if i < x.len() {
                    x[i] = v;
                }
            }
            let want_flag = bad.iter().map(|&(i, _)| i).filter(|&i| i < x.len()).min();
            let xd = gpu.upload(&x).map_err(e)?;
            let mut out = poisoned(gpu, rows * width)?;
            let mut flags = gpu.alloc_zeros::<u32>(3).map_err(e)?;
            dense::reset_flags(gpu, &mut flags).map_err(e)?;
            dense::rmsnorm_checked(gpu, &xd, &wd, 1e-6, &mut out, &mut flags, 1).map_err(e)?;
            let got = gpu.download(&flags).map_err(e)?;
            let what = format!("rmsnorm_checked {rows}x{width} case {ci}");
            let want_slot = want_flag.map_or(dense::NONFINITE_NONE, |i| i as u32);
            if got != [dense::NONFINITE_NONE, want_slot, dense::NONFINITE_NONE] {
                return Err(format!("{what}: flags {got:?}, want slot 1 = {want_slot}"));
            }
            if want_flag.is_none() {
                let mut want = vec![0.0; rows * width];
                ops::rmsnorm(&x, &w, 1e-6, &mut want);
                check_close(&what, &gpu.download(&out).map_err(e)?, &want, 1e-5)?;
            }
        }
    }
    let (x, w) = (gpu.upload(&rand_f32(1, 64, 1.0)).map_err(e)?, gpu.upload(&rand_f32(2, 64, 1.0)).map_err(e)?);
    let mut out = poisoned(gpu, 64)?;
    let mut flags = gpu.alloc_zeros::<u32>(2).map_err(e)?;
    if dense::rmsnorm_checked(gpu, &x, &w, 1e-6, &mut out, &mut flags, 2).is_ok() {
        return Err("rmsnorm_checked accepted slot 2 of 2 flags".into());
    }
    Ok(())
}

fn add_rmsnorm_fused(gpu: &Arc<Gpu>) -> Result<(), String> {
    for (rows, width) in [(4, 2048), (3, 5000), (9, 128)] {
        let x = rand_f32(40 + rows as u64, rows * width, 1.0);
        let y = rand_f32(50 + rows as u64, rows * width, 1.0);
        let w: Vec<f32> = rand_f32(60, width, 0.2).iter().map(|v| 1.0 + v).collect();
        let mut xd = gpu.upload(&x).map_err(e)?;
        let (yd, wd) = (gpu.upload(&y).map_err(e)?, gpu.upload(&w).map_err(e)?);
        let mut out = poisoned(gpu, rows * width)?;
        dense::add_rmsnorm(gpu, &mut xd, &yd, &wd, 1e-6, &mut out).map_err(e)?;
        let mut xs = x.clone();
        ops::add(&mut xs, &y);
        let mut want = vec![0.0; xs.len()];
        ops::rmsnorm(&xs, &w, 1e-6, &mut want);
        check_close(&format!("add_rmsnorm x {rows}x{width}"), &gpu.download(&xd).map_err(e)?, &xs, 0.0)?;
        check_close(&format!("add_rmsnorm out {rows}x{width}"), &gpu.download(&out).map_err(e)?, &want, 1e-5)?;
    }
    Ok(())
}

fn rope_config(head_dim: usize, partial: f64, theta: f64, scaling: Option<RopeScaling>) -> ModelConfig {
    ModelConfig {
        arch: Arch::Qwen3Moe,
        vocab_size: 32,
        hidden_size: 64,
        num_hidden_layers: 1,
        num_attention_heads: 1,
        num_key_value_heads: 1,
        head_dim,
        num_experts: 2,
        num_experts_per_tok: 1,
        moe_intermediate_size: 16,
        norm_topk_prob: true,
        rms_norm_eps: 1e-6,
        rope_theta: theta,
        partial_rotary_factor: partial,
        rope_scaling: scaling,
        max_position_embeddings: 262144,
        tie_word_embeddings: false,
        qwen3_next: None,
    }
}

fn rope_full_partial_yarn(gpu: &Arc<Gpu>) -> Result<(), String> {
    let yarn = |factor: f64, l0: usize| RopeScaling {
        factor,
        original_max_position_embeddings: l0,
        attention_factor: None,
        beta_fast: 32.0,
        beta_slow: 1.0,
    };
    let cases = [
        ("qwen3_moe plain", rope_config(128, 1.0, 1e6, None), 32),
        ("qwen3_moe yarn", rope_config(128, 1.0, 1e6, Some(yarn(4.0, 32768))), 4),
        ("qwen3_next partial 64/256 yarn", rope_config(256, 0.25, 1e7, Some(yarn(4.0, 65536))), 16),
        ("partial 64/256 plain", rope_config(256, 0.25, 1e7, None), 2),
    ];
    for (name, cfg, heads) in cases {
        let rope = Rope::new(&cfg);
        if name.contains("yarn") && rope.attention_factor == 1.0 {
            return Err(format!("{name}: the config did not turn YaRN on"));
        }
        let table = RopeTable::new(gpu, &rope).map_err(e)?;
        let hd = cfg.head_dim;
        for (t, start) in [(5, 0), (3, 100_000), (1, 131_071)] {
            let what = format!("rope {name} T={t} start={start}");
            // One extra row past T: must be left alone.
            let x = rand_f32(start as u64 + heads as u64, (t + 1) * heads * hd, 1.0);
            let mut xd = gpu.upload(&x).map_err(e)?;
            dense::rope(gpu, &mut xd, t, heads, hd, start, &table).map_err(e)?;
            let got = gpu.download(&xd).map_err(e)?;
            let n = t * heads * hd;
            let mut want = x[..n].to_vec();
            ops::rope(&mut want, heads, hd, start, &rope);
            check_close(&what, &got[..n], &want, 1e-5)?;
            if got[n..] != x[n..] {
                return Err(format!("{what}: changed the row past T"));
            }
            for (i, (g, w)) in got[..n].iter().zip(&x[..n]).enumerate() {
                if i % hd >= rope.rotary_dim && g.to_bits() != w.to_bits() {
                    return Err(format!("{what}: pass-through dim {} of head {} changed", i % hd, i / hd));
                }
            }
        }
    }
    Ok(())
}

fn rmsnorm_rope_fused(gpu: &Arc<Gpu>) -> Result<(), String> {
    let yarn = Some(RopeScaling {
        factor: 4.0,
        original_max_position_embeddings: 32768,
        attention_factor: None,
        beta_fast: 32.0,
        beta_slow: 1.0,
    });
    // qwen3_moe q (32 heads) and k (4), qwen3_next q (16 of 256, partial 64) and k (2).
    let cases = [
        (rope_config(128, 1.0, 1e6, yarn.clone()), 32),
        (rope_config(128, 1.0, 1e6, None), 4),
        (rope_config(256, 0.25, 1e7, yarn), 16),
        (rope_config(256, 0.25, 1e7, None), 2),
    ];
    for (cfg, heads) in cases {
        let rope = Rope::new(&cfg);
        let table = RopeTable::new(gpu, &rope).map_err(e)?;
        let hd = cfg.head_dim;
        for (t, start) in [(1, 0), (6, 0), (2, 100_000)] {
            let what = format!("rmsnorm_rope hd={hd} rotary={} heads={heads} T={t} start={start}", rope.rotary_dim);
            let x = rand_f32(start as u64 + 7 * t as u64 + heads as u64, t * heads * hd, 3.0);
            let w: Vec<f32> = rand_f32(hd as u64 + 1, hd, 0.3).iter().map(|v| 1.0 + v).collect();
            let (xd, wd) = (gpu.upload(&x).map_err(e)?, gpu.upload(&w).map_err(e)?);
            let mut out = poisoned(gpu, x.len())?;
            dense::rmsnorm_rope(gpu, &xd, &wd, 1e-6, heads, start, &table, &mut out).map_err(e)?;
            let mut want = vec![0.0; x.len()];
            ops::rmsnorm(&x, &w, 1e-6, &mut want);
            ops::rope(&mut want, heads, hd, start, &rope);
            check_close(&what, &gpu.download(&out).map_err(e)?, &want, 1e-5)?;
        }
    }
    Ok(())
}

/// rmsnorm_rope_at (start_pos read from a StepPos on the device, one StepPos set per step) gives the same bits as
/// rmsnorm_rope at that start_pos (the same kernel, the same position), for the decode positions of a captured
/// step (T = 1) and T = 2.
fn rmsnorm_rope_step_pointer(gpu: &Arc<Gpu>) -> Result<(), String> {
    use strata::backend::cuda::attention::StepPos;
    let yarn = Some(RopeScaling {
        factor: 4.0,
        original_max_position_embeddings: 32768,
        attention_factor: None,
        beta_fast: 32.0,
        beta_slow: 1.0,
    });
    let cases = [
        (rope_config(128, 1.0, 1e6, yarn.clone()), 32),
        (rope_config(128, 1.0, 1e6, None), 4),
        (rope_config(256, 0.25, 1e7, yarn), 16),
        (rope_config(256, 0.25, 1e7, None), 2),
        (rope_config(32, 1.0, 1e4, None), 4),
        (rope_config(16, 0.5, 1e4, None), 6),
    ];
    let mut pos = StepPos::new(gpu).map_err(e)?;
    for (ci, (cfg, heads)) in cases.into_iter().enumerate() {
        let rope = Rope::new(&cfg);
        let table = RopeTable::new(gpu, &rope).map_err(e)?;
        let hd = cfg.head_dim;
        let w: Vec<f32> = rand_f32(hd as u64 + 3, hd, 0.3).iter().map(|v| 1.0 + v).collect();
        let wd = gpu.upload(&w).map_err(e)?;
        for t in [1usize, 2] {
            for (pi, &start) in [0usize, 1, 2, 63, 64, 65, 500, 4095, 40000].iter().enumerate() {
                let what = format!("rmsnorm_rope_at hd={hd} heads={heads} T={t} start={start}");
                let x = rand_f32(5000 + (ci * 100 + pi * 3 + t) as u64, t * heads * hd, 3.0);
                let xd = gpu.upload(&x).map_err(e)?;
                let mut want = poisoned(gpu, x.len())?;
                dense::rmsnorm_rope(gpu, &xd, &wd, 1e-6, heads, start, &table, &mut want).map_err(e)?;
                pos.set(gpu, start, 32).map_err(e)?;
                let mut got = poisoned(gpu, x.len())?;
                dense::rmsnorm_rope_at(gpu, &xd, &wd, 1e-6, heads, &pos, &table, &mut got).map_err(e)?;
                let (got, want) = (gpu.download(&got).map_err(e)?, gpu.download(&want).map_err(e)?);
                if let Some(i) = got.iter().zip(&want).position(|(g, w)| g.to_bits() != w.to_bits() || !w.is_finite()) {
                    return Err(format!("{what}: [{i}] = {} want {} (bit-exact)", got[i], want[i]));
                }
            }
        }
    }
    Ok(())
}

fn elementwise_ops(gpu: &Arc<Gpu>) -> Result<(), String> {
    for n in [1usize, 1000, 3 * 2048 + 7, 2_000_003] {
        let a = rand_f32(n as u64, n, 3.0);
        let b = rand_f32(n as u64 + 1, n, 3.0);
        let (ad, bd) = (gpu.upload(&a).map_err(e)?, gpu.upload(&b).map_err(e)?);

        // add: x += y, exact.
        let mut x = gpu.upload(&a).map_err(e)?;
        dense::add(gpu, &mut x, &bd).map_err(e)?;
        let mut want = a.clone();
        ops::add(&mut want, &b);
        check_close(&format!("add {n}"), &gpu.download(&x).map_err(e)?, &want, 0.0)?;

        // silu_mul
        let mut out = poisoned(gpu, n)?;
        dense::silu_mul(gpu, &ad, &bd, &mut out).map_err(e)?;
        let want: Vec<f32> = a.iter().zip(&b).map(|(&g, &u)| ops::silu(g) * u).collect();
        check_close(&format!("silu_mul {n}"), &gpu.download(&out).map_err(e)?, &want, 1e-6)?;

        // output_gate: attn *= sigmoid(gate)
        let mut attn = gpu.upload(&a).map_err(e)?;
        dense::output_gate(gpu, &mut attn, &bd).map_err(e)?;
        let mut want = a.clone();
        next_ops::apply_output_gate(&mut want, &b);
        check_close(&format!("output_gate {n}"), &gpu.download(&attn).map_err(e)?, &want, 1e-6)?;

        // sigmoid in place
        let mut s = gpu.upload(&a).map_err(e)?;
        dense::sigmoid(gpu, &mut s).map_err(e)?;
        let want: Vec<f32> = a.iter().map(|&v| next_ops::sigmoid(v)).collect();
        check_close(&format!("sigmoid {n}"), &gpu.download(&s).map_err(e)?, &want, 1e-6)?;
    }
    // The shared expert's gated add: out[t, :] += sigmoid(logit[t]) * y[t, :].
    for (t, width) in [(1, 2048), (7, 2048), (3, 33)] {
        let o = rand_f32(70 + t as u64, t * width, 1.0);
        let y = rand_f32(80 + t as u64, t * width, 1.0);
        let logit = rand_f32(90 + t as u64, t, 4.0);
        let mut od = gpu.upload(&o).map_err(e)?;
        let (yd, ld) = (gpu.upload(&y).map_err(e)?, gpu.upload(&logit).map_err(e)?);
        dense::sigmoid_scale_add(gpu, &mut od, &yd, &ld, width).map_err(e)?;
        let mut want = o.clone();
        for ((orow, yrow), &l) in want.chunks_exact_mut(width).zip(y.chunks_exact(width)).zip(&logit) {
            let s = next_ops::sigmoid(l);
            for (ov, yv) in orow.iter_mut().zip(yrow) {
                *ov += s * yv;
            }
        }
        check_close(&format!("sigmoid_scale_add {t}x{width}"), &gpu.download(&od).map_err(e)?, &want, 1e-6)?;
    }
    Ok(())
}

fn split_q_gate_layout(gpu: &Arc<Gpu>) -> Result<(), String> {
    // qwen3_next: 16 heads of 256; a small odd case too.
    for (t, heads, hd) in [(3, 16, 256), (1, 16, 256), (5, 3, 7)] {
        let qg = rand_f32(t as u64 + 200, t * heads * 2 * hd, 1.0);
        let qgd = gpu.upload(&qg).map_err(e)?;
        let (mut q, mut g) = (poisoned(gpu, t * heads * hd)?, poisoned(gpu, t * heads * hd)?);
        dense::split_q_gate(gpu, &qgd, heads, hd, &mut q, &mut g).map_err(e)?;
        let (mut wq, mut wg) = (vec![0.0; t * heads * hd], vec![0.0; t * heads * hd]);
        next_ops::split_q_gate(&qg, heads, hd, &mut wq, &mut wg);
        check_close(&format!("split q {t}x{heads}x{hd}"), &gpu.download(&q).map_err(e)?, &wq, 0.0)?;
        check_close(&format!("split gate {t}x{heads}x{hd}"), &gpu.download(&g).map_err(e)?, &wg, 0.0)?;
    }
    Ok(())
}

fn embed_gathers_rows(gpu: &Arc<Gpu>) -> Result<(), String> {
    let (vocab, hidden) = (1001, 2048);
    let table: Vec<bf16> = rand_f32(300, vocab * hidden, 1.0).into_iter().map(bf16::from_f32).collect();
    let tabled = gpu.upload(&table).map_err(e)?;
    let ids: Vec<u32> = vec![0, 1000, 17, 17, 999, 3];
    let idsd = gpu.upload(&ids).map_err(e)?;
    let t = ids.len();
    let mut out = poisoned(gpu, t * hidden + 3)?;
    dense::embed(gpu, &tabled, &idsd, t, hidden, &mut out).map_err(e)?;
    let got = gpu.download(&out).map_err(e)?;
    check_tail("embed", &got, t * hidden)?;
    let want: Vec<f32> =
        ids.iter().flat_map(|&id| table[id as usize * hidden..][..hidden].iter().map(|v| v.to_f32())).collect();
    check_close("embed", &got[..t * hidden], &want, 0.0)?;
    // An id past the vocabulary gives a NaN row, not a read out of bounds.
    let bad = gpu.upload(&[5u32, vocab as u32]).map_err(e)?;
    let mut out = poisoned(gpu, 2 * hidden)?;
    gpu.fill_f32(&mut out, 0.0).map_err(e)?;
    dense::embed(gpu, &tabled, &bad, 2, hidden, &mut out).map_err(e)?;
    let got = gpu.download(&out).map_err(e)?;
    if got[hidden..].iter().any(|v| !v.is_nan()) || got[..hidden].iter().any(|v| !v.is_finite()) {
        return Err("embed: an out-of-range id must give exactly its row as NaN".into());
    }
    Ok(())
}

fn f32_to_bf16_rounding(gpu: &Arc<Gpu>) -> Result<(), String> {
    let mut x = rand_f32(400, 100_001, 10.0);
    // Ties to even, the largest finite values, infinities, tiny and subnormal values.
    let tie_up = f32::from_bits(0x3f80_8000); // 1 + 2^-8: halfway, rounds to even (down)
    let tie_odd = f32::from_bits(0x3f81_8000); // halfway above an odd bf16: rounds up
    x.extend([tie_up, tie_odd, -tie_odd, f32::MAX, -f32::MAX, f32::INFINITY, f32::NEG_INFINITY, 1e-40, -0.0, 0.0]);
    let xd = gpu.upload(&x).map_err(e)?;
    let mut out = gpu.alloc_zeros::<bf16>(x.len()).map_err(e)?;
    dense::f32_to_bf16(gpu, &xd, &mut out).map_err(e)?;
    let got = gpu.download(&out).map_err(e)?;
    for (i, (g, &v)) in got.iter().zip(&x).enumerate() {
        let w = bf16::from_f32(v);
        if g.to_bits() != w.to_bits() {
            return Err(format!("f32_to_bf16[{i}] of {v:e}: {:#06x}, want {:#06x}", g.to_bits(), w.to_bits()));
        }
    }
    Ok(())
}

fn first_nonfinite_guard(gpu: &Arc<Gpu>) -> Result<(), String> {
    let (rows, width) = (37, 2048);
    let clean = rand_f32(500, rows * width, 100.0);
    let mut flags = gpu.alloc_zeros::<u32>(4).map_err(e)?;
    dense::reset_flags(gpu, &mut flags).map_err(e)?;
    let cd = gpu.upload(&clean).map_err(e)?;
    dense::first_nonfinite(gpu, &cd, width, &mut flags, 0).map_err(e)?;

    let mut bad = clean.clone();
    bad[30 * width + 1] = f32::INFINITY;
    bad[20 * width + 5] = f32::NAN;
    bad[21 * width] = f32::NEG_INFINITY;
    bad[rows * width - 1] = f32::NAN;
    let bd = gpu.upload(&bad).map_err(e)?;
    dense::first_nonfinite(gpu, &bd, width, &mut flags, 2).map_err(e)?;
    // A later bad index into the same slot does not raise the minimum.
    let mut later = clean.clone();
    later[33 * width] = f32::NAN;
    let ld = gpu.upload(&later).map_err(e)?;
    dense::first_nonfinite(gpu, &ld, width, &mut flags, 2).map_err(e)?;
    // Index 0 into slot 3.
    let mut first = clean.clone();
    first[0] = f32::NAN;
    let fd = gpu.upload(&first).map_err(e)?;
    dense::first_nonfinite(gpu, &fd, width, &mut flags, 3).map_err(e)?;

    let got = gpu.download(&flags).map_err(e)?;
    let want = [NONFINITE_NONE, NONFINITE_NONE, (20 * width + 5) as u32, 0];
    if got != want {
        return Err(format!("flags {got:?}, want {want:?}"));
    }
    if dense::nonfinite_row(got[2], width) != Some((20, 5)) || dense::nonfinite_row(got[0], width).is_some() {
        return Err("nonfinite_row".into());
    }
    // reset_flags clears every slot.
    dense::reset_flags(gpu, &mut flags).map_err(e)?;
    if gpu.download(&flags).map_err(e)? != [NONFINITE_NONE; 4] {
        return Err("reset_flags left a slot set".into());
    }
    if dense::first_nonfinite(gpu, &cd, width, &mut flags, 4).is_ok() {
        return Err("slot 4 of 4 accepted".into());
    }
    Ok(())
}

fn argmax_ties_lowest_index(gpu: &Arc<Gpu>) -> Result<(), String> {
    let greedy = Sampler::greedy();
    for (rows, vocab) in [(4, 151_936), (3, 5), (2, 1), (2, 1025), (3, 8193), (9, 4096)] {
        let mut logits = rand_f32(600 + vocab as u64, rows * vocab, 5.0);
        if rows >= 3 && vocab > 100 {
            // Row 0: the maximum twice (90 and the last index): 90 wins.
            let r0 = &mut logits[..vocab];
            r0[90] = 100.0;
            r0[vocab - 1] = 100.0;
            // Row 1: all equal: index 0. Row 2: the maximum at the last index.
            logits[vocab..2 * vocab].fill(-3.5);
            logits[3 * vocab - 1] = 50.0;
        }
        if vocab == 5 {
            logits[5..10].copy_from_slice(&[1.0, 7.0, 2.0, 7.0, 7.0]);
        }
        let ld = gpu.upload(&logits).map_err(e)?;
        let mut out = gpu.upload(&vec![u32::MAX - 1; rows + 1]).map_err(e)?;
        dense::argmax(gpu, &ld, rows, vocab, &mut out).map_err(e)?;
        let got = gpu.download(&out).map_err(e)?;
        for r in 0..rows {
            let want = greedy.probabilities(&logits[r * vocab..][..vocab]).map_err(e)?[0].0;
            if got[r] != want {
                return Err(format!("argmax row {r} of {rows}x{vocab}: {}, want {want}", got[r]));
            }
        }
        if got[rows] != u32::MAX - 1 {
            return Err(format!("argmax {rows}x{vocab}: wrote past the rows"));
        }
        if rows >= 3 && vocab > 100 && (got[0], got[1], got[2]) != (90, 0, vocab as u32 - 1) {
            return Err(format!("argmax ties: {:?}", &got[..3]));
        }
        if vocab == 5 && got[1] != 1 {
            return Err(format!("argmax [1, 7, 2, 7, 7]: {}", got[1]));
        }
    }
    Ok(())
}

/// Median seconds per call of `f` over `reps` calls, 5 rounds after a warmup.
fn time_it(gpu: &Gpu, reps: usize, mut f: impl FnMut(usize) -> Result<(), String>) -> Result<f64, String> {
    for i in 0..3 {
        f(i)?;
    }
    gpu.sync().map_err(e)?;
    let mut times = Vec::new();
    for _ in 0..5 {
        let started = Instant::now();
        for i in 0..reps {
            f(i)?;
        }
        gpu.sync().map_err(e)?;
        times.push(started.elapsed().as_secs_f64() / reps as f64);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[2])
}

/// Copies of a random `[n, k]` BF16 matrix that together exceed L2 (a
/// timing loop rotates through them, so weights come from HBM).
fn rotated_weights(gpu: &Gpu, n: usize, k: usize) -> Result<Vec<CudaSlice<bf16>>, String> {
    let copies = (256usize << 20).div_ceil(n * k * 2).clamp(1, 64);
    (0..copies)
        .map(|c| {
            let mut w = gpu.alloc_zeros::<bf16>(n * k).map_err(e)?;
            gpu.fill_uniform_bf16(&mut w, c as u64 + 1).map_err(e)?;
            Ok(w)
        })
        .collect()
}

/// Timing lines of the GEMV K split (`dense::force_gemv_ksplit`, a
/// `test-hooks` item): the decode projections' shapes (qkv, o_proj, router
/// of 30b-a3b), each choice against the heuristic's.
#[cfg(feature = "test-hooks")]
fn ksplit_lines(gpu: &Arc<Gpu>) -> Result<(), String> {
    for (n, k) in [(5120, 2048), (2048, 4096), (128, 2048)] {
        let ws = rotated_weights(gpu, n, k)?;
        let copies = ws.len();
        let x = gpu.upload(&rand_f32(1, k, 1.0)).map_err(e)?;
        let mut out = poisoned(gpu, n)?;
        let mut line = format!("     GEMV T=1 N={n} K={k} by K split:");
        for ks in [0usize, 1, 2, 4, 8] {
            dense::force_gemv_ksplit((ks > 0).then_some(ks));
            let s = time_it(gpu, 20, |i| dense::matmul(gpu, &x, &ws[i % copies], 1, n, k, &mut out).map_err(e));
            dense::force_gemv_ksplit(None);
            let name = if ks == 0 { "auto".to_string() } else { ks.to_string() };
            line += &format!(" {name} {:.2} us", s? * 1e6);
        }
        println!("{line}");
        // The staged kernels (all weights requested before the wait) against the plain ones.
        let mut line = format!("     GEMV T=1 N={n} K={k} staged:");
        for mode in [0u8, 1, 2] {
            dense::force_gemv_staged(Some(mode));
            let kernel = dense::gemv_choice(gpu, n, k, false).map_err(e);
            let s = time_it(gpu, 20, |i| dense::matmul(gpu, &x, &ws[i % copies], 1, n, k, &mut out).map_err(e));
            dense::force_gemv_staged(None);
            let (name, blocks) = kernel?;
            line += &format!(" [{mode}] {name} x {blocks}: {:.2} us", s? * 1e6);
        }
        println!("{line}");
        if k == 2048 && n > 128 {
            // The same with the input RMSNorm inside (each block normalizes x itself).
            let g = gpu.upload(&rand_f32(4, k, 1.0)).map_err(e)?;
            let mut normed = poisoned(gpu, k)?;
            let mut line = format!("     GEMV+RMSNorm T=1 N={n} K={k} by K split:");
            for ks in [0usize, 4, 8] {
                dense::force_gemv_ksplit((ks > 0).then_some(ks));
                let s = time_it(gpu, 20, |i| {
                    let norm = dense::NormIn { w: &g, eps: 1e-6, check: None };
                    dense::gemv_rmsnorm(
                        gpu,
                        &x,
                        norm,
                        &mut normed,
                        false,
                        &ws[i % copies],
                        n,
                        k,
                        &mut out,
                        Write::Store,
                    )
                    .map_err(e)
                });
                dense::force_gemv_ksplit(None);
                let name = if ks == 0 { "auto".to_string() } else { ks.to_string() };
                line += &format!(" {name} {:.2} us", s? * 1e6);
            }
            println!("{line}");
        }
    }
    Ok(())
}

/// Timing lines: GEMV GB/s (weights read from HBM: rotated copies larger
/// than L2) and the cuBLAS GEMM's TFLOP/s at a prefill shape.
fn timing(gpu: &Arc<Gpu>) -> Result<(), String> {
    for (t, n, k) in [(1, 151_936, 2048), (1, 4096, 2048), (8, 151_936, 2048), (1, 2048, 4096), (1, 1, 2048)] {
        let bytes = n * k * 2;
        let ws = rotated_weights(gpu, n, k)?;
        let copies = ws.len();
        let x = gpu.upload(&rand_f32(1, t * k, 1.0)).map_err(e)?;
        let mut out = poisoned(gpu, t * n)?;
        let s = time_it(gpu, 20, |i| dense::matmul(gpu, &x, &ws[i % copies], t, n, k, &mut out).map_err(e))?;
        let moved = (bytes + t * k * 4 + t * n * 4) as f64;
        println!(
            "     GEMV T={t} N={n} K={k}: {:.1} us, {:.0} GB/s (HBM ~4300 GB/s on H200)",
            s * 1e6,
            moved / s / 1e9
        );
    }
    #[cfg(feature = "test-hooks")]
    ksplit_lines(gpu)?;
    let logits = gpu.upload(&rand_f32(3, 151_936, 1.0)).map_err(e)?;
    let mut ids = gpu.alloc_zeros::<u32>(1).map_err(e)?;
    let s = time_it(gpu, 50, |_| dense::argmax(gpu, &logits, 1, 151_936, &mut ids).map_err(e))?;
    println!("     argmax 1 x 151936: {:.1} us", s * 1e6);
    let (t, n, k) = (4096, 4096, 2048);
    let mut w = gpu.alloc_zeros::<bf16>(n * k).map_err(e)?;
    gpu.fill_uniform_bf16(&mut w, 9).map_err(e)?;
    let x = gpu.upload(&rand_f32(2, t * k, 1.0)).map_err(e)?;
    let mut out = poisoned(gpu, t * n)?;
    let mut scratch = gpu.alloc_zeros::<bf16>(t * k).map_err(e)?;
    let s = time_it(gpu, 20, |_| dense::matmul_with_scratch(gpu, &x, &w, t, n, k, &mut out, &mut scratch).map_err(e))?;
    let flops = 2.0 * (t * n * k) as f64;
    println!(
        "     GEMM T={t} N={n} K={k} (x->bf16 + cuBLAS): {:.1} us, {:.0} TFLOP/s (BF16 dense ~790 TFLOP/s on H200)",
        s * 1e6,
        flops / s / 1e12
    );
    if gpu.download(&out).map_err(e)?.iter().any(|v| !v.is_finite()) {
        return Err("GEMM timing: non-finite output".into());
    }
    Ok(())
}
