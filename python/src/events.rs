//! A KV-event batch from Python: vLLM's msgpack bytes (exactly what its ZMQ publisher
//! sends as the payload frame), or the JSON shape of `POST /v1/events` as dicts.
//!
//! Both go through the transport crate's decoders, so a batch means here what it means on
//! the wire. Decoding is pure Rust and runs with the GIL released (the caller copies the
//! bytes, or depythonizes the dicts, first).

use engine::DpRank;
use engine::event::KvEvent;
use pythonize::depythonize;
use serde::Deserialize;
use transport::error::{DropReason, TransportError};
use transport::json_events::{JsonEvent, to_engine};
use transport::kv_events::{ConvertConfig, convert, decode_batch};

/// A batch as handed in, before decoding.
pub(crate) enum RawBatch {
    /// vLLM / SGLang msgpack.
    Msgpack(Vec<u8>),
    /// Dicts in the `/v1/events` shape.
    Json(JsonBatch),
}

/// `{"dp_rank": 0, "events": [...]}` (a `worker_id` may be present; it must agree), or just
/// the list of events.
#[derive(Debug, Deserialize)]
pub(crate) struct JsonBatch {
    #[serde(default)]
    pub worker_id: Option<u64>,
    #[serde(default)]
    pub dp_rank: Option<u32>,
    pub events: Vec<JsonEvent>,
}

/// A decoded batch: the events to apply and what conversion dropped.
#[derive(Debug, Default)]
pub(crate) struct Decoded {
    pub dp_rank: DpRank,
    pub events: Vec<KvEvent>,
    pub drops: Vec<(DropReason, u64)>,
    /// A stored event's foreign block size (the caller raises after applying the rest).
    pub block_size_mismatch: Option<u32>,
}

impl RawBatch {
    /// Reads `obj`: `bytes`-like (msgpack), a dict, or a list of event dicts.
    pub(crate) fn from_py(obj: &pyo3::Bound<'_, pyo3::PyAny>) -> pyo3::PyResult<Self> {
        use pyo3::prelude::*;
        use pyo3::types::{PyByteArray, PyBytes, PyDict, PyList, PyMemoryView};
        if let Ok(b) = obj.cast::<PyBytes>() {
            return Ok(Self::Msgpack(b.as_bytes().to_vec()));
        }
        if let Ok(b) = obj.cast::<PyByteArray>() {
            return Ok(Self::Msgpack(b.to_vec()));
        }
        if obj.cast::<PyMemoryView>().is_ok() {
            let b = obj.call_method0("tobytes")?;
            return Ok(Self::Msgpack(b.cast::<PyBytes>()?.as_bytes().to_vec()));
        }
        let not_json = |e: pythonize::PythonizeError| {
            pyo3::exceptions::PyValueError::new_err(format!("malformed event batch: {e}"))
        };
        if obj.cast::<PyDict>().is_ok() {
            return Ok(Self::Json(depythonize(obj).map_err(not_json)?));
        }
        if obj.cast::<PyList>().is_ok() {
            return Ok(Self::Json(JsonBatch {
                worker_id: None,
                dp_rank: None,
                events: depythonize(obj).map_err(not_json)?,
            }));
        }
        Err(pyo3::exceptions::PyTypeError::new_err(format!(
            "an event batch is msgpack bytes or a dict / list of event dicts, not {}",
            obj.get_type().name()?
        )))
    }

    /// Decodes for an index of `block_size` tokens per block, for `worker`. A JSON batch is
    /// refused whole if any event is invalid (nothing of it applies).
    pub(crate) fn decode(self, worker: u64, block_size: u32) -> Result<Decoded, TransportError> {
        match self {
            Self::Msgpack(bytes) => {
                let converted = convert(decode_batch(&bytes)?, &ConvertConfig { block_size });
                Ok(Decoded {
                    dp_rank: converted.dp_rank,
                    events: converted.events,
                    drops: converted.drops,
                    block_size_mismatch: converted.block_size_mismatch,
                })
            }
            Self::Json(batch) => {
                if let Some(w) = batch.worker_id
                    && w != worker
                {
                    return Err(TransportError::Invalid {
                        name: "worker_id",
                        reason: format!("the batch says worker {w}, the call worker {worker}"),
                    });
                }
                let events = batch
                    .events
                    .iter()
                    .map(|e| to_engine(e, block_size))
                    .collect::<Result<Vec<_>, _>>()?;
                Ok(Decoded {
                    dp_rank: DpRank(batch.dp_rank.unwrap_or(0)),
                    events,
                    ..Decoded::default()
                })
            }
        }
    }
}
