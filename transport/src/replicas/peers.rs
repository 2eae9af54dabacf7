//! Membership, sans-IO: which peer replicas this one hears, whether what it heard from each
//! is complete, and when one is dead. Takes `now` as an argument; the link task drives it.
//!
//! # Invariants
//! 1. A peer is known from its first frame until it is silent for `timeout` (then
//!    [`Peers::expire`] names it once, and the load it added must be forgotten) or the link
//!    to NATS drops ([`Peers::clear`]).
//! 2. `last_seq` is the highest event-frame number heard from the peer. A frame that skips
//!    numbers, or a peer first heard after it had published, makes the view of that peer
//!    incomplete: [`Heard::Incomplete`] until its state is sent again (a `Reset`).
//! 3. A state is asked of a peer at most once per `timeout / 4` (peers' answers go to all
//!    replicas, so one ask repairs everyone's view).

use engine::ReplicaId;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// What a frame says about the view of its sender.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Heard {
    /// In order: nothing missed.
    InOrder,
    /// An event frame already heard (or older): skip it.
    Old,
    /// Frames were missed (`missed` of them; 0 when unknown: a peer that had published
    /// before it was first heard). Its state should be asked for.
    Incomplete {
        /// Event frames missed.
        missed: u64,
    },
}

/// A peer as `/v1/replicas` shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerInfo {
    /// Its id.
    pub replica: ReplicaId,
    /// Its name.
    pub name: String,
    /// Milliseconds since it was last heard.
    pub last_heard_ms: u64,
    /// The requests it said it had active (last heartbeat).
    pub active: u64,
    /// Whether frames were missed since its state was last received.
    pub incomplete: bool,
}

#[derive(Debug)]
struct Peer {
    name: String,
    last_heard: Instant,
    last_seq: u64,
    active: u64,
    incomplete: bool,
    asked: Option<Instant>,
}

/// See the module docs.
#[derive(Debug)]
pub struct Peers {
    timeout: Duration,
    peers: HashMap<ReplicaId, Peer>,
}

impl Peers {
    /// Peers that are dead after `timeout` of silence.
    pub fn new(timeout: Duration) -> Self {
        Self {
            timeout,
            peers: HashMap::new(),
        }
    }

    fn peer(&mut self, now: Instant, replica: ReplicaId) -> (&mut Peer, bool) {
        let mut new = false;
        let p = self.peers.entry(replica).or_insert_with(|| {
            new = true;
            Peer {
                name: String::new(),
                last_heard: now,
                last_seq: 0,
                active: 0,
                incomplete: false,
                asked: None,
            }
        });
        p.last_heard = now;
        (p, new)
    }

    /// An event frame numbered `seq` arrived from `replica`; `resets`: it begins with a
    /// `Reset` (the peer's whole state follows, so the view is complete again).
    pub fn heard_events(
        &mut self,
        now: Instant,
        replica: ReplicaId,
        seq: u64,
        resets: bool,
    ) -> Heard {
        let (p, new) = self.peer(now, replica);
        if !new && seq <= p.last_seq {
            return Heard::Old;
        }
        let missed = seq.saturating_sub(p.last_seq).saturating_sub(1);
        p.last_seq = seq;
        if resets {
            p.incomplete = false;
            return Heard::InOrder;
        }
        if new && seq > 1 {
            p.incomplete = true;
            return Heard::Incomplete { missed: 0 };
        }
        if missed > 0 {
            p.incomplete = true;
            return Heard::Incomplete { missed };
        }
        match p.incomplete {
            true => Heard::Incomplete { missed: 0 },
            false => Heard::InOrder,
        }
    }

    /// A heartbeat from `replica` whose last event frame was `seq`.
    pub fn heard_heartbeat(
        &mut self,
        now: Instant,
        replica: ReplicaId,
        seq: u64,
        name: &str,
        active: u64,
    ) -> Heard {
        let (p, new) = self.peer(now, replica);
        if p.name != name {
            p.name = name.to_owned();
        }
        p.active = active;
        let missed = seq.saturating_sub(p.last_seq);
        if new && seq > 0 {
            p.last_seq = seq;
            p.incomplete = true;
            return Heard::Incomplete { missed: 0 };
        }
        if missed > 0 {
            p.last_seq = seq;
            p.incomplete = true;
            return Heard::Incomplete { missed };
        }
        match p.incomplete {
            true => Heard::Incomplete { missed: 0 },
            false => Heard::InOrder,
        }
    }

    /// Whether to ask `replica` for its state now (invariant 3); records the ask.
    pub fn should_ask(&mut self, now: Instant, replica: ReplicaId) -> bool {
        let every = self.timeout / 4;
        match self.peers.get_mut(&replica) {
            Some(p)
                if p.asked
                    .is_none_or(|t| now.saturating_duration_since(t) >= every) =>
            {
                p.asked = Some(now);
                true
            }
            _ => false,
        }
    }

