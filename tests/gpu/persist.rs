//! GPU tests of kernels/persist.cu: the persistent GEMV chain against the
//! same chain of `dense::gemv` launches (itself checked against the CPU in
//! tests/gpu/dense.rs), and its timing against that chain and the floor.

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use half::bf16;
use strata::backend::cuda::dense::{self, Write};
use strata::backend::cuda::persist::GemvChain;
use strata::backend::cuda::{ceilings, CudaSlice, Gpu};

use super::common::{check_close, e, poisoned, rand_f32, GpuTest};

pub const TESTS: &[GpuTest] =
    &[("persist_gemv_chain_matches_launches", chain_matches_launches), ("persist_gemv_chain_timing", chain_timing)];

/// A random BF16 `[n, k]` matrix: entries uniform in +-`scale` (made on the
/// host), or in +-1 on the device (`None`: large chains, timing only).
fn matrix(gpu: &Gpu, n: usize, k: usize, scale: Option<f32>, seed: u64) -> Result<CudaSlice<bf16>, String> {
    match scale {
        Some(s) => {
            let host: Vec<bf16> = rand_f32(seed, n * k, s).iter().map(|&v| bf16::from_f32(v)).collect();
            gpu.upload(&host).map_err(e)
        }
        None => {
            let mut w = gpu.alloc_zeros::<bf16>(n * k).map_err(e)?;
            gpu.fill_uniform_bf16(&mut w, seed).map_err(e)?;
            Ok(w)
        }
    }
}

/// `count` matrices alternating [4096, 2048] and [2048, 4096] (a chain:
/// each takes the previous one's output); `scale` as `matrix`, None: +-1.
fn matrices(gpu: &Gpu, count: usize, scaled: bool, seed: u64) -> Result<Vec<(CudaSlice<bf16>, usize, usize)>, String> {
    (0..count)
        .map(|m| {
            let (n, k) = if m % 2 == 0 { (4096, 2048) } else { (2048, 4096) };
            // Uniform +-s has variance s^2 / 3: s = sqrt(3 / k) keeps |y| about the same.
            let scale = scaled.then(|| (3.0 / k as f32).sqrt());
            Ok((matrix(gpu, n, k, scale, seed + m as u64)?, n, k))
        })
        .collect()
}

/// The chain of `dense::gemv` launches: `y_{m+1} = W_m y_m` through two vectors.
fn launches(
    gpu: &Gpu,
    mats: &[(CudaSlice<bf16>, usize, usize)],
    ya: &mut CudaSlice<f32>,
    yb: &mut CudaSlice<f32>,
) -> Result<(), String> {
    for (m, (w, n, k)) in mats.iter().enumerate() {
        let (x, out) = if m % 2 == 0 { (&*ya, &mut *yb) } else { (&*yb, &mut *ya) };
        dense::gemv(gpu, x, w, 1, *n, *k, out, Write::Store).map_err(e)?;
    }
    Ok(())
}

/// Six GEMVs (entries scaled so the vector keeps its size): the persistent
/// chain's output against the launches', run twice (the barrier is reused).
fn chain_matches_launches(gpu: &Arc<Gpu>) -> Result<(), String> {
    if gpu.compute_capability().0 < 8 {
        println!("    the persistent kernel needs sm_80");
        return Ok(());
    }
    let mats = matrices(gpu, 6, true, 40)?;
    let y0 = rand_f32(50, 4096, 1.0);
    let (mut ya, mut yb) = (gpu.upload(&y0).map_err(e)?, poisoned(gpu, 4096)?);
    launches(gpu, &mats, &mut ya, &mut yb)?;
    let want = gpu.download(&ya).map_err(e)?[..2048].to_vec();
    let refs: Vec<_> = mats.iter().map(|(w, n, k)| (w, *n, *k)).collect();
    let mut chain = GemvChain::new(gpu, &refs).map_err(e)?;
    for run in 0..2 {
        let (mut pa, mut pb) = (gpu.upload(&y0).map_err(e)?, poisoned(gpu, 4096)?);
        chain.run(gpu, &mut pa, &mut pb).map_err(e)?;
        let got = gpu.download(&pa).map_err(e)?[..2048].to_vec();
        check_close(&format!("persistent chain of 6, run {run}"), &got, &want, 1e-5)?;
    }
    if want.iter().fold(0.0f32, |m, v| m.max(v.abs())) < 1e-3 {
        return Err("the chain's output vanished: the check cannot tell".into());
    }
    Ok(())
}

