//! GPU tests of the device infrastructure: copies, fill, kernel lookup and
//! the measured ceilings.

use std::sync::Arc;

use strata::backend::cuda::{ceilings, Gpu};

use super::common::{check_close, e, poisoned, rand_f32, GpuTest};

pub const TESTS: &[GpuTest] = &[
    ("infra_upload_download_round_trip", upload_download_round_trip),
    ("infra_fill_f32_overwrites_every_element", fill_f32_overwrites_every_element),
    ("infra_unknown_kernel_is_named", unknown_kernel_is_named),
    ("infra_ceilings_are_plausible", ceilings_are_plausible),
];

fn upload_download_round_trip(gpu: &Arc<Gpu>) -> Result<(), String> {
    let host = rand_f32(1, 100_003, 3.0);
    let d = gpu.upload(&host).map_err(e)?;
    let back = gpu.download(&d).map_err(e)?;
    if back != host {
        return Err("f32 round trip changed the data".into());
    }
    let words: Vec<u64> = (0..4097u64).map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15)).collect();
    let back = gpu.download(&gpu.upload(&words).map_err(e)?).map_err(e)?;
    if back != words {
        return Err("u64 round trip changed the data".into());
    }
    let zeros = gpu.download(&gpu.alloc_zeros::<f32>(777).map_err(e)?).map_err(e)?;
    if zeros.iter().any(|&z| z != 0.0) {
        return Err("alloc_zeros gave a non-zero value".into());
    }
    Ok(())
}

fn fill_f32_overwrites_every_element(gpu: &Arc<Gpu>) -> Result<(), String> {
    // A length that is not a multiple of the block size, and one larger than
    // a single grid-stride pass.
    for n in [1usize, 1000, gpu.sm_count() as usize * 32 * 256 * 2 + 17] {
        let mut d = gpu.upload(&rand_f32(2, n, 1.0)).map_err(e)?;
        gpu.fill_f32(&mut d, 1.5).map_err(e)?;
        check_close(&format!("fill {n}"), &gpu.download(&d).map_err(e)?, &vec![1.5; n], 0.0)?;
        let nan = gpu.download(&poisoned(gpu, n)?).map_err(e)?;
        if let Some(i) = nan.iter().position(|v| !v.is_nan()) {
            return Err(format!("poisoned({n})[{i}] = {}", nan[i]));
        }
    }
    let mut empty = gpu.alloc_zeros::<f32>(0).map_err(e)?;
    gpu.fill_f32(&mut empty, 0.0).map_err(e)?;
    gpu.sync().map_err(e)
}

fn unknown_kernel_is_named(gpu: &Arc<Gpu>) -> Result<(), String> {
    gpu.function("infra_fill_f32").map_err(e)?;
    match gpu.function("no_such_kernel") {
        Ok(_) => Err("looking up no_such_kernel succeeded".into()),
        Err(err) if err.to_string().contains("no_such_kernel") => Ok(()),
        Err(err) => Err(format!("the error does not name the kernel: {err}")),
    }
}

fn ceilings_are_plausible(gpu: &Arc<Gpu>) -> Result<(), String> {
    let hbm = ceilings::hbm_bandwidth(gpu).map_err(e)?;
    let tensor = ceilings::bf16_tensor_rate(gpu).map_err(e)?;
    let h2d = ceilings::h2d_pinned_bandwidth(gpu).map_err(e)?;
    let in_place = ceilings::host_read_in_place_bandwidth(gpu).map_err(e)?;
    println!(
        "     ceilings: HBM {:.0} GB/s (read + write), BF16 tensor {:.0} TFLOP/s, pinned H2D {:.1} GB/s, host memory \
         read in place {:.1} GB/s",
        hbm / 1e9,
        tensor / 1e12,
        h2d / 1e9,
        in_place / 1e9
    );
    // Wide bounds: any CUDA GPU of this decade, and no unit mistakes.
    for (what, v, lo, hi) in [
        ("HBM bandwidth", hbm, 50e9, 50e12),
        ("BF16 rate", tensor, 5e12, 20e15),
        ("pinned H2D", h2d, 1e9, 1e12),
        ("host read in place", in_place, 1e9, 1e12),
    ] {
        if !v.is_finite() || v < lo || v > hi {
            return Err(format!("{what} = {v:.3e} is outside [{lo:.0e}, {hi:.0e}]"));
        }
    }
    Ok(())
}
