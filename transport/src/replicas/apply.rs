//! A peer's load events applied to this replica's routers (the module invariants 2 and 3
//! of [`super`]), and this replica's state as peers need it.

use super::ReplicaStats;
use super::wire::LoadEvent;
use crate::models::Namespaces;
use engine::router::{NameError, RemoteRequest, RouteError};
use engine::{DpRank, EngineError, ReplicaId, SeqHash, WorkerId, WorkerKey};
use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

/// Applies `events` from `replica` at `now`, counting each outcome in `stats`.
pub(crate) fn apply_events(
    routing: &mut Namespaces,
    replica: ReplicaId,
    events: &[LoadEvent],
    now: Instant,
    stats: &ReplicaStats,
) {
    for event in events {
        let outcome = match event {
            LoadEvent::Reset => {
                forget_replica(routing, replica);
                Ok(())
            }
            LoadEvent::Added {
                request,
                worker,
                dp_rank,
                input_tokens,
                overlap_blocks,
                blocks,
            } => {
                let key = WorkerKey {
                    worker: WorkerId(*worker),
                    dp_rank: DpRank(*dp_rank),
                };
                match routing.router_of(key.worker) {
                    None => Err(RouteError::Engine(EngineError::UnknownWorker {
                        worker: key.worker,
                    })),
                    Some(router) => {
                        let blocks: Vec<SeqHash> = blocks.iter().map(|&h| SeqHash(h)).collect();
                        let remote = RemoteRequest {
                            replica,
                            name: request,
                            key,
                            blocks: &blocks,
                            input_tokens: *input_tokens,
                            overlap_blocks: *overlap_blocks,
                        };
                        router.add_remote(now, &remote).map(|_| ())
                    }
                }
            }
            LoadEvent::Prefilled { request } => with_remote(routing, replica, request, |r| {
                r.prefilled_remote(replica, request)
            }),
            LoadEvent::Freed { request } => with_remote(routing, replica, request, |r| {
                r.finish_remote(replica, request)
            }),
        };
        match outcome {
            Ok(()) => stats.events_applied.fetch_add(1, Relaxed),
            Err(RouteError::Engine(EngineError::UnknownWorker { .. })) => {
                stats.unknown_worker.fetch_add(1, Relaxed)
            }
            Err(RouteError::Name(NameError::Unknown(_))) => stats.unmatched.fetch_add(1, Relaxed),
            Err(e) => {
                tracing::warn!(replica = %replica, "a peer's load event was refused: {e:?}");
                stats.refused.fetch_add(1, Relaxed)
            }
        };
    }
}

/// Runs `f` on the router where `replica`'s request `name` is active.
fn with_remote(
    routing: &mut Namespaces,
    replica: ReplicaId,
    name: &str,
    f: impl FnOnce(&mut engine::router::Router) -> Result<(), RouteError>,
) -> Result<(), RouteError> {
    match routing
        .routers_mut()
        .find(|r| r.is_remote_active(replica, name))
    {
        Some(r) => f(r),
        None => Err(RouteError::Name(NameError::Unknown(name.to_owned()))),
    }
}

/// Frees everything `replica` added, in every namespace; returns how many requests.
pub(crate) fn forget_replica(routing: &mut Namespaces, replica: ReplicaId) -> usize {
    routing
        .routers_mut()
        .map(|r| r.forget_replica(replica))
        .sum()
}

