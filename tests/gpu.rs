//! The GPU suite: every kernel against the CPU reference on the first CUDA
//! device (kernels/README.md). Its own harness (harness = false): one line
//! per test, then `gpu suite: N passed, M failed`. Without a device it says
//! so and passes, unless STRATA_REQUIRE_GPU=1.
//!
//! `cargo test --release --features cuda,test-hooks --test gpu [NAME_FILTER...]`
//! (`STRATA_GPU_SKIP=timing,...` skips tests whose name contains any of
//! those; the compute-sanitizer pass skips the timing tests).

use std::panic::{self, AssertUnwindSafe};
use std::process::ExitCode;
use std::time::Instant;

use strata::backend::cuda::Gpu;
use strata::error::Error;

mod gpu {
    #[path = "../gpu/attention.rs"]
    pub mod attention;
    #[path = "../gpu/common.rs"]
    pub mod common;
    #[path = "../gpu/deltanet.rs"]
    pub mod deltanet;
    #[path = "../gpu/dense.rs"]
    pub mod dense;
    #[path = "../gpu/experts.rs"]
    pub mod experts;
    #[path = "../gpu/infra.rs"]
    pub mod infra;
    #[path = "../gpu/model.rs"]
    pub mod model;
    #[path = "../gpu/moe.rs"]
    pub mod moe;
    #[path = "../gpu/sampling.rs"]
    pub mod sampling;
    #[path = "../gpu/split.rs"]
    pub mod split;
}

use gpu::common::GpuTest;

fn main() -> ExitCode {
    let filters: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with('-')).collect();
    // STRATA_GPU_SKIP=timing,foo: skip tests whose name contains any of these
    // (the compute-sanitizer pass skips the timing tests).
    let skips: Vec<String> = std::env::var("STRATA_GPU_SKIP")
        .map(|v| v.split(',').filter(|s| !s.is_empty()).map(str::to_string).collect())
        .unwrap_or_default();
    let gpu = match Gpu::open(0) {
        Ok(gpu) => gpu,
        Err(e) => {
            match e {
                Error::NoCuda(why) => println!("no CUDA device: {why}: GPU suite not run"),
                e => println!("{e}: GPU suite not run"),
            }
            let required = std::env::var("STRATA_REQUIRE_GPU").is_ok_and(|v| v == "1");
            return if required { ExitCode::FAILURE } else { ExitCode::SUCCESS };
        }
    };
    let (major, minor) = gpu.compute_capability();
    println!("device cuda:0: {} (compute capability {major}.{minor}, {} SMs)", gpu.name(), gpu.sm_count());

    let suites: [&[GpuTest]; 9] = [
        gpu::infra::TESTS,
        gpu::moe::TESTS,
        gpu::dense::TESTS,
        gpu::attention::TESTS,
        gpu::deltanet::TESTS,
        gpu::model::TESTS,
        gpu::experts::TESTS,
        gpu::split::TESTS,
        gpu::sampling::TESTS,
    ];
    let (mut passed, mut failed) = (0, 0);
    for &(name, test) in suites.iter().flat_map(|s| s.iter()) {
        if (!filters.is_empty() && !filters.iter().any(|f| name.contains(f.as_str())))
            || skips.iter().any(|s| name.contains(s.as_str()))
        {
            continue;
        }
        let started = Instant::now();
        let outcome = panic::catch_unwind(AssertUnwindSafe(|| test(&gpu)));
        let ms = started.elapsed().as_secs_f64() * 1e3;
        let failure = match outcome {
            Ok(Ok(())) => None,
            Ok(Err(msg)) => Some(msg),
            Err(payload) => Some(format!(
                "panicked: {}",
                payload
                    .downcast_ref::<String>()
                    .map(String::as_str)
                    .or_else(|| payload.downcast_ref::<&str>().copied())
                    .unwrap_or("(no message)")
            )),
        };
        match failure {
            None => {
                passed += 1;
                println!("ok   {name}  ({ms:.1} ms)");
            }
            Some(msg) => {
                failed += 1;
                println!("FAIL {name}: {msg}");
            }
        }
    }
    println!("gpu suite: {passed} passed, {failed} failed");
    if failed > 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
