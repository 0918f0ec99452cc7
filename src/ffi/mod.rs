//! The C ABI (include/strata.h, generated from this module by cbindgen;
//! guide: docs/c-api.md). The only home of `extern "C"` in the crate.
//!
//! Rules every entry point follows:
//! - its whole body runs inside one panic boundary (`status::catch`): a
//!   panic becomes `STRATA_ERR_INTERNAL` with its message;
//! - every pointer is checked for NULL, sizes for overflow, strings for
//!   UTF-8, token ids against the vocabulary, all before anything changes;
//! - a failure returns a `strata_status` and leaves its message for
//!   `strata_last_error()` on the calling thread;
//! - params structs are versioned by their leading `struct_size` (`params`);
//! - a session is used by one call at a time: a concurrent call gets
//!   `STRATA_ERR_BUSY` from a `try_lock`, never a wait.

// The header lists items in this order (each declaration in its own group
// so that rustfmt keeps it): library-level calls, logging, engine, session,
// then the plugin table.
pub mod status;

pub mod log;

pub mod engine;

pub mod session;

pub mod api;

mod args;
pub(crate) mod params;
#[cfg(feature = "test-hooks")]
pub mod test_hooks;

pub use api::*;
pub use engine::*;
pub use log::*;
pub use session::*;
pub use status::*;
#[cfg(feature = "test-hooks")]
pub use test_hooks::*;

/// The ABI version this library implements (`strata_abi_version()`).
pub const STRATA_ABI_VERSION: u32 = 1;
