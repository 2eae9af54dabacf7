//! Log setup shared by the commands: the filter from `KVENGINE_LOG`, else `RUST_LOG`, else
//! the command's default level; lines as text (ANSI colours on a terminal) or one JSON
//! object per line (`--log-format json`, for log pipelines). Logs go to stderr; stdout
//! carries the commands' own output.

use clap::ValueEnum;
use tracing_subscriber::EnvFilter;

/// How log lines are written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line (`timestamp`, `level`, `target`, `fields`, span context).
    Json,
}

/// Installs the global subscriber (a no-op if one is installed already).
pub fn init(default_level: &str, format: LogFormat) {
    let filter = EnvFilter::try_from_env("KVENGINE_LOG")
        .or_else(|_| EnvFilter::try_from_default_env())
        .unwrap_or_else(|_| EnvFilter::new(default_level));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Text => builder
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .try_init(),
        LogFormat::Json => builder.json().with_ansi(false).try_init(),
    };
}
