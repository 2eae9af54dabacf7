//! The one request-id policy: the ids a router gives requests routed without one.
//!
//! An id is `kvr-` and 32 hex digits: 128 bits drawn from an [`Entropy`] source. Holding an
//! id is what lets a caller of the routing API mark or free its request, so in a serving
//! router the source is the system's CSPRNG (the transport's); a deterministic
//! [`Counter`] serves tests and simulations, where guessable ids do no harm.
//!
//! # Invariants
//! 1. Every id has the form `kvr-` + 32 lowercase hex digits.
//! 2. [`super::namespaces::Namespaces::generate_id`] never hands out an id that is active
//!    in any namespace (it draws again), so generated ids never collide with a live one,
//!    whatever the source.
//!
//! # Concurrency
//! None: owned by the namespaces, behind their driver's routing lock.

use std::fmt::{self, Write};

/// Where the 128 bits of a generated id come from.
pub trait Entropy: Send + fmt::Debug {
    /// Fills `out` with fresh bits.
    fn fill(&mut self, out: &mut [u8; 16]);
}

/// A deterministic, guessable source (tests, simulations): a counter through a mixer, so
/// consecutive ids share no prefix.
#[derive(Debug, Default)]
pub struct Counter(u64);

impl Entropy for Counter {
    fn fill(&mut self, out: &mut [u8; 16]) {
        self.0 = self.0.wrapping_add(1);
        let a = xxhash_rust::xxh3::xxh3_64_with_seed(&self.0.to_le_bytes(), 1);
        let b = xxhash_rust::xxh3::xxh3_64_with_seed(&self.0.to_le_bytes(), 2);
        out[..8].copy_from_slice(&a.to_le_bytes());
        out[8..].copy_from_slice(&b.to_le_bytes());
    }
}

/// Generates ids from its source (see the module docs).
#[derive(Debug)]
pub struct RequestIds {
    source: Box<dyn Entropy>,
}

impl Default for RequestIds {
    /// Ids from a [`Counter`].
    fn default() -> Self {
        Self::new(Box::new(Counter::default()))
    }
}

impl RequestIds {
    /// Ids drawn from `source`.
    pub fn new(source: Box<dyn Entropy>) -> Self {
        Self { source }
    }

    /// The next id (invariant 1); its uniqueness among active requests is the caller's
    /// check (invariant 2).
    pub fn draw(&mut self) -> String {
        let mut bits = [0u8; 16];
        self.source.fill(&mut bits);
        let mut name = String::with_capacity(4 + 32);
        name.push_str("kvr-");
        for b in bits {
            let _ = write!(name, "{b:02x}");
        }
        name
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_have_one_form_and_counters_do_not_look_like_counters() {
        let mut ids = RequestIds::default();
        let (a, b) = (ids.draw(), ids.draw());
        for id in [&a, &b] {
            let hex = id.strip_prefix("kvr-").unwrap();
            assert_eq!(hex.len(), 32, "{id}");
            assert!(
                hex.bytes()
                    .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
            );
        }
        assert_ne!(a[..12], b[..12], "{a} {b}");
    }
}
