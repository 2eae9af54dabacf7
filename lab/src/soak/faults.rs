//! The faults the soak injects, and what each one really exercises.
//!
//! | kind | what is done | what it exercises in the router |
//! |---|---|---|
//! | `publisher_restart` | one worker's "process" dies: its HTTP port refuses and its connections reset, requests in flight are dropped, its ZMQ sockets close; after a second it comes back on the same ports with an empty cache and a publisher numbering from 0 | the ZMQ subscription reconnecting, restart detection (a seq going back: the worker's blocks cleared), the health check taking the worker out and back, the front door retrying requests the dead worker dropped |
//! | `dropped_batches` | one worker's next 1-8 engine batches are numbered and kept in its replay buffer but never sent | gap detection and repair from the replay socket. A stand-in for ZMQ high-water-mark overflow: the PUB socket kvengine's subscriber talks to drops whole messages for a slow subscriber exactly this way (kvengine's PUB queues 100,000 messages or 256 MiB per subscriber, more than a short run can overflow) |
//! | `slow_consumer` | one worker publishes a burst of synthetic batches back to back (each stores an 8-block chain outside its cache and removes the previous one), faster than the router applies them | the subscriber falling behind its publisher: socket queues and the cores' rings filling, backpressure to the socket reader, ingest lag, and routing latency while the index catches up. The consumer is slow because the producer outpaces it; the router is never paused |
//! | `worker_http_failure` | one worker answers 500 to completions and health checks (odd occurrences), or closes its HTTP listener and connections (even ones), for a few seconds, while its engine and KV events go on | the front door's retry on the next-best worker, the health check taking the worker out of routing and back; the index must keep the worker's blocks meanwhile |
//! | `router_restart` | the router is killed with SIGKILL and started again on the same `--state-dir` | the warm restart: the last snapshot (every 2 s) restored, each ZMQ stream resumed by replaying everything after the snapshot's batch; requests sent while it is down fail (counted) |
//!
//! # Invariants
//! 1. Faults run one at a time, each targeting one worker (round robin) or the router; a
//!    fault's window runs from its start until the router has recovered plus a settle time,
//!    and latency samples sent inside a window count as `faults`, all others after the
//!    warm-up as `quiet`.

use serde::Serialize;
use std::fmt;
use std::str::FromStr;

/// A kind of fault. See the module docs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FaultKind {
    /// A worker process killed and restarted (publisher numbering from 0, empty cache).
    PublisherRestart,
    /// Batches numbered and buffered but not sent (ZMQ HWM overflow stand-in).
    DroppedBatches,
    /// A burst that outpaces the router's subscriber.
    SlowConsumer,
    /// A worker's HTTP answering 500 or refusing connections.
    WorkerHttpFailure,
    /// The router killed with SIGKILL and restarted from its state directory.
    RouterRestart,
}

impl FaultKind {
    /// Every kind, in the order a cycle injects them.
    pub const ALL: [FaultKind; 5] = [
        FaultKind::PublisherRestart,
        FaultKind::DroppedBatches,
        FaultKind::SlowConsumer,
        FaultKind::WorkerHttpFailure,
        FaultKind::RouterRestart,
    ];

    /// Its name on the command line and in reports.
    pub fn as_str(self) -> &'static str {
        match self {
            FaultKind::PublisherRestart => "publisher_restart",
            FaultKind::DroppedBatches => "dropped_batches",
            FaultKind::SlowConsumer => "slow_consumer",
            FaultKind::WorkerHttpFailure => "worker_http_failure",
            FaultKind::RouterRestart => "router_restart",
        }
    }

    /// Parses a comma-separated list; `all` (or nothing) is every kind; `none` is none.
    pub fn parse_list(s: &str) -> Result<Vec<FaultKind>, String> {
        let mut out = Vec::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            match part {
                "all" => out.extend(FaultKind::ALL),
                "none" => {}
                p => out.push(p.parse()?),
            }
        }
        out.sort();
        out.dedup();
        Ok(out)
    }
}

impl fmt::Display for FaultKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for FaultKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.replace('-', "_");
        FaultKind::ALL
            .into_iter()
            .find(|k| k.as_str() == s)
            .ok_or_else(|| {
                format!(
                    "unknown fault {s:?}: expected publisher_restart, dropped_batches, \
                     slow_consumer, worker_http_failure, router_restart, all or none"
                )
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_parse() {
        assert_eq!(
            FaultKind::parse_list("all").unwrap(),
            FaultKind::ALL.to_vec()
        );
        assert_eq!(
            FaultKind::parse_list("router-restart, dropped_batches,router_restart").unwrap(),
            vec![FaultKind::DroppedBatches, FaultKind::RouterRestart]
        );
        assert!(FaultKind::parse_list("none").unwrap().is_empty());
        assert!(FaultKind::parse_list("meteor").is_err());
    }
}
