//! Token ids and block hashes from Python objects, without a per-item cost where the caller
//! can avoid it.
//!
//! A `list[int]` costs an extraction per token (tens of microseconds for an 8,000-token
//! prompt); `bytes` of little-endian u32s, or an `array.array("I")` / numpy `uint32` array
//! (anything with `itemsize == 4` and `tobytes()`), is copied in one go. Every id must fit
//! in a u32; anything else is a `ValueError` / `TypeError`, never a truncation.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyList, PyTuple};

/// Token ids from `obj` (see the module docs).
pub(crate) fn token_ids(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    if let Ok(b) = obj.cast::<PyBytes>() {
        return le_u32s(b.as_bytes());
    }
    if let Ok(b) = obj.cast::<PyByteArray>() {
        return le_u32s(&b.to_vec());
    }
    if obj.cast::<PyList>().is_err()
        && obj.cast::<PyTuple>().is_err()
        && let Ok(size) = obj.getattr("itemsize")
        && let Ok(size) = size.extract::<usize>()
        && obj.hasattr("tobytes")?
    {
        let raw = obj.call_method0("tobytes")?;
        let raw = raw.cast::<PyBytes>()?;
        return match (size, int_signedness(obj)?) {
            (4, false) => le_u32s(raw.as_bytes()),
            (4, true) => fixed::<4>(raw.as_bytes(), |b| i64::from(i32::from_le_bytes(b))),
            (8, false) => fixed::<8>(raw.as_bytes(), |b| {
                i64::try_from(u64::from_le_bytes(b)).unwrap_or(-1)
            }),
            (8, true) => fixed::<8>(raw.as_bytes(), i64::from_le_bytes),
            (n, _) => Err(PyTypeError::new_err(format!(
                "token ids: an array of {n}-byte items; use 4-byte (uint32) or 8-byte integers"
            ))),
        };
    }
    // A list is read straight through the C API (its common case: Dynamo's callers pass
    // lists); tuples item by item.
    if let Ok(list) = obj.cast::<PyList>() {
        return list_tokens(list);
    }
    if let Ok(tuple) = obj.cast::<PyTuple>() {
        return tuple.iter().map(|t| token(&t)).collect();
    }
    obj.extract::<Vec<u32>>().map_err(|e| {
        PyValueError::new_err(format!(
            "token ids must be a sequence of ints in 0..2**32 (or bytes of little-endian \
             u32s): {e}"
        ))
    })
}

/// A list's ids with two C calls per item, no reference counting: pyo3's sequence
/// extraction (iterator protocol, a new reference per item) costs about 2.5x as much.
fn list_tokens(list: &Bound<'_, PyList>) -> PyResult<Vec<u32>> {
    let py = list.py();
    let n = list.len();
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let Ok(index) = ffi::Py_ssize_t::try_from(i) else {
            break;
        };
        // SAFETY: we hold the GIL (`py`) and `list` is a live list. `PyList_GetItem` checks
        // the index and returns a borrowed reference (null with an exception set when out of
        // range). Nothing between here and the use of `item` can run Python code, so the
        // list cannot change under us: `PyLong_AsUnsignedLong` takes ints only (it calls no
        // `__index__`/`__int__`, raising TypeError instead).
        let item = unsafe { ffi::PyList_GetItem(list.as_ptr(), index) };
        if item.is_null() {
            return Err(PyErr::take(py).unwrap_or_else(|| {
                PyValueError::new_err("token ids: the list changed while being read")
            }));
        }
        // SAFETY: `item` is a non-null borrowed reference into the list (see above).
        let v = unsafe { ffi::PyLong_AsUnsignedLong(item) };
        if v == std::os::raw::c_ulong::MAX
            && let Some(e) = PyErr::take(py)
        {
            // SAFETY: `item` is still a valid borrowed reference; `from_borrowed_ptr` takes
            // a new reference for the message.
            let item = unsafe { Bound::from_borrowed_ptr(py, item) };
            return Err(PyValueError::new_err(format!(
                "token id {item} at index {i}: must be an int in 0..2**32 ({e})"
            )));
        }
        out.push(u32::try_from(v).map_err(|_| {
            PyValueError::new_err(format!("token id {v} at index {i} is outside 0..2**32"))
        })?);
    }
    Ok(out)
}

