//! The log callback: one per process, set by `strata_set_log_callback`.

use std::cell::Cell;
use std::ffi::{c_char, c_void, CString};
use std::sync::atomic::{AtomicU32, Ordering};

use parking_lot::Mutex;

use super::status::{run, strata_status, FfiError};

/// Severity of a log message; a callback receives messages up to the
/// `max_level` it was registered with. Values are fixed.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum strata_log_level {
    STRATA_LOG_ERROR = 0,
    STRATA_LOG_WARN = 1,
    STRATA_LOG_INFO = 2,
    STRATA_LOG_DEBUG = 3,
}

/// A `strata_log_level` as a caller passes it in, read as an integer so an
/// unknown value is an `STRATA_ERR_INVALID_ARGUMENT`, not undefined
/// behaviour. The header shows it as `strata_log_level`.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LogLevelCode(pub u32);

/// Receives the library's log messages. `message` is a NUL-terminated
/// UTF-8 string owned by the library and valid only during the call (copy
/// it to keep it). Calls are serialized (never two at once) but may come
/// from any thread. The callback must return normally (no longjmp, no C++
/// exception) and must not call `strata_set_log_callback` (that call
/// would return `STRATA_ERR_BUSY`); messages caused by strata calls made
/// from inside the callback are dropped.
#[allow(non_camel_case_types)]
pub type strata_log_fn =
    Option<unsafe extern "C" fn(user_data: *mut c_void, level: strata_log_level, message: *const c_char)>;

struct Sink {
    callback: unsafe extern "C" fn(*mut c_void, strata_log_level, *const c_char),
    user_data: *mut c_void,
    max_level: strata_log_level,
}

// SAFETY: the caller of strata_set_log_callback promises that user_data may
// be used from any thread (documented there); calls are serialized by SINK.
unsafe impl Send for Sink {}

static SINK: Mutex<Option<Sink>> = parking_lot::const_mutex(None);
/// `max_level + 1` of the registered callback, 0 when there is none: skips
/// the lock and formatting when nobody listens.
static ENABLED_BELOW: AtomicU32 = AtomicU32::new(0);

thread_local! {
    static IN_CALLBACK: Cell<bool> = const { Cell::new(false) };
}

/// Sends `message` to the registered callback, if it wants `level`.
pub(crate) fn log(level: strata_log_level, message: &str) {
    if level as u32 >= ENABLED_BELOW.load(Ordering::Acquire) || IN_CALLBACK.with(|c| c.get()) {
        return;
    }
    let sink = SINK.lock();
    let Some(s) = &*sink else { return };
    if level > s.max_level {
        return;
    }
    let text = CString::new(message.replace('\0', "\\0")).expect("NULs were replaced");
    IN_CALLBACK.with(|c| c.set(true));
    // SAFETY: the callback and user_data were registered together by the
    // caller of strata_set_log_callback, who vouches for them.
    unsafe { (s.callback)(s.user_data, level, text.as_ptr()) };
    IN_CALLBACK.with(|c| c.set(false));
}

/// Sets the process-wide log callback, replacing any previous one; NULL
/// turns logging off. The library logs engine loads (INFO) and every
/// failed call (ERROR; WARN for BUSY, NOT_FOUND and CANCELLED; DEBUG for
/// BUFFER_TOO_SMALL). Messages above `max_level` are not sent. After this
/// returns, the previous callback is never called again, so its
/// `user_data` may be freed.
///
/// Thread-safety: may be called from any thread, but not from inside the
/// log callback itself (returns `STRATA_ERR_BUSY` there).
///
/// # Safety
/// `callback`, when not NULL, must be a valid function that may be called
/// from any thread with `user_data` until the callback is replaced.
#[no_mangle]
pub unsafe extern "C" fn strata_set_log_callback(
    callback: strata_log_fn,
    user_data: *mut c_void,
    max_level: LogLevelCode,
) -> strata_status {
    run("strata_set_log_callback", || {
        use strata_log_level::*;
        let max_level = match max_level.0 {
            0 => STRATA_LOG_ERROR,
            1 => STRATA_LOG_WARN,
            2 => STRATA_LOG_INFO,
            3 => STRATA_LOG_DEBUG,
            other => return Err(FfiError::invalid(format!("max_level {other} is not a strata_log_level (0..=3)"))),
        };
        if IN_CALLBACK.with(|c| c.get()) {
            return Err(FfiError::new(
                strata_status::STRATA_ERR_BUSY,
                "called from inside the log callback; set the callback from outside it",
            ));
        }
        let mut sink = SINK.lock();
        *sink = callback.map(|callback| Sink { callback, user_data, max_level });
        let enabled = if sink.is_some() { max_level as u32 + 1 } else { 0 };
        ENABLED_BELOW.store(enabled, Ordering::Release);
        Ok(())
    })
}
