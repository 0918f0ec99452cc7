//! Checks on pointer, size and string arguments, done before anything
//! changes.

use std::ffi::{c_char, CStr};
use std::mem::{align_of, size_of};

use super::status::FfiError;

/// `p` as a shared reference, or `STRATA_ERR_NULL_POINTER` naming `arg`.
///
/// # Safety
/// `p` is NULL or valid for reads for the duration of the call.
pub(crate) unsafe fn get<'a, T>(p: *const T, arg: &str) -> Result<&'a T, FfiError> {
    p.as_ref().ok_or_else(|| FfiError::null(arg))
}

/// Checks that an output pointer is not NULL.
pub(crate) fn out<T>(p: *mut T, arg: &str) -> Result<*mut T, FfiError> {
    if p.is_null() {
        Err(FfiError::null(arg))
    } else {
        Ok(p)
    }
}

fn check_extent<T>(p: *const T, n: usize, arg: &str) -> Result<(), FfiError> {
    if n.checked_mul(size_of::<T>()).is_none_or(|bytes| bytes > isize::MAX as usize) {
        return Err(FfiError::invalid(format!("{arg}: {n} elements do not fit in memory")));
    }
    if p.is_null() {
        return Err(FfiError::null(arg));
    }
    if p as usize % align_of::<T>() != 0 {
        return Err(FfiError::invalid(format!("{arg} is not aligned for its element type")));
    }
    Ok(())
}

/// `n` elements at `p`; NULL is allowed when `n` is 0.
///
/// # Safety
/// When `n > 0`, `p` is valid for reads of `n` elements during the call.
pub(crate) unsafe fn slice<'a, T>(p: *const T, n: usize, arg: &str) -> Result<&'a [T], FfiError> {
    if n == 0 {
        return Ok(&[]);
    }
    check_extent(p, n, arg)?;
    Ok(std::slice::from_raw_parts(p, n))
}

/// `n` writable elements at `p`; NULL is allowed when `n` is 0.
///
/// # Safety
/// When `n > 0`, `p` is valid for writes of `n` elements during the call
/// and not aliased by any other argument.
pub(crate) unsafe fn slice_mut<'a, T>(p: *mut T, n: usize, arg: &str) -> Result<&'a mut [T], FfiError> {
    if n == 0 {
        return Ok(&mut []);
    }
    check_extent(p, n, arg)?;
    Ok(std::slice::from_raw_parts_mut(p, n))
}

/// A NUL-terminated UTF-8 string.
///
/// # Safety
/// `p` is NULL or a NUL-terminated string readable during the call.
pub(crate) unsafe fn c_str<'a>(p: *const c_char, arg: &str) -> Result<&'a str, FfiError> {
    if p.is_null() {
        return Err(FfiError::null(arg));
    }
    utf8(CStr::from_ptr(p).to_bytes(), arg)
}

/// UTF-8 text, or `STRATA_ERR_INVALID_ARGUMENT` saying where it is not.
pub(crate) fn utf8<'a>(bytes: &'a [u8], arg: &str) -> Result<&'a str, FfiError> {
    std::str::from_utf8(bytes).map_err(|e| {
        FfiError::invalid(format!("{arg} is not valid UTF-8 (invalid byte at offset {})", e.valid_up_to()))
    })
}

/// A token id from C, checked against the vocabulary.
pub(crate) fn token(t: i32, index: usize, vocab: usize) -> Result<u32, crate::Error> {
    match u32::try_from(t) {
        Ok(u) if (u as usize) < vocab => Ok(u),
        _ => Err(crate::Error::TokenOutOfRange { token: t.into(), index, vocab }),
    }
}