/// 48 GEMVs of 16.8 MB (806 MB, rows of 2048 and 4096 as a decode layer's
/// q and o_proj): the persistent chain against the launches (captured in a
/// CUDA graph, programmatic launches), each against the bytes' floor at the
/// measured HBM bandwidth. Medians of 5 x 5 runs.
fn chain_timing(gpu: &Arc<Gpu>) -> Result<(), String> {
    if gpu.compute_capability().0 < 8 {
        println!("    the persistent kernel needs sm_80");
        return Ok(());
    }
    let mats = matrices(gpu, 48, false, 7)?;
    let bytes: usize = mats.iter().map(|(_, n, k)| 2 * n * k).sum();
    let hbm = ceilings::hbm_bandwidth(gpu).map_err(e)?;
    let floor = bytes as f64 / hbm;
    let (mut ya, mut yb) = (gpu.upload(&rand_f32(8, 4096, 1.0)).map_err(e)?, poisoned(gpu, 4096)?);
    let time = |f: &mut dyn FnMut() -> Result<(), String>| -> Result<f64, String> {
        f()?;
        gpu.sync().map_err(e)?;
        let mut v = Vec::new();
        for _ in 0..5 {
            let t = Instant::now();
            for _ in 0..5 {
                f()?;
            }
            gpu.sync().map_err(e)?;
            v.push(t.elapsed().as_secs_f64() / 5.0);
        }
        v.sort_by(f64::total_cmp);
        Ok(v[2])
    };
    let stream = gpu.stream().clone();
    gpu.sync().map_err(e)?;
    stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).map_err(e)?;
    let captured = launches(gpu, &mats, &mut ya, &mut yb);
    let graph = stream.end_capture(CUgraphInstantiate_flags(0)).map_err(e)?;
    captured?;
    let graph = graph.ok_or("the capture gave no graph")?;
    let t_launch = time(&mut || graph.launch().map_err(e))?;
    let refs: Vec<_> = mats.iter().map(|(w, n, k)| (w, *n, *k)).collect();
    let mut chain = GemvChain::new(gpu, &refs).map_err(e)?;
    let t_persist = time(&mut || chain.run(gpu, &mut ya, &mut yb).map_err(e))?;
    let per = |t: f64| t / mats.len() as f64 * 1e6;
    println!(
        "     GEMV chain of 48 ([4096, 2048] / [2048, 4096], {:.0} MB): floor {:.1} us ({:.2} us a GEMV at {:.0} GB/s)",
        bytes as f64 / 1e6,
        floor * 1e6,
        per(floor),
        hbm / 1e9
    );
    println!(
        "     launches (graph, programmatic): {:.1} us, {:.2} us a GEMV, {:.2}x the floor",
        t_launch * 1e6,
        per(t_launch),
        t_launch / floor
    );
    println!(
        "     persistent (one launch, ring of {} KB a block): {:.1} us, {:.2} us a GEMV, {:.2}x the floor",
        11 * 16,
        t_persist * 1e6,
        per(t_persist),
        t_persist / floor
    );
    // The same with 48 [512, 512] matrices (0.5 MB each): what a dependent step costs beyond its bytes.
    let small: Vec<_> = (0..48)
        .map(|m| Ok((matrix(gpu, 512, 512, Some((3.0f32 / 512.0).sqrt()), 100 + m)?, 512usize, 512usize)))
        .collect::<Result<_, String>>()?;
    gpu.sync().map_err(e)?;
    stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).map_err(e)?;
    let captured = launches(gpu, &small, &mut ya, &mut yb);
    let graph = stream.end_capture(CUgraphInstantiate_flags(0)).map_err(e)?;
    captured?;
    let graph = graph.ok_or("the capture gave no graph")?;
    let t_launch = time(&mut || graph.launch().map_err(e))?;
    let refs: Vec<_> = small.iter().map(|(w, n, k)| (w, *n, *k)).collect();
    let mut chain = GemvChain::new(gpu, &refs).map_err(e)?;
    let t_persist = time(&mut || chain.run(gpu, &mut ya, &mut yb).map_err(e))?;
    println!(
        "     GEMV chain of 48 [512, 512] (25 MB): launches {:.2} us a GEMV, persistent {:.2} us a GEMV (a barrier and \
         the dependent reads)",
        per(t_launch),
        per(t_persist)
    );
    Ok(())
}
