//! Without a CUDA driver or device the library still loads and reports
//! STRATA_ERR_NO_CUDA with the cause, in both builds.

use std::ffi::{c_char, CStr};
use std::mem::{size_of, MaybeUninit};
use std::ptr;

use strata::ffi::strata_status::*;
use strata::ffi::*;
use strata::model::Arch;
use strata::pack::synth::{self, SynthOptions};

#[test]
fn a_cuda_device_through_the_c_api_is_no_cuda_with_the_cause() {
    #[cfg(feature = "cuda")]
    if strata::backend::cuda::device_count().is_ok() {
        return; // a machine with a device: the engine runs there (tests/gpu.rs)
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("pack");
    let config = synth::preset(Arch::Qwen3Moe, "tiny").unwrap();
    synth::synth(&config, &path, &SynthOptions::default()).unwrap();
    let cpath = std::ffi::CString::new(path.to_str().unwrap()).unwrap();

    let mut p = MaybeUninit::<strata_engine_params>::uninit();
    let st = unsafe { strata_engine_default_params(p.as_mut_ptr(), size_of::<strata_engine_params>() as u32) };
    assert_eq!(st, STRATA_OK);
    let mut p = unsafe { p.assume_init() };
    let devices: [*const c_char; 2] = [c"cuda".as_ptr(), ptr::null()];
    p.devices = devices.as_ptr();
    let mut engine = ptr::null_mut();
    let st = unsafe { strata_engine_load(cpath.as_ptr(), &p, &mut engine) };
    assert_eq!(st, STRATA_ERR_NO_CUDA);
    assert!(engine.is_null());
    let msg = unsafe { CStr::from_ptr(strata_last_error()) }.to_str().unwrap().to_string();
    // "<entry point>: <error>"
    assert!(msg.starts_with("strata_engine_load: no CUDA device: "), "{msg}");

    #[cfg(not(feature = "cuda"))]
    assert!(msg.contains("feature cuda"), "{msg}");
    #[cfg(feature = "cuda")]
    {
        use strata::backend::cuda;
        if !cuda::driver_library_present() {
            assert!(msg.contains("the CUDA driver library (libcuda.so.1) was not found"), "{msg}");
        }
        let err = cuda::device_count().unwrap_err();
        assert_eq!(msg, format!("strata_engine_load: {err}"));
    }
}

/// The GPU API itself, without a driver: NoCuda, never a panic.
#[cfg(feature = "cuda")]
#[test]
fn gpu_open_without_a_driver_is_no_cuda() {
    use strata::backend::cuda::{self, Gpu};
    use strata::error::Error;
    if cuda::driver_library_present() {
        return; // a machine with a driver: tests/gpu.rs covers it
    }
    for result in [cuda::device_count().map(|_| ()), Gpu::open(0).map(|_| ()), cuda::probe(3)] {
        match result {
            Err(Error::NoCuda(m)) => assert_eq!(m, "the CUDA driver library (libcuda.so.1) was not found"),
            other => panic!("{other:?}"),
        }
    }
}
