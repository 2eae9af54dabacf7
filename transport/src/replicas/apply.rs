//! A peer's load events applied to this replica's routers (the module invariants 2 and 3
//! of [`super`]), and this replica's state as peers need it.

use super::ReplicaStats;
use super::wire::LoadEvent;
use engine::router::Namespaces;
use engine::router::{NameError, RemoteRequest, RouteError};
use engine::{DpRank, EngineError, ReplicaId, SeqHash, WorkerId, WorkerKey};
use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

/// Applies a peer's session assignments at `now`: each session of a model routed here,
/// to a worker rank in that model's routing here, now sticks to that rank. Counted in
/// `stats` (applied, or ignored: unknown model or worker, or sessions off).
pub(crate) fn apply_sessions(
    routing: &mut Namespaces,
    sessions: &[super::wire::SessionAssign],
    now: Instant,
    stats: &ReplicaStats,
) {
    for a in sessions {
        let key = WorkerKey {
            worker: WorkerId(a.worker),
            dp_rank: DpRank(a.dp_rank),
        };
        let placed = routing.model_of(key.worker) == a.model;
        let applied = placed
            && routing.get_mut(&a.model).is_some_and(|ns| {
                ns.router
                    .assign_session(now, engine::SessionId(a.session), key)
            });
        let counter = if applied {
            &stats.sessions_applied
        } else {
            &stats.sessions_ignored
        };
        counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

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
    fn peers_sessions_stick_here_when_their_model_and_worker_are_routed_here() {
        use super::super::wire::SessionAssign;
        let mut ns = spaces();
        let stats = ReplicaStats::default();
        let now = Instant::now();
        let assign = |model: &str, session, worker| SessionAssign {
            model: model.into(),
            session,
            worker,
            dp_rank: 0,
        };
        let batch = [assign("", 5, 1), assign("", 6, 7), assign("other", 8, 1)];
        // Sessions off here: nothing sticks, all counted as ignored.
        apply_sessions(&mut ns, &batch, now, &stats);
        assert_eq!(stats.sessions_ignored.load(Relaxed), 3);
        ns.set_sessions(engine::router::SessionConfig::default());
        apply_sessions(&mut ns, &batch, now, &stats);
        assert_eq!(stats.sessions_applied.load(Relaxed), 1);
        assert_eq!(stats.sessions_ignored.load(Relaxed), 5);
        let r = ns.router_of(WorkerId(1)).unwrap();
        assert_eq!(
            r.sessions().peek(engine::SessionId(5)),
            Some(WorkerKey::new(1, 0))
        );
        assert_eq!(r.sessions().len(), 1);
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
            r.prefilled(now, "x").unwrap();
        }
        let mut theirs = spaces();
        let stats = ReplicaStats::default();
        apply_events(&mut theirs, ReplicaId(3), &state_events(&ours), now, &stats);
        let mine = ours.router_of(WorkerId(1)).unwrap().active_load(key);
        let seen = theirs.router_of(WorkerId(1)).unwrap().active_load(key);
        assert_eq!(mine, seen);
        assert_eq!(stats.events_applied.load(Relaxed), 3);
    }

    mod model {
        //! Randomised: one replica's requests come and go; a peer applying its events as
        //! they come, and another that joins late from a state, count exactly its load.
        use super::*;
        use crate::replicas::LoadSink;
        use crate::replicas::outbox::{Outbox, Shared};
        use proptest::prelude::*;
        use std::sync::Arc;

        #[derive(Clone, Debug)]
        enum Op {
            Route {
                prompt: u8,
                len: u8,
            },
            Prefill(u8),
            Finish(u8),
            /// The late peer catches up from a state sent now; the link had published only
            /// this many of the queued events when the state was cut (the rest, changes
            /// from before the cut, go out after it).
            Join(u8),
        }

        fn op() -> impl Strategy<Value = Op> {
            prop_oneof![
                4 => (0u8..6, 1u8..6).prop_map(|(prompt, len)| Op::Route { prompt, len }),
                2 => any::<u8>().prop_map(Op::Prefill),
                3 => any::<u8>().prop_map(Op::Finish),
                1 => any::<u8>().prop_map(Op::Join),
            ]
        }

        fn two_workers() -> Namespaces {
            let mut ns = spaces();
            ns.router_of(WorkerId(1))
                .unwrap()
                .add_worker(WorkerKey::new(1, 1), engine::sched::WorkerRole::default())
                .unwrap();
            ns
        }

        fn view(ns: &mut Namespaces) -> Vec<Option<engine::sched::ActiveLoad>> {
            let r = ns.router_of(WorkerId(1)).unwrap();
            vec![
                r.active_load(WorkerKey::new(1, 0)),
                r.active_load(WorkerKey::new(1, 1)),
            ]
        }

        proptest! {
            #[test]
            fn peers_count_exactly_the_load_of_the_replica(ops in proptest::collection::vec(op(), 1..80)) {
                let now = Instant::now();
                let mut ours = two_workers();
                let mut live = two_workers();
                let mut late: Option<Namespaces> = None;
                let shared = Arc::new(Shared::default());
                let (outbox, inbox) = Outbox::new(shared);
                let mut rx = inbox.events;
                let stats = ReplicaStats::default();
                let peer = ReplicaId(42);
                let mut active: Vec<String> = Vec::new();
                for op in ops {
                    match op {
                        Op::Route { prompt, len } => {
                            // Prompts share prefixes: prompt p's blocks start with p % 3.
                            let tokens: Vec<u32> = (0..u32::from(len) * 16)
                                .map(|t| if t < 16 { u32::from(prompt % 3) } else { t + 100 * u32::from(prompt) })
                                .collect();
                            let seqs = engine::hash::seq_hashes(&tokens, 16, 0);
                            let id = ours.generate_id();
                            let call = engine::router::RouteCall { request_id: Some(id), tokens: &tokens, ..Default::default() };
                            let r = ours.router_of(WorkerId(1)).unwrap();
                            let routed = r.route(now, &call, &seqs, &engine::Matches::default()).unwrap();
                            outbox.added(&routed.request_id, routed.decision.worker, &seqs, tokens.len() as u64, routed.decision.overlap_blocks);
                            active.push(routed.request_id);
                        }
                        Op::Prefill(i) if !active.is_empty() => {
                            let name = active[usize::from(i) % active.len()].clone();
                            ours.with_request(&name, |r| r.prefilled(Instant::now(), &name)).unwrap();
                            outbox.prefilled(&name);
                        }
                        Op::Finish(i) if !active.is_empty() => {
                            let name = active.swap_remove(usize::from(i) % active.len());
                            ours.with_request(&name, |r| r.finish(&name)).unwrap();
                            outbox.freed(&name);
                        }
                        Op::Join(published) => {
                            let queued: Vec<LoadEvent> = std::iter::from_fn(|| rx.try_recv().ok()).collect();
                            let (before, after) = queued.split_at(usize::from(published).min(queued.len()));
                            let mut frames = vec![before.to_vec(), state_events(&ours), after.to_vec()];
                            for f in &frames {
                                apply_events(&mut live, peer, f, now, &stats);
                            }
                            // The late peer hears from the state on.
                            frames.remove(0);
                            let mut l = two_workers();
                            for f in &frames {
                                apply_events(&mut l, peer, f, now, &stats);
                            }
                            late = Some(l);
                        }
                        _ => {}
                    }
                    let queued: Vec<LoadEvent> = std::iter::from_fn(|| rx.try_recv().ok()).collect();
                    apply_events(&mut live, peer, &queued, now, &stats);
                    if let Some(l) = late.as_mut() {
                        apply_events(l, peer, &queued, now, &stats);
                    }
                    let want = view(&mut ours);
                    prop_assert_eq!(&view(&mut live), &want);
                    if let Some(l) = late.as_mut() {
                        prop_assert_eq!(&view(l), &want);
                    }
                }
                prop_assert_eq!(stats.refused.load(Relaxed), 0);
                prop_assert_eq!(stats.unknown_worker.load(Relaxed), 0);
            }
        }
    }
}
