//! kvengine's lab: the end-to-end harnesses behind `kvengine bench ...` and `kvengine demo`:
//! the indexer bench, the ingest benches (ZMQ and QUIC), trace replay through the router
//! onto simulated workers (and the demo built on it), the soak and chaos run, the snapshot
//! bench, and the workloads they share; and the simulated workers in real time
//! ([`workers`]) they run, which `kvengine sim` and `kvengine --sim-workers` start too. The
//! `kvengine` CLI depends on this crate because those subcommands run it in process; the
//! router itself (`kvengine` serving real workers) uses none of it. Micro-benchmarks live
//! next to the crates they measure (`engine/benches/`, `transport/benches/`).
//!
//! The indexer bench generates indexer workloads defined exactly like NVIDIA Dynamo's
//! indexer benchmark (issue 3), plus Mooncake trace replay, pre-generates every event and
//! query, drives any indexer through the [`driver::IndexerUnderTest`] trait phase by phase,
//! and writes the figures as JSON.
//!
//! * [`workload`]: the workloads ([`workload::Plan::generate`]; the anchor-exact
//!   `dynamo-w1` .. `dynamo-w4` with [`workload::anchor::AnchorPlan::generate`]).
//! * [`driver`]: the trait the harness drives, and its implementations.
//! * [`harness`]: the phases and their measurement ([`harness::run`]).
//! * [`anchor`]: the anchor-exact workloads' five phases, `--repeat` runs and their
//!   min / median / max ([`anchor::run`]).
//! * [`calibrate`]: memory latency (a pointer chase) and resident memory, for the anchor
//!   report.
//! * [`report`]: the JSON report.
//! * [`args`]: the command-line flags, for the CLI to flatten (`--anchor-size`,
//!   `--anchor-queries` and `--repeat` apply to the anchor workloads only).
//! * [`ingest`], [`ingest_zmq`], [`ingest_quic`]: end-to-end ingest throughput
//!   (`kvengine bench ingest`): publishers on loopback into a real engine.
//! * [`nats`]: a `nats-server` child process for replica runs and tests.
//! * [`snapshot`]: warm restarts (`kvengine bench snapshot`): a big index cut, written,
//!   read back and restored, phase by phase, against issue 12's 1 s per 10 M entries.
//! * [`replay`]: routing quality end to end (`kvengine bench replay`, `kvengine demo`):
//!   a workload replayed open loop through the router onto simulated vLLM workers.
//! * [`workers`]: simulated vLLM / TensorRT-LLM workers in (sped-up) real time: the
//!   `sim` crate's engine behind an OpenAI HTTP server, its KV events over ZMQ or
//!   TensorRT-LLM's endpoint, disaggregated hand-offs, and the fault hooks the soak uses.
//! * [`soak`]: the soak and chaos harness (`kvengine bench soak`): the router as a child
//!   process under traffic and injected faults, its index checked against the workers'
//!   caches.
//!
//! ```no_run
//! use lab::driver::kv_index::KvIndexUnderTest;
//! use lab::harness::{RunOptions, run};
//! use lab::workload::{Plan, WorkloadSpec};
//!
//! let plan = Plan::generate(&WorkloadSpec::default())?;
//! let report = run(&mut KvIndexUnderTest::new(), &plan, &RunOptions::default())?;
//! println!("{}", serde_json::to_string_pretty(&report)?);
//! # Ok::<(), anyhow::Error>(())
//! ```
//!
//! # Invariants
//! 1. Nothing is generated, hashed or allocated for the workload inside a timed window
//!    (workload invariant 1); timed windows contain only indexer calls.
//! 2. A run checks itself: entry counts after build, every quiet-index query's best
//!    overlap, and an empty index at the end ([`report::Checks`]).

pub mod anchor;
pub mod args;
pub mod calibrate;
pub mod driver;
pub mod harness;
pub mod ingest;
pub mod ingest_quic;
pub mod ingest_zmq;
pub mod nats;
pub mod peers;
pub mod replay;
pub mod report;
pub mod snapshot;
pub mod soak;
pub mod workers;
pub mod workload;

use anyhow::{Context, Result};
use std::path::Path;

/// Writes `report` as pretty JSON to `path`.
pub fn write_json(report: &impl serde::Serialize, path: &Path) -> Result<()> {
    let text = serde_json::to_string_pretty(report)?;
    std::fs::write(path, text + "\n").with_context(|| format!("writing {}", path.display()))
}
