//! Versioned params structs: every one begins with `uint32_t struct_size`,
//! fields are only ever appended, and the library reads (or writes) only
//! the fields that the caller's `struct_size` covers. A smaller struct from
//! an older caller gets defaults for the fields it lacks; a larger one from
//! a newer caller has its unknown tail ignored.

use std::mem::size_of;
use std::ptr;

use super::status::FfiError;

/// The largest `struct_size` accepted: anything bigger is a bug (an
/// uninitialized size), not a future version.
pub(crate) const MAX_STRUCT_SIZE: u32 = 64 * 1024;

/// How a field's bytes are checked before they are trusted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Any bit pattern is a valid value (integers, floats, pointers,
    /// nullable function pointers).
    Plain,
    /// A C `bool`: 0 or 1.
    Bool,
    /// A C enum (4 bytes) with valid values `0..=max`.
    Enum { max: u32 },
}

#[derive(Clone, Copy, Debug)]
pub(crate) struct Field {
    pub name: &'static str,
    pub offset: usize,
    pub size: usize,
    pub kind: Kind,
}

pub(crate) fn size_of_field<T, F>(_: impl Fn(&T) -> &F) -> usize {
    size_of::<F>()
}

/// A `Field` of struct `$t`.
macro_rules! field {
    ($t:ty, $f:ident, $kind:expr) => {
        $crate::ffi::params::Field {
            name: stringify!($f),
            offset: std::mem::offset_of!($t, $f),
            size: $crate::ffi::params::size_of_field(|s: &$t| &s.$f),
            kind: $kind,
        }
    };
}
pub(crate) use field;

/// A `#[repr(C)]` params struct that starts with `struct_size: u32`.
///
/// # Safety
/// `fields()` must list fields of `Self` (after `struct_size`) with their
/// true offsets and sizes, and give every `bool` field `Kind::Bool` and
/// every enum field `Kind::Enum` with its largest value; `read` relies on
/// it to build only valid values.
pub(crate) unsafe trait Versioned: Copy {
    /// The C type name, for messages.
    const NAME: &'static str;
    fn defaults() -> Self;
    fn fields() -> Vec<Field>;
}

fn check_struct_size<T: Versioned>(size: u32) -> Result<usize, FfiError> {
    if !(4..=MAX_STRUCT_SIZE).contains(&size) {
        return Err(FfiError::invalid(format!(
            "{}.struct_size is {size}: it must be at least 4 and at most {MAX_STRUCT_SIZE} (set it to sizeof({}))",
            T::NAME,
            T::NAME
        )));
    }
    Ok(size as usize)
}

fn check_field(name: &str, f: &Field, bytes: &[u8]) -> Result<(), FfiError> {
    match f.kind {
        Kind::Plain => Ok(()),
        Kind::Bool if bytes[0] <= 1 => Ok(()),
        Kind::Bool => Err(FfiError::invalid(format!("{name}.{} is {}: a bool must be 0 or 1", f.name, bytes[0]))),
        Kind::Enum { max } => {
            let v = u32::from_ne_bytes(bytes.try_into().expect("enums are 4 bytes"));
            if v <= max {
                Ok(())
            } else {
                Err(FfiError::invalid(format!("{name}.{} is {v}: valid values are 0..={max}", f.name)))
            }
        }
    }
}

/// Reads a caller's params struct: NULL gives the defaults; otherwise the
/// fields that `struct_size` covers entirely are checked and copied over
/// the defaults, and the rest keep their defaults.
///
/// # Safety
/// `p` is NULL or points to at least `p->struct_size` readable bytes.
pub(crate) unsafe fn read<T: Versioned>(p: *const T) -> Result<T, FfiError> {
    let mut out = T::defaults();
    if p.is_null() {
        return Ok(out);
    }
    let src = p as *const u8;
    let size = check_struct_size::<T>(ptr::read_unaligned(src as *const u32))?;
    let dst = &mut out as *mut T as *mut u8;
    for f in T::fields() {
        if f.offset + f.size > size {
            continue;
        }
        let bytes = std::slice::from_raw_parts(src.add(f.offset), f.size);
        check_field(T::NAME, &f, bytes)?;
        // SAFETY: the field lies inside T (trait contract) and its bytes
        // were checked to be a valid value of its type.
        ptr::copy_nonoverlapping(bytes.as_ptr(), dst.add(f.offset), f.size);
    }
    Ok(out)
}

/// Writes `value` into the first `struct_size` bytes at `out`: fields the
/// size covers entirely get their values, every other byte up to
/// `struct_size` becomes 0 (a newer caller's fields: 0 is their default),
/// and `out->struct_size` is set to `struct_size`.
///
/// # Safety
/// `out` points to at least `struct_size` writable bytes.
pub(crate) unsafe fn write<T: Versioned>(value: &T, out: *mut T, struct_size: u32) -> Result<(), FfiError> {
    let size = check_struct_size::<T>(struct_size)?;
    let dst = out as *mut u8;
    let src = value as *const T as *const u8;
    ptr::write_bytes(dst, 0, size);
    for f in T::fields() {
        if f.offset + f.size <= size {
            ptr::copy_nonoverlapping(src.add(f.offset), dst.add(f.offset), f.size);
        }
    }
    ptr::write_unaligned(dst as *mut u32, struct_size);
    Ok(())
}

/// `write` for an output struct whose caller set `out->struct_size`.
///
/// # Safety
/// `out` is NULL-checked by the caller and points to at least
/// `out->struct_size` writable bytes.
pub(crate) unsafe fn write_sized<T: Versioned>(value: &T, out: *mut T) -> Result<(), FfiError> {
    let size = ptr::read_unaligned(out as *const u32);
    write(value, out, size)
}

#[cfg(test)]
mod tests {
    use super::super::{strata_engine_params, strata_model_info, strata_sampling_params, strata_session_params};
    use super::*;

    /// Fields are in order, do not overlap, fit in the struct, and cover
    /// every byte that is not alignment padding.
    fn check_layout<T: Versioned>(struct_size_offset: usize) {
        assert_eq!(struct_size_offset, 0, "{}: struct_size comes first", T::NAME);
        let fields = T::fields();
        let mut end = 4;
        for f in &fields {
            assert!(f.offset >= end, "{}.{} overlaps", T::NAME, f.name);
            let align = f.size.min(8);
            assert!(f.offset - end < align.max(1), "{}.{}: gap of {} bytes before it", T::NAME, f.name, f.offset - end);
            end = f.offset + f.size;
        }
        assert!(end <= size_of::<T>() && size_of::<T>() - end < 8, "{}: {end} of {}", T::NAME, size_of::<T>());
    }

    #[test]
    fn field_tables_describe_the_structs() {
        use std::mem::offset_of;
        check_layout::<strata_engine_params>(offset_of!(strata_engine_params, struct_size));
        check_layout::<strata_model_info>(offset_of!(strata_model_info, struct_size));
        check_layout::<strata_session_params>(offset_of!(strata_session_params, struct_size));
        check_layout::<strata_sampling_params>(offset_of!(strata_sampling_params, struct_size));
        assert_eq!(strata_engine_params::fields().len(), 14);
        assert_eq!(strata_model_info::fields().len(), 7);
        assert_eq!(strata_session_params::fields().len(), 6);
        assert_eq!(strata_sampling_params::fields().len(), 5);
    }
}
