//! What `kvengine bench replay` and `kvengine bench peers` share: the workload they replay
//! and their number parsers (a leaf: it names neither bench).

use anyhow::{Context, Result};
use lab::replay::{self, trace};
use sim::workload::chat::ChatConfig;

/// The workload of a replay: the Mooncake trace at `trace`, else the built-in chat
/// workload (`max` requests, default 400), at `rate_scale` times its rate.
pub fn load_workload(
    trace: Option<&std::path::Path>,
    max: Option<usize>,
    rate_scale: f64,
    seed: u64,
    block_size: u32,
) -> Result<replay::Workload> {
    Ok(match trace {
        Some(path) => trace::load_trace(
            path,
            &trace::TraceOptions {
                max_requests: max,
                rate_scale,
                block_size,
            },
        )
        .context("--trace")?,
        None => {
            let base = replay::demo_chat_config(seed, max.unwrap_or(400));
            trace::chat_workload(
                ChatConfig {
                    mean_gap_ms: base.mean_gap_ms / rate_scale,
                    ..base
                },
                block_size,
            )?
        }
    })
}

/// A finite number above 0.
pub fn positive(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(x) if x.is_finite() && x > 0.0 => Ok(x),
        _ => Err(format!("{s:?} is not a finite number above 0")),
    }
}

/// A finite number, 0 or above.
pub fn non_negative(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(x) if x.is_finite() && x >= 0.0 => Ok(x),
        _ => Err(format!("{s:?} is not a finite non-negative number")),
    }
}