fn token(t: &Bound<'_, PyAny>) -> PyResult<u32> {
    t.extract::<u32>().map_err(|e| {
        PyValueError::new_err(format!("token id {t}: must be an int in 0..2**32 ({e})"))
    })
}

/// Block hashes (u64; negative ints are taken as their two's-complement bit pattern, as
/// signed engines publish them).
pub(crate) fn block_hashes(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    let list = obj
        .try_iter()
        .map_err(|_| PyTypeError::new_err("block hashes must be an iterable of ints"))?;
    list.map(|item| {
        let item = item?;
        match item.extract::<u64>() {
            Ok(v) => Ok(v),
            Err(_) => item.extract::<i64>().map(|v| v as u64).map_err(|_| {
                PyValueError::new_err(format!("block hash {item} is not a 64-bit integer"))
            }),
        }
    })
    .collect()
}

/// Whether an array object's items are signed integers, from its `typecode` (array.array),
/// `dtype` (numpy) or `format` (memoryview); a `TypeError` for anything but native-order
/// integers (floats, characters, big-endian data would otherwise be read as ids).
fn int_signedness(obj: &Bound<'_, PyAny>) -> PyResult<bool> {
    let not_ints = |what: String| {
        PyTypeError::new_err(format!(
            "token ids: an array of {what}; use integers (array(\"I\"), numpy uint32/int64)"
        ))
    };
    if let Ok(code) = obj.getattr("typecode") {
        let code: String = code.extract()?;
        return match code.as_str() {
            "b" | "h" | "i" | "l" | "q" => Ok(true),
            "B" | "H" | "I" | "L" | "Q" => Ok(false),
            other => Err(not_ints(format!("typecode {other:?}"))),
        };
    }
    if let Ok(dtype) = obj.getattr("dtype") {
        let kind: String = dtype.getattr("kind")?.extract()?;
        let order: String = dtype.getattr("byteorder")?.extract()?;
        let little = cfg!(target_endian = "little");
        let native = matches!(order.as_str(), "=" | "|") || (order == "<") == little;
        return match (kind.as_str(), native) {
            ("i", true) => Ok(true),
            ("u", true) => Ok(false),
            (_, false) => Err(not_ints(format!("byte order {order:?}"))),
            (k, _) => Err(not_ints(format!("dtype kind {k:?}"))),
        };
    }
    if let Ok(format) = obj.getattr("format") {
        let format: String = format.extract()?;
        return match format.trim_start_matches(['@', '=', '<']) {
            _ if format.starts_with(['>', '!']) => Err(not_ints(format!("format {format:?}"))),
            "b" | "h" | "i" | "l" | "q" => Ok(true),
            "B" | "H" | "I" | "L" | "Q" => Ok(false),
            _ => Err(not_ints(format!("format {format:?}"))),
        };
    }
    Err(not_ints("items of unknown type".into()))
}

fn le_u32s(bytes: &[u8]) -> PyResult<Vec<u32>> {
    if !bytes.len().is_multiple_of(4) {
        return Err(PyValueError::new_err(format!(
            "token ids as bytes: {} bytes is not a whole number of little-endian u32s",
            bytes.len()
        )));
    }
    Ok(bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

/// Fixed-width integers, each checked to fit a u32.
fn fixed<const N: usize>(bytes: &[u8], read: impl Fn([u8; N]) -> i64) -> PyResult<Vec<u32>> {
    bytes
        .chunks_exact(N)
        .map(|c| {
            let mut b = [0u8; N];
            b.copy_from_slice(c);
            let v = read(b);
            u32::try_from(v)
                .map_err(|_| PyValueError::new_err(format!("token id {v} is outside 0..2**32")))
        })
        .collect()
}
