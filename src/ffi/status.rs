//! Status codes, the thread's last error message, and the one panic
//! boundary every entry point runs inside.

use std::cell::RefCell;
use std::ffi::{c_char, CStr, CString};
use std::panic::{self, AssertUnwindSafe};

use super::log::{log, strata_log_level};
use crate::error::Error;

/// The result of every call that can fail. The values are fixed and never
/// renumbered; new codes are only appended. Every value has a message
/// (`strata_status_message`); the details of a failure are in
/// `strata_last_error()`.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum strata_status {
    /// Success.
    STRATA_OK = 0,
    /// A bad value: out of range, a bad `struct_size`, a string that is not
    /// UTF-8, a malformed session state.
    STRATA_ERR_INVALID_ARGUMENT = 1,
    /// A pointer argument that must not be NULL was NULL.
    STRATA_ERR_NULL_POINTER = 2,
    /// The operating system refused a file operation (missing, unreadable).
    STRATA_ERR_IO = 3,
    /// The pack is malformed, truncated, of another format version, or a
    /// checksum does not match.
    STRATA_ERR_BAD_PACK = 4,
    /// The pack or option needs something this build does not do.
    STRATA_ERR_UNSUPPORTED = 5,
    /// A token id is negative or not below the vocabulary size.
    STRATA_ERR_TOKEN_OUT_OF_RANGE = 6,
    /// The session's context cannot hold the tokens.
    STRATA_ERR_CONTEXT_OVERFLOW = 7,
    /// The session is in use by another thread; nothing was done.
    STRATA_ERR_BUSY = 8,
    /// A callback asked to stop (the load progress callback returned false).
    STRATA_ERR_CANCELLED = 9,
    /// No CUDA device or driver, or this build has no CUDA support.
    STRATA_ERR_NO_CUDA = 10,
    /// The pack has no tokenizer, or the tokenizer failed.
    STRATA_ERR_TOKENIZER = 11,
    /// An output buffer is too small; the call's `n_out` holds the size needed.
    STRATA_ERR_BUFFER_TOO_SMALL = 12,
    /// An unknown, released or invalidated checkpoint id.
    STRATA_ERR_NOT_FOUND = 13,
    /// The model produced NaN or infinity.
    STRATA_ERR_NONFINITE = 14,
    /// A bug in the library (a panic, caught at the boundary).
    STRATA_ERR_INTERNAL = 15,
}

use strata_status::*;

/// The ABI version of this library: 1. It only grows; a symbol, once
/// released, is never removed.
///
/// Thread-safety: any thread.
#[no_mangle]
pub extern "C" fn strata_abi_version() -> u32 {
    super::STRATA_ABI_VERSION
}

/// The version of this library, e.g. "0.1.0": a static string, never freed.
///
/// Thread-safety: any thread.
#[no_mangle]
pub extern "C" fn strata_version() -> *const c_char {
    const VERSION: &CStr = match CStr::from_bytes_with_nul(concat!(env!("CARGO_PKG_VERSION"), "\0").as_bytes()) {
        Ok(v) => v,
        Err(_) => panic!("the package version has a NUL"),
    };
    value("strata_version", c"".as_ptr(), || Ok(VERSION.as_ptr()))
}

/// A short static description of `status` (never NULL, never freed);
/// "unknown status" for a value that is not a `strata_status`.
///
/// Thread-safety: any thread.
#[no_mangle]
pub extern "C" fn strata_status_message(status: StatusCode) -> *const c_char {
    value("strata_status_message", c"unknown status".as_ptr(), || {
        let known: Option<strata_status> = status.into();
        Ok(known.map_or(c"unknown status", strata_status::message).as_ptr())
    })
}

/// The message of the last failed call on this thread: what went wrong and
/// the value, file or tensor at fault. Valid only after a call returned
/// something other than `STRATA_OK` (successful calls do not clear it);
/// "" before any failure. The string belongs to the library and is valid
/// until the next strata_ call on this thread; copy it to keep it.
///
/// Thread-safety: any thread; each thread has its own last error.
#[no_mangle]
pub extern "C" fn strata_last_error() -> *const c_char {
    value("strata_last_error", c"".as_ptr(), || Ok(last_error_ptr()))
}

