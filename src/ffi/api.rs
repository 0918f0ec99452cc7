//! The plugin table: one symbol (`strata_get_api`) that hands a host every
//! function, for hosts that `dlopen` the library.

use std::ffi::{c_char, c_void};

use super::engine::*;
use super::log::*;
use super::session::*;
use super::status::*;

/// Every function of the C API, as pointers; names drop the `strata_`
/// prefix. Returned by `strata_get_api`. Fields are only ever appended:
/// check `struct_size` before using a field added after ABI version 1.
#[allow(non_camel_case_types)]
#[repr(C)]
pub struct strata_api {
    /// `sizeof(strata_api)` of the library that filled the table.
    pub struct_size: u32,
    /// The library's ABI version (`strata_abi_version()`).
    pub abi_version: u32,
    pub version: unsafe extern "C" fn() -> *const c_char,
    pub abi_version_fn: unsafe extern "C" fn() -> u32,
    pub status_message: unsafe extern "C" fn(status: StatusCode) -> *const c_char,
    pub last_error: unsafe extern "C" fn() -> *const c_char,
    pub set_log_callback:
        unsafe extern "C" fn(callback: strata_log_fn, user_data: *mut c_void, max_level: LogLevelCode) -> strata_status,
    pub engine_default_params: unsafe extern "C" fn(out: *mut strata_engine_params, struct_size: u32) -> strata_status,
    pub engine_load: unsafe extern "C" fn(
        pack_path: *const c_char,
        params: *const strata_engine_params,
        out: *mut *mut strata_engine,
    ) -> strata_status,
    pub engine_free: unsafe extern "C" fn(engine: *mut strata_engine),
    pub engine_info: unsafe extern "C" fn(engine: *const strata_engine, out: *mut strata_model_info) -> strata_status,
    pub session_default_params:
        unsafe extern "C" fn(out: *mut strata_session_params, struct_size: u32) -> strata_status,
    pub session_open: unsafe extern "C" fn(
        engine: *mut strata_engine,
        params: *const strata_session_params,
        out: *mut *mut strata_session,
    ) -> strata_status,
    pub session_free: unsafe extern "C" fn(session: *mut strata_session),
    pub session_prefill:
        unsafe extern "C" fn(s: *mut strata_session, tokens: *const i32, n_tokens: usize) -> strata_status,
    pub sampling_default_params:
        unsafe extern "C" fn(out: *mut strata_sampling_params, struct_size: u32) -> strata_status,
    pub session_step: unsafe extern "C" fn(
        s: *mut strata_session,
        params: *const strata_sampling_params,
        out_token: *mut i32,
    ) -> strata_status,
    pub session_logits: unsafe extern "C" fn(
        s: *mut strata_session,
        index: i64,
        buf: *mut f32,
        buf_len: usize,
        n_out: *mut usize,
    ) -> strata_status,
    pub session_position: unsafe extern "C" fn(s: *mut strata_session, out: *mut usize) -> strata_status,
    pub session_checkpoint: unsafe extern "C" fn(s: *mut strata_session, out_id: *mut u64) -> strata_status,
    pub session_rewind: unsafe extern "C" fn(s: *mut strata_session, checkpoint_id: u64) -> strata_status,
    pub session_rewind_to: unsafe extern "C" fn(s: *mut strata_session, position: usize) -> strata_status,
    pub session_state_size: unsafe extern "C" fn(s: *mut strata_session, out: *mut usize) -> strata_status,
    pub session_state_save:
        unsafe extern "C" fn(s: *mut strata_session, buf: *mut u8, buf_len: usize, n_out: *mut usize) -> strata_status,
    pub session_state_load: unsafe extern "C" fn(s: *mut strata_session, buf: *const u8, len: usize) -> strata_status,
    pub tokenize: unsafe extern "C" fn(
        engine: *const strata_engine,
        text: *const c_char,
        text_len: usize,
        tokens: *mut i32,
        cap: usize,
        n_out: *mut usize,
    ) -> strata_status,
    pub detokenize: unsafe extern "C" fn(
        engine: *const strata_engine,
        tokens: *const i32,
        n: usize,
        buf: *mut c_char,
        cap: usize,
        n_out: *mut usize,
    ) -> strata_status,
    /// Added in ABI 1 after the first draft of the table.
    pub session_checkpoint_release: unsafe extern "C" fn(s: *mut strata_session, checkpoint_id: u64) -> strata_status,
    /// Added in ABI 1 with prefix reuse: check `struct_size` covers it.
    pub session_prefill_conversation: unsafe extern "C" fn(
        s: *mut strata_session,
        tokens: *const i32,
        n_tokens: usize,
        out_reused: *mut usize,
        out_read: *mut usize,
    ) -> strata_status,
    /// Added in ABI 1 with end-of-generation tokens: check `struct_size`
    /// covers it.
    pub engine_eos_tokens: unsafe extern "C" fn(
        engine: *const strata_engine,
        tokens: *mut i32,
        cap: usize,
        n_out: *mut usize,
    ) -> strata_status,
}

static API: strata_api = strata_api {
    struct_size: std::mem::size_of::<strata_api>() as u32,
    abi_version: super::STRATA_ABI_VERSION,
    version: strata_version,
    abi_version_fn: strata_abi_version,
    status_message: strata_status_message,
    last_error: strata_last_error,
    set_log_callback: strata_set_log_callback,
    engine_default_params: strata_engine_default_params,
    engine_load: strata_engine_load,
    engine_free: strata_engine_free,
    engine_info: strata_engine_info,
    session_default_params: strata_session_default_params,
    session_open: strata_session_open,
    session_free: strata_session_free,
    session_prefill: strata_session_prefill,
    sampling_default_params: strata_sampling_default_params,
    session_step: strata_session_step,
    session_logits: strata_session_logits,
    session_position: strata_session_position,
    session_checkpoint: strata_session_checkpoint,
    session_rewind: strata_session_rewind,
    session_rewind_to: strata_session_rewind_to,
    session_state_size: strata_session_state_size,
    session_state_save: strata_session_state_save,
    session_state_load: strata_session_state_load,
    tokenize: strata_tokenize,
    detokenize: strata_detokenize,
    session_checkpoint_release: strata_session_checkpoint_release,
    session_prefill_conversation: strata_session_prefill_conversation,
    engine_eos_tokens: strata_engine_eos_tokens,
};

/// The plugin entry point: `*out` = a static table of every function, for
/// a host that resolves this one symbol with dlsym. `abi_version` is the
/// version the host was built against (`STRATA_ABI_VERSION`); a version
/// newer than this library's fails with `STRATA_ERR_UNSUPPORTED`, 0 with
/// `STRATA_ERR_INVALID_ARGUMENT`. The table is never freed and never changes.
///
/// Thread-safety: any thread.
///
/// # Safety
/// `out` must be writable.
#[no_mangle]
pub unsafe extern "C" fn strata_get_api(abi_version: u32, out: *mut *const strata_api) -> strata_status {
    run("strata_get_api", || {
        let out = super::args::out(out, "out")?;
        *out = std::ptr::null();
        if abi_version == 0 {
            return Err(FfiError::invalid("abi_version 0 does not exist (pass STRATA_ABI_VERSION)"));
        }
        if abi_version > super::STRATA_ABI_VERSION {
            return Err(FfiError::new(
                strata_status::STRATA_ERR_UNSUPPORTED,
                format!(
                    "abi_version {abi_version} is newer than this library's {} (library version {})",
                    super::STRATA_ABI_VERSION,
                    env!("CARGO_PKG_VERSION")
                ),
            ));
        }
        *out = &API;
        Ok(())
    })
}
