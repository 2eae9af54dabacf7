//! Clusters of simulated workers: [`cluster_member`] gives worker `i` its ports,
//! [`spawn_cluster`] and [`spawn_mixed_cluster`] start them all (what `kvengine sim
//! --workers N`, `kvengine --sim-workers N` and the replay bench run).
//!
//! # Invariants
//! 1. Either every worker starts or none is left running: on a failure the workers already
//!    started are shut down before the error is returned.
//! 2. Port 0 stays 0 (any free port) for every member; a fixed base port moves by `i`
//!    (HTTP) or `2i` (ZMQ), and a member that would run past 65535 is refused.

use std::sync::Arc;

use transport::openai::tokenize::PromptTokenizer;

use super::config::SimWorkerConfig;
use super::error::{Result, WorkerError};
use super::handle::{SimWorkerHandle, spawn_worker};
use super::role::SimRole;

/// `port + by`, or 0 if `port` is 0 (any free port).
fn offset_port(port: u16, by: usize, name: &'static str) -> Result<u16> {
    if port == 0 {
        return Ok(0);
    }
    u16::try_from(usize::from(port).saturating_add(by)).map_err(|_| WorkerError::InvalidConfig {
        name,
        reason: "the workers' ports would run past 65535",
    })
}

/// `tcp://HOST:PORT` with its port moved by `by` (unless it is 0).
fn offset_endpoint(endpoint: &str, by: usize, name: &'static str) -> Result<String> {
    let bad = WorkerError::InvalidConfig {
        name,
        reason: "must be tcp://HOST:PORT",
    };
    let Some((head, port)) = endpoint.rsplit_once(':') else {
        return Err(bad);
    };
    let Ok(port) = port.parse::<u16>() else {
        return Err(bad);
    };
    Ok(format!("{head}:{}", offset_port(port, by, name)?))
}

/// The configuration of worker `i` of a cluster built from `base`: HTTP port `base + i`,
/// PUB port `base + 2i`, replay port `base + 2i` (ports 0 stay 0: any free port; the ZMQ
/// endpoints are left as they are with [`super::EventFormat::Trtllm`], which binds none).
pub fn cluster_member(base: &SimWorkerConfig, i: usize) -> Result<SimWorkerConfig> {
    let mut cfg = base.clone();
    cfg.http
        .set_port(offset_port(base.http.port(), i, "http port")?);
    if cfg.events.is_trtllm() {
        return Ok(cfg);
    }
    let twice = i.saturating_mul(2);
    cfg.zmq_pub = offset_endpoint(&base.zmq_pub, twice, "zmq_pub")?;
    cfg.zmq_replay = offset_endpoint(&base.zmq_replay, twice, "zmq_replay")?;
    Ok(cfg)
}

/// Starts `n` workers of `base`'s role (see [`cluster_member`] for their ports), sharing one
/// tokenizer. On a failure the workers already started are stopped.
pub async fn spawn_cluster(
    n: usize,
    base: SimWorkerConfig,
    tokenizer: Option<Arc<PromptTokenizer>>,
) -> Result<Vec<SimWorkerHandle>> {
    let roles = vec![base.role; n];
    spawn_mixed_cluster(&roles, base, tokenizer).await
}

/// Starts one worker per entry of `roles`, worker `i` with role `roles[i]` (a disaggregated
/// deployment, e.g. `[Prefill, Prefill, Decode, Decode]`); otherwise as [`spawn_cluster`].
pub async fn spawn_mixed_cluster(
    roles: &[SimRole],
    base: SimWorkerConfig,
    tokenizer: Option<Arc<PromptTokenizer>>,
) -> Result<Vec<SimWorkerHandle>> {
    if roles.is_empty() {
        return Err(WorkerError::InvalidConfig {
            name: "workers",
            reason: "must be at least 1",
        });
    }
    base.validate()?;
    let mut workers = Vec::with_capacity(roles.len());
    for (i, &role) in roles.iter().enumerate() {
        let started = match cluster_member(&base, i) {
            Ok(cfg) => spawn_worker(SimWorkerConfig { role, ..cfg }, tokenizer.clone()).await,
            Err(e) => Err(e),
        };
        match started {
            Ok(w) => workers.push(w),
            Err(e) => {
                for w in workers {
                    w.shutdown().await;
                }
                return Err(e);
            }
        }
    }
    Ok(workers)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_ports_step_by_one_and_two() {
        let base = SimWorkerConfig {
            http: "127.0.0.1:8100".parse().unwrap(),
            zmq_pub: "tcp://127.0.0.1:9100".into(),
            zmq_replay: "tcp://127.0.0.1:9101".into(),
            ..SimWorkerConfig::default()
        };
        let m = cluster_member(&base, 2).unwrap();
        assert_eq!(m.http.port(), 8102);
        assert_eq!(m.zmq_pub, "tcp://127.0.0.1:9104");
        assert_eq!(m.zmq_replay, "tcp://127.0.0.1:9105");
        let any = cluster_member(&SimWorkerConfig::default(), 3).unwrap();
        assert_eq!(any, SimWorkerConfig::default());
        let high = SimWorkerConfig {
            http: "127.0.0.1:65535".parse().unwrap(),
            ..SimWorkerConfig::default()
        };
        assert!(cluster_member(&high, 1).is_err());
        let bad = SimWorkerConfig {
            zmq_pub: "nonsense".into(),
            ..SimWorkerConfig::default()
        };
        assert!(cluster_member(&bad, 0).is_err());
    }

    #[tokio::test]
    async fn a_mixed_cluster_gives_each_worker_its_role() {
        let roles = [SimRole::Prefill, SimRole::Decode, SimRole::Aggregated];
        let ws = spawn_mixed_cluster(&roles, SimWorkerConfig::default(), None)
            .await
            .unwrap();
        assert_eq!(ws.iter().map(|w| w.role()).collect::<Vec<_>>(), roles);
        assert_ne!(ws[0].engine_id(), ws[1].engine_id());
        for w in ws {
            w.shutdown().await;
        }
        assert!(
            spawn_mixed_cluster(&[], SimWorkerConfig::default(), None)
                .await
                .is_err()
        );
    }
}