/// A `strata_status` as a caller passes it in: read as an integer, so an
/// unknown value gets an answer instead of being undefined behaviour. The
/// header shows it as `strata_status` (cbindgen.toml renames it).
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StatusCode(pub u32);

/// Every status, in value order.
const ALL_STATUSES: [strata_status; 16] = [
    STRATA_OK,
    STRATA_ERR_INVALID_ARGUMENT,
    STRATA_ERR_NULL_POINTER,
    STRATA_ERR_IO,
    STRATA_ERR_BAD_PACK,
    STRATA_ERR_UNSUPPORTED,
    STRATA_ERR_TOKEN_OUT_OF_RANGE,
    STRATA_ERR_CONTEXT_OVERFLOW,
    STRATA_ERR_BUSY,
    STRATA_ERR_CANCELLED,
    STRATA_ERR_NO_CUDA,
    STRATA_ERR_TOKENIZER,
    STRATA_ERR_BUFFER_TOO_SMALL,
    STRATA_ERR_NOT_FOUND,
    STRATA_ERR_NONFINITE,
    STRATA_ERR_INTERNAL,
];

impl strata_status {
    /// The static text of this status.
    pub fn message(self) -> &'static CStr {
        match self {
            STRATA_OK => c"ok",
            STRATA_ERR_INVALID_ARGUMENT => c"invalid argument",
            STRATA_ERR_NULL_POINTER => c"null pointer",
            STRATA_ERR_IO => c"I/O error",
            STRATA_ERR_BAD_PACK => c"bad pack",
            STRATA_ERR_UNSUPPORTED => c"unsupported",
            STRATA_ERR_TOKEN_OUT_OF_RANGE => c"token out of range",
            STRATA_ERR_CONTEXT_OVERFLOW => c"context overflow",
            STRATA_ERR_BUSY => c"session busy (in use by another thread)",
            STRATA_ERR_CANCELLED => c"cancelled",
            STRATA_ERR_NO_CUDA => c"no CUDA device",
            STRATA_ERR_TOKENIZER => c"tokenizer error",
            STRATA_ERR_BUFFER_TOO_SMALL => c"buffer too small",
            STRATA_ERR_NOT_FOUND => c"not found",
            STRATA_ERR_NONFINITE => c"non-finite values",
            STRATA_ERR_INTERNAL => c"internal error",
        }
    }
}

impl From<StatusCode> for Option<strata_status> {
    fn from(code: StatusCode) -> Self {
        ALL_STATUSES.get(code.0 as usize).copied()
    }
}

/// The one place where library errors become statuses.
impl From<&Error> for strata_status {
    fn from(e: &Error) -> Self {
        match e {
            Error::Io { .. } => STRATA_ERR_IO,
            Error::BadPack { .. } | Error::PackVersion { .. } | Error::Checksum { .. } => STRATA_ERR_BAD_PACK,
            // A pack whose tensors or config contradict the model.
            Error::Tensor { .. } | Error::Config(_) => STRATA_ERR_BAD_PACK,
            // Conversion input (not reachable through the C API today).
            Error::BadCheckpoint { .. } => STRATA_ERR_INVALID_ARGUMENT,
            Error::Unsupported(_) => STRATA_ERR_UNSUPPORTED,
            Error::InvalidArgument(_) => STRATA_ERR_INVALID_ARGUMENT,
            Error::TokenOutOfRange { .. } => STRATA_ERR_TOKEN_OUT_OF_RANGE,
            Error::NotFound(_) => STRATA_ERR_NOT_FOUND,
            Error::NonFinite(_) => STRATA_ERR_NONFINITE,
            Error::ContextOverflow { .. } => STRATA_ERR_CONTEXT_OVERFLOW,
            Error::Tokenizer(_) => STRATA_ERR_TOKENIZER,
            Error::Cancelled => STRATA_ERR_CANCELLED,
            Error::NoCuda(_) => STRATA_ERR_NO_CUDA,
            // A failing driver or kernel call on a device that exists.
            Error::Cuda(_) => STRATA_ERR_INTERNAL,
        }
    }
}

