//! Route reservations: requests routed through `POST /v1/route`, who holds them, and how
//! many one client may hold.
//!
//! A reservation makes a request active on a worker until its caller frees it (`DELETE
//! /v1/requests/{id}`) or its lifetime ends (`--reservation-timeout-secs`). The routing API
//! is open to whoever reaches the edge (optionally behind `--routing-token`), so:
//! * only the client that made a reservation may mark it prefilled or free it; anyone else
//!   is told the request is unknown (its existence is not confirmed);
//! * requests the router routes for itself (the OpenAI front door, the Python package,
//!   peer replicas) are no reservation: no caller of the routing API can touch them;
//! * a client may hold at most `--max-reservations-per-client` at once; past it, routing
//!   answers 429 `too_many_reservations` until it frees some (or they expire).
//!
//! A *client* is its peer address: an IPv4 address, or an IPv6 /64 (one host commonly owns
//! a whole /64, so a finer key would let it take any number of identities).
//!
//! # Invariants
//! 1. `by_id` and `by_client` hold the same pairs: `(id, c)` is in one iff it is in the
//!    other.
//! 2. Every pair whose request is still active is present; a pair whose request ended
//!    without passing here (it expired) is dropped by the next `Reservations::prune` that
//!    sees it, and never counts against the cap once pruned.
//!
//! # Concurrency
//! None: owned by the namespaces ([`super::namespaces`]), behind their driver's lock.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::net::IpAddr;
use std::time::Duration;

/// The default `--max-reservations-per-client`.
pub const DEFAULT_MAX_RESERVATIONS_PER_CLIENT: usize = 1024;

/// The default `--reservation-timeout-secs`: how long a reservation never freed stays
/// active. Shorter than the 300 s of requests the router proxies itself (which it always
/// frees): a caller that crashes or floods holds worker capacity for at most this long.
pub const DEFAULT_RESERVATION_TIMEOUT: Duration = Duration::from_secs(120);

/// Who made a reservation (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ClientId {
    /// An IPv4 peer.
    V4([u8; 4]),
    /// An IPv6 peer's /64.
    V6([u8; 8]),
    /// A caller whose address is not known (a router served without peer addresses):
    /// every such caller is one client.
    Unknown,
}

impl ClientId {
    /// The client a peer address belongs to.
    pub fn of(peer: Option<IpAddr>) -> Self {
        match peer.map(|ip| ip.to_canonical()) {
            Some(IpAddr::V4(v4)) => ClientId::V4(v4.octets()),
            Some(IpAddr::V6(v6)) => {
                let o = v6.octets();
                let mut prefix = [0u8; 8];
                prefix.copy_from_slice(&o[..8]);
                ClientId::V6(prefix)
            }
            None => ClientId::Unknown,
        }
    }
}

impl fmt::Display for ClientId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ClientId::V4(o) => write!(f, "{}", std::net::Ipv4Addr::from(*o)),
            ClientId::V6(p) => {
                let mut o = [0u8; 16];
                o[..8].copy_from_slice(p);
                write!(f, "{}/64", std::net::Ipv6Addr::from(o))
            }
            ClientId::Unknown => f.write_str("an unknown peer"),
        }
    }
}

/// A client at its cap.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AtCap {
    /// The client.
    pub client: ClientId,
    /// The cap.
    pub cap: usize,
}

/// Every open reservation (see the module docs).
#[derive(Debug, Default)]
pub struct Reservations {
    /// `None`: no cap.
    cap: Option<usize>,
    by_id: HashMap<String, ClientId>,
    by_client: HashMap<ClientId, HashSet<String>>,
    /// `by_id`'s size after the last full prune: the next one runs at twice that.
    pruned_at: usize,
}

/// Full prunes run once the map has doubled since the last one, and not below this.
const MIN_PRUNE: usize = 4096;

impl Reservations {
    /// No reservation yet; at most `cap` per client (`None` or 0: no cap).
    pub fn new(cap: Option<usize>) -> Self {
        Self {
            cap: cap.filter(|&c| c > 0),
            ..Self::default()
        }
    }

    /// Whether `client` may make one more reservation. At the cap, its pairs whose
    /// request is no longer active (`is_active`) are dropped first.
    pub fn admit(
        &mut self,
        client: ClientId,
        is_active: impl Fn(&str) -> bool,
    ) -> Result<(), AtCap> {
        let Some(cap) = self.cap else {
            return Ok(());
        };
        let held = self.by_client.get(&client).map_or(0, HashSet::len);
        if held < cap {
            return Ok(());
        }
        if let Some(ids) = self.by_client.get_mut(&client) {
            let gone: Vec<String> = ids.iter().filter(|id| !is_active(id)).cloned().collect();
            for id in gone {
                ids.remove(&id);
                self.by_id.remove(&id);
            }
            if ids.len() < cap {
                return Ok(());
            }
        }
        Err(AtCap { client, cap })
    }