/// This replica's whole state as events: a `Reset`, then every active request it routed
/// (with the prefill it still adds as its input and no overlap).
pub(crate) fn state_events(routing: &Namespaces) -> Vec<LoadEvent> {
    let mut out = vec![LoadEvent::Reset];
    for router in routing.routers() {
        out.extend(
            router
                .local_requests()
                .into_iter()
                .map(|r| LoadEvent::Added {
                    request: r.name,
                    worker: r.key.worker.0,
                    dp_rank: r.key.dp_rank.0,
                    input_tokens: r.pending_prefill_tokens,
                    overlap_blocks: 0,
                    blocks: r.blocks.iter().map(|h| h.0).collect(),
                }),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use engine::sched::{RouteMode, SchedulerConfig, WorkerRole};

    fn spaces() -> Namespaces {
        let config = SchedulerConfig {
            mode: RouteMode::RoundRobin,
            ..SchedulerConfig::default()
        };
        let mut ns = Namespaces::new(config, None).unwrap();
        let r = ns.place(WorkerId(1), "").unwrap();
        r.add_worker(WorkerKey::new(1, 0), WorkerRole::default())
            .unwrap();
        ns
    }

    fn added(name: &str, worker: u64, blocks: &[u64]) -> LoadEvent {
        LoadEvent::Added {
            request: name.into(),
            worker,
            dp_rank: 0,
            input_tokens: 16 * blocks.len() as u64,
            overlap_blocks: 0,
            blocks: blocks.to_vec(),
        }
    }

    #[test]
    fn peer_events_change_the_load_once_and_count_what_they_could_not_do() {
        let mut ns = spaces();
        let stats = ReplicaStats::default();
        let now = Instant::now();
        let peer = ReplicaId(9);
        let key = WorkerKey::new(1, 0);
        let events = [
            added("a", 1, &[1, 2]),
            added("b", 1, &[1, 2, 3]),
            added("a", 1, &[1, 2]), // repeated by a resent state: no change
            added("c", 7, &[1]),    // a worker this replica does not route to
            LoadEvent::Prefilled {
                request: "a".into(),
            },
            LoadEvent::Freed {
                request: "zz".into(),
            },
        ];
        apply_events(&mut ns, peer, &events, now, &stats);
        let load = ns.router_of(WorkerId(1)).unwrap().active_load(key).unwrap();
        assert_eq!((load.active_requests, load.active_blocks), (2, 3));
        assert_eq!(
            load.active_prefill_tokens, 48,
            "b's prefill only: a is prefilled"
        );
        assert_eq!(stats.events_applied.load(Relaxed), 4);
        assert_eq!(stats.unknown_worker.load(Relaxed), 1);
        assert_eq!(stats.unmatched.load(Relaxed), 1);
        // The peer's names are its own: a local finish does not reach them.
        assert!(ns.with_request("a", |r| r.finish("a")).is_err());
        // A reset forgets the peer's requests; the state that follows rebuilds them.
        apply_events(
            &mut ns,
            peer,
            &[LoadEvent::Reset, added("b", 1, &[1, 2, 3])],
            now,
            &stats,
        );
        let load = ns.router_of(WorkerId(1)).unwrap().active_load(key).unwrap();
        assert_eq!((load.active_requests, load.active_blocks), (1, 3));
        assert_eq!(forget_replica(&mut ns, peer), 1);
        let load = ns.router_of(WorkerId(1)).unwrap().active_load(key).unwrap();
        assert_eq!(load.active_requests, 0);
    }

    #[test]
    fn a_state_applied_by_a_peer_reproduces_the_load() {
        let mut ours = spaces();
        let now = Instant::now();
        let key = WorkerKey::new(1, 0);
        {
            let r = ours.router_of(WorkerId(1)).unwrap();
            for (name, tokens) in [("x", 64usize), ("y", 96)] {
                let call = engine::router::RouteCall {
                    request_id: Some(name.into()),
                    tokens: &vec![1; tokens],
                    ..Default::default()
                };
                let seqs = engine::hash::seq_hashes(call.tokens, 16, 0);
                r.route(now, &call, &seqs, &engine::Matches::default())
                    .unwrap();
            }
            r.prefilled("x").unwrap();
        }
        let mut theirs = spaces();
        let stats = ReplicaStats::default();
        apply_events(&mut theirs, ReplicaId(3), &state_events(&ours), now, &stats);
        let mine = ours.router_of(WorkerId(1)).unwrap().active_load(key);
        let seen = theirs.router_of(WorkerId(1)).unwrap().active_load(key);
        assert_eq!(mine, seen);
        assert_eq!(stats.events_applied.load(Relaxed), 3);
    }
}
