//! Entry points for the tests of the C boundary (feature `test-hooks`,
//! off by default). They are excluded from include/strata.h and from
//! include/strata.symbols.

use super::session::{lock, strata_session};
use super::status::{run, strata_status};

/// Panics inside the panic boundary: returns `STRATA_ERR_INTERNAL` with the
/// panic message in `strata_last_error()`.
#[no_mangle]
pub extern "C" fn strata_test_force_panic() -> strata_status {
    run("strata_test_force_panic", || panic!("forced panic from strata_test_force_panic"))
}

/// Holds the session's lock for `millis` milliseconds, as a long call
/// would, so that other calls on the session see `STRATA_ERR_BUSY`.
///
/// # Safety
/// `s` NULL or a live session.
#[no_mangle]
pub unsafe extern "C" fn strata_test_hold_session(s: *mut strata_session, millis: u32) -> strata_status {
    run("strata_test_hold_session", || {
        let _guard = lock(s)?;
        std::thread::sleep(std::time::Duration::from_millis(millis.into()));
        Ok(())
    })
}

/// Panics while holding the session's lock, which poisons it: later calls
/// on the session return `STRATA_ERR_INTERNAL`.
///
/// # Safety
/// `s` NULL or a live session.
#[no_mangle]
pub unsafe extern "C" fn strata_test_panic_in_session(s: *mut strata_session) -> strata_status {
    run("strata_test_panic_in_session", || {
        let _guard = lock(s)?;
        panic!("forced panic while holding the session")
    })
}