/// A failure on its way out of an entry point: a status and its message.
#[derive(Debug)]
pub(crate) struct FfiError {
    pub status: strata_status,
    pub message: String,
}

impl FfiError {
    pub fn new(status: strata_status, message: impl Into<String>) -> FfiError {
        debug_assert_ne!(status, STRATA_OK);
        FfiError { status, message: message.into() }
    }

    pub fn invalid(message: impl Into<String>) -> FfiError {
        FfiError::new(STRATA_ERR_INVALID_ARGUMENT, message)
    }

    pub fn null(arg: &str) -> FfiError {
        FfiError::new(STRATA_ERR_NULL_POINTER, format!("{arg} is NULL"))
    }

    /// Records the failure as this thread's last error, logs it, and
    /// returns its status.
    fn record(self, func: &str) -> strata_status {
        let message = format!("{func}: {}", self.message);
        let level = match self.status {
            // Asking for a size is a normal way to call these functions.
            STRATA_ERR_BUFFER_TOO_SMALL => strata_log_level::STRATA_LOG_DEBUG,
            STRATA_ERR_BUSY | STRATA_ERR_NOT_FOUND | STRATA_ERR_CANCELLED => strata_log_level::STRATA_LOG_WARN,
            _ => strata_log_level::STRATA_LOG_ERROR,
        };
        // The last error before the log: a callback that asks for it sees
        // this one; and after it: a failing call inside the callback
        // recorded its own, and this call's is the last.
        set_last_error(&message);
        log(level, &message);
        set_last_error(&message);
        self.status
    }
}

impl From<Error> for FfiError {
    fn from(e: Error) -> Self {
        FfiError { status: (&e).into(), message: e.to_string() }
    }
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

// Both run outside `catch` (after it, and in `strata_last_error`), so they
// must not panic: on a thread whose thread-locals are being destroyed (a
// call from a pthread key's destructor) `with` would, and the error is then
// not kept (`strata_last_error` answers "").
fn set_last_error(message: &str) {
    let c = CString::new(message.replace('\0', "\\0")).unwrap_or_default();
    let _ = LAST_ERROR.try_with(|e| *e.borrow_mut() = c);
}

fn last_error_ptr() -> *const c_char {
    LAST_ERROR.try_with(|e| e.borrow().as_ptr()).unwrap_or(c"".as_ptr())
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".to_string()
    }
}

/// THE panic boundary: runs `f`, turning a panic into
/// `STRATA_ERR_INTERNAL` with the panic's message. Every entry point runs
/// its whole body inside it (through `run` or `value`).
pub(crate) fn catch<R>(f: impl FnOnce() -> Result<R, FfiError>) -> Result<R, FfiError> {
    match panic::catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(payload) => {
            let msg = format!("internal error (panic): {}", panic_message(&*payload));
            Err(FfiError::new(STRATA_ERR_INTERNAL, msg))
        }
    }
}

/// An entry point that returns a status; failures are recorded for
/// `strata_last_error` and logged.
pub(crate) fn run(func: &str, f: impl FnOnce() -> Result<(), FfiError>) -> strata_status {
    match catch(f) {
        Ok(()) => STRATA_OK,
        Err(e) => e.record(func),
    }
}

/// An entry point that returns a value (or nothing): `fallback` on failure,
/// which is recorded as in `run`.
pub(crate) fn value<R>(func: &str, fallback: R, f: impl FnOnce() -> Result<R, FfiError>) -> R {
    match catch(f) {
        Ok(r) => r,
        Err(e) => {
            e.record(func);
            fallback
        }
    }
}