    /// Records that `client` holds request `id` (routed just now). Runs a full prune when
    /// the map has doubled since the last one, so expired pairs never pile up.
    pub fn insert(&mut self, id: String, client: ClientId, is_active: impl Fn(&str) -> bool) {
        if self.by_id.len() >= self.pruned_at.saturating_mul(2).max(MIN_PRUNE) {
            self.prune(is_active);
        }
        self.by_client.entry(client).or_default().insert(id.clone());
        self.by_id.insert(id, client);
    }

    /// Whether `client` holds `id`.
    pub fn held_by(&self, id: &str, client: ClientId) -> bool {
        self.by_id.get(id) == Some(&client)
    }

    /// Forgets `id` (freed).
    pub fn remove(&mut self, id: &str) {
        if let Some(client) = self.by_id.remove(id)
            && let Some(ids) = self.by_client.get_mut(&client)
        {
            ids.remove(id);
            if ids.is_empty() {
                self.by_client.remove(&client);
            }
        }
    }

    /// Drops every pair whose request is no longer active.
    pub fn prune(&mut self, is_active: impl Fn(&str) -> bool) {
        self.by_id.retain(|id, _| is_active(id));
        self.by_client.retain(|_, ids| {
            ids.retain(|id| is_active(id));
            !ids.is_empty()
        });
        self.pruned_at = self.by_id.len();
    }

    /// Open reservations (expired ones not yet pruned included).
    #[cfg(test)]
    fn len(&self) -> usize {
        self.by_id.len()
    }

    /// Checks invariant 1 (tests).
    #[cfg(test)]
    fn check(&self) {
        let pairs: usize = self.by_client.values().map(HashSet::len).sum();
        assert_eq!(pairs, self.by_id.len());
        for (id, c) in &self.by_id {
            assert!(self.by_client[c].contains(id));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;

    fn ip(s: &str) -> ClientId {
        ClientId::of(Some(s.parse().unwrap()))
    }

    #[test]
    fn clients_are_ipv4_addresses_and_ipv6_slash_64s() {
        assert_eq!(ip("10.0.0.1"), ClientId::V4([10, 0, 0, 1]));
        assert_eq!(ip("::ffff:10.0.0.1"), ip("10.0.0.1"), "mapped v4 is v4");
        assert_eq!(ip("2001:db8:1:2::1"), ip("2001:db8:1:2:ffff::9"));
        assert_ne!(ip("2001:db8:1:2::1"), ip("2001:db8:1:3::1"));
        assert_eq!(ClientId::of(None), ClientId::Unknown);
        assert_eq!(ip("2001:db8:1:2::1").to_string(), "2001:db8:1:2::/64");
    }

    #[test]
    fn a_client_at_its_cap_is_refused_until_one_of_its_requests_ends() {
        let active: RefCell<HashSet<String>> = RefCell::default();
        let is_active = |id: &str| active.borrow().contains(id);
        let mut r = Reservations::new(Some(2));
        let (a, b) = (ip("10.0.0.1"), ip("10.0.0.2"));
        for id in ["a1", "a2"] {
            assert_eq!(r.admit(a, is_active), Ok(()));
            active.borrow_mut().insert(id.into());
            r.insert(id.into(), a, is_active);
        }
        assert_eq!(r.admit(a, is_active), Err(AtCap { client: a, cap: 2 }));
        assert_eq!(r.admit(b, is_active), Ok(()), "others are not affected");
        // One expires (it leaves the router without passing here): pruned at the cap.
        active.borrow_mut().remove("a1");
        assert_eq!(r.admit(a, is_active), Ok(()));
        assert!(!r.held_by("a1", a));
        // One is freed.
        r.remove("a2");
        assert!(!r.held_by("a2", a));
        r.check();
        assert_eq!(r.len(), 0);
        assert_eq!(Reservations::new(None).admit(a, |_| true), Ok(()));
        assert_eq!(Reservations::new(Some(0)).admit(a, |_| true), Ok(()));
    }

    #[test]
    fn only_the_holder_holds_and_expired_pairs_do_not_pile_up() {
        let mut r = Reservations::new(None);
        let (a, b) = (ip("10.0.0.1"), ip("10.0.0.2"));
        r.insert("x".into(), a, |_| true);
        assert!(r.held_by("x", a));
        assert!(!r.held_by("x", b));
        assert!(!r.held_by("y", a));
        // Nothing stays active: the map never grows past twice the prune floor.
        for i in 0..(5 * MIN_PRUNE) {
            r.insert(format!("r{i}"), b, |_| false);
            assert!(r.len() <= 2 * MIN_PRUNE + 1, "{}", r.len());
        }
        r.check();
    }
}