    /// The peers silent for `timeout` by `now`, forgotten (invariant 1).
    pub fn expire(&mut self, now: Instant) -> Vec<ReplicaId> {
        let timeout = self.timeout;
        let dead: Vec<ReplicaId> = self
            .peers
            .iter()
            .filter(|(_, p)| now.saturating_duration_since(p.last_heard) >= timeout)
            .map(|(r, _)| *r)
            .collect();
        for r in &dead {
            self.peers.remove(r);
        }
        dead
    }

    /// Forgets every peer (the link dropped: nothing heard meanwhile can be trusted).
    pub fn clear(&mut self) -> Vec<ReplicaId> {
        self.peers.drain().map(|(r, _)| r).collect()
    }

    /// Known peers.
    pub fn len(&self) -> usize {
        self.peers.len()
    }

    /// Whether no peer is known.
    pub fn is_empty(&self) -> bool {
        self.peers.is_empty()
    }

    /// Every known peer, by id.
    pub fn list(&self, now: Instant) -> Vec<PeerInfo> {
        let mut out: Vec<PeerInfo> = self
            .peers
            .iter()
            .map(|(r, p)| PeerInfo {
                replica: *r,
                name: p.name.clone(),
                last_heard_ms: now.saturating_duration_since(p.last_heard).as_millis() as u64,
                active: p.active,
                incomplete: p.incomplete,
            })
            .collect();
        out.sort_by_key(|p| p.replica);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: ReplicaId = ReplicaId(1);

    #[test]
    fn in_order_frames_are_complete_and_gaps_are_not_until_a_reset() {
        let t = Instant::now();
        let mut p = Peers::new(Duration::from_secs(4));
        assert_eq!(p.heard_heartbeat(t, A, 0, "a", 0), Heard::InOrder);
        assert_eq!(p.heard_events(t, A, 1, false), Heard::InOrder);
        assert_eq!(p.heard_events(t, A, 2, false), Heard::InOrder);
        assert_eq!(p.heard_events(t, A, 2, false), Heard::Old);
        assert_eq!(p.heard_heartbeat(t, A, 2, "a", 3), Heard::InOrder);
        assert_eq!(
            p.heard_events(t, A, 5, false),
            Heard::Incomplete { missed: 2 }
        );
        assert_eq!(
            p.heard_events(t, A, 6, false),
            Heard::Incomplete { missed: 0 }
        );
        assert_eq!(p.heard_events(t, A, 7, true), Heard::InOrder);
        assert_eq!(p.heard_events(t, A, 8, false), Heard::InOrder);
        // A heartbeat ahead of the frames heard: the frames in between were lost.
        assert_eq!(
            p.heard_heartbeat(t, A, 10, "a", 3),
            Heard::Incomplete { missed: 2 }
        );
    }

    #[test]
    fn a_peer_first_heard_mid_stream_is_incomplete() {
        let t = Instant::now();
        let mut p = Peers::new(Duration::from_secs(4));
        assert_eq!(
            p.heard_heartbeat(t, A, 9, "a", 1),
            Heard::Incomplete { missed: 0 }
        );
        let mut q = Peers::new(Duration::from_secs(4));
        assert_eq!(
            q.heard_events(t, A, 4, false),
            Heard::Incomplete { missed: 0 }
        );
        assert_eq!(q.heard_events(t, A, 5, true), Heard::InOrder);
    }

    #[test]
    fn asks_are_spaced_and_silent_peers_expire_once() {
        let t = Instant::now();
        let mut p = Peers::new(Duration::from_secs(4));
        assert!(!p.should_ask(t, A), "an unknown peer is not asked");
        p.heard_heartbeat(t, A, 0, "a", 0);
        assert!(p.should_ask(t, A));
        assert!(!p.should_ask(t + Duration::from_millis(999), A));
        assert!(p.should_ask(t + Duration::from_secs(1), A));
        let b = ReplicaId(2);
        p.heard_heartbeat(t + Duration::from_secs(2), b, 0, "b", 0);
        assert_eq!(p.expire(t + Duration::from_millis(3999)), vec![]);
        assert_eq!(p.expire(t + Duration::from_secs(4)), vec![A]);
        assert_eq!(p.expire(t + Duration::from_secs(5)), vec![]);
        assert_eq!(p.len(), 1);
        assert_eq!(p.list(t + Duration::from_secs(3))[0].last_heard_ms, 1000);
        assert_eq!(p.clear(), vec![b]);
        assert!(p.is_empty());
    }
}
