//! Authenticating what replicas say to each other (`--replica-secret`): an HMAC-SHA256 tag
//! on every message that carries replica state, checked before anything in it is used.
//!
//! Every replica of a deployment holds the same secret. From it each kind of message gets
//! a key of its own, bound to its scope (the subject prefix for load frames and resync
//! requests, the bucket for snapshots):
//! `key(kind, scope) = HMAC-SHA256(secret, "kvengine replica v1\0" kind "\0" scope)`. A
//! message is its payload followed by the 32-byte tag `HMAC-SHA256(key, payload)`.
//!
//! What is authenticated, and why all of it: load frames (`Added` events steer every
//! replica's routing; a forged `Reset` or `Freed` hides load; heartbeats create peers),
//! resync requests (each makes every replica publish its whole state, an amplifier), and
//! snapshots (a replica that starts rebuilds its index and registers workers from one).
//! The cost is one HMAC per frame (a few microseconds for the largest, 512 KiB), against
//! the rkyv encoding the frame needed anyway.
//!
//! Not covered: replay. A recorded frame can be sent again; the peers table drops event
//! frames whose numbers it has seen (`super::peers`), a replayed heartbeat keeps a dead peer
//! listed until its timeout, and a replayed snapshot is an older, genuine one. Keeping the
//! NATS server closed to others (its own auth and TLS, `docs/api.md`) is what prevents
//! that.
//!
//! # Invariants
//! 1. A key is never used for two kinds or two scopes (the derivation input differs).
//! 2. [`ReplicaKey::open`] compares tags in constant time (`ring::hmac::verify`) and
//!    returns the payload only when the tag matches.
//! 3. The secret itself is kept only as a `ring` key: never printed (`Debug` is redacted),
//!    never sent.
//!
//! # Concurrency
//! Keys are immutable after derivation; share them freely (`Clone` is cheap).

use crate::error::{Result, TransportError};
use bytes::{BufMut, Bytes, BytesMut};
use ring::hmac;

/// Bytes of the tag after each payload.
pub const TAG_LEN: usize = 32;
/// The shortest secret accepted: 16 bytes (128 bits, if random).
pub const MIN_SECRET_LEN: usize = 16;

/// What a message is, for the key derivation (invariant 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A load frame (`P.load`).
    Frame,
    /// A resync request (`P.resync`).
    Resync,
    /// A session frame (`P.sessions`).
    Sessions,
    /// A snapshot in the object store.
    Snapshot,
}

impl Kind {
    fn label(self) -> &'static str {
        match self {
            Kind::Frame => "frame",
            Kind::Resync => "resync",
            Kind::Sessions => "sessions",
            Kind::Snapshot => "snapshot",
        }
    }
}

/// The deployment's shared secret (`--replica-secret`), as a `ring` key.
#[derive(Clone)]
pub struct ReplicaSecret {
    key: hmac::Key,
}

impl std::fmt::Debug for ReplicaSecret {
    /// Never the secret (invariant 3).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ReplicaSecret(<redacted>)")
    }
}

impl ReplicaSecret {
    /// The secret from its text; refused if shorter than [`MIN_SECRET_LEN`] bytes.
    pub fn new(secret: &str) -> Result<Self> {
        if secret.len() < MIN_SECRET_LEN {
            return Err(TransportError::Invalid {
                name: "--replica-secret",
                reason: format!(
                    "{} bytes; at least {MIN_SECRET_LEN} are needed (e.g. `openssl rand -hex 32`)",
                    secret.len()
                ),
            });
        }
        Ok(Self {
            key: hmac::Key::new(hmac::HMAC_SHA256, secret.as_bytes()),
        })
    }

    /// The key for messages of `kind` in `scope` (invariant 1).
    pub fn key(&self, kind: Kind, scope: &str) -> ReplicaKey {
        let mut ctx = hmac::Context::with_key(&self.key);
        ctx.update(b"kvengine replica v1\0");
        ctx.update(kind.label().as_bytes());
        ctx.update(b"\0");
        ctx.update(scope.as_bytes());
        let derived = ctx.sign();
        ReplicaKey {
            kind,
            key: hmac::Key::new(hmac::HMAC_SHA256, derived.as_ref()),
        }
    }
}

/// The key of one kind of message in one scope.
#[derive(Clone)]
pub struct ReplicaKey {
    kind: Kind,
    key: hmac::Key,
}

impl std::fmt::Debug for ReplicaKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplicaKey")
            .field("kind", &self.kind)
            .finish_non_exhaustive()
    }
}

impl ReplicaKey {
    /// The tag of `payload` (what [`ReplicaKey::seal`] appends).
    pub fn tag(&self, payload: &[u8]) -> [u8; TAG_LEN] {
        let mut out = [0u8; TAG_LEN];
        out.copy_from_slice(hmac::sign(&self.key, payload).as_ref());
        out
    }

    /// `payload` followed by its tag.
    pub fn seal(&self, payload: &[u8]) -> Bytes {
        let mut out = BytesMut::with_capacity(payload.len() + TAG_LEN);
        out.put_slice(payload);
        out.put_slice(&self.tag(payload));
        out.freeze()
    }

    /// The payload of a sealed `message`, if its tag is this key's (invariant 2); a
    /// message too short to hold a tag, or whose tag does not match, is
    /// [`TransportError::ReplicaMac`].
    pub fn open<'a>(&self, message: &'a [u8]) -> Result<&'a [u8]> {
        let unauthorized = |why: &'static str| TransportError::ReplicaMac {
            what: self.kind.label(),
            why,
        };
        let Some(split) = message.len().checked_sub(TAG_LEN) else {
            return Err(unauthorized("too short to carry a MAC"));
        };
        let (payload, tag) = message.split_at(split);
        hmac::verify(&self.key, payload, tag).map_err(|_| unauthorized("with a bad MAC"))?;
        Ok(payload)
    }
}

/// `payload`, sealed with `key` if there is one (without one, as it is).
pub fn seal(key: Option<&ReplicaKey>, payload: Bytes) -> Bytes {
    match key {
        Some(k) => k.seal(&payload),
        None => payload,
    }
}

/// The payload of `message`, checked with `key` if there is one (without one, the whole
/// message).
pub fn open<'a>(key: Option<&ReplicaKey>, message: &'a [u8]) -> Result<&'a [u8]> {
    match key {
        Some(k) => k.open(message),
        None => Ok(message),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret() -> ReplicaSecret {
        ReplicaSecret::new("0123456789abcdef-shared").unwrap()
    }

    #[test]
    fn sealed_messages_open_with_the_same_key_only() {
        let k = secret().key(Kind::Frame, "kvengine");
        let sealed = k.seal(b"payload");
        assert_eq!(sealed.len(), 7 + TAG_LEN);
        assert_eq!(k.open(&sealed).unwrap(), b"payload");
        assert_eq!(sealed[7..], k.tag(b"payload"));
        // Same secret, another kind or scope; another secret.
        for other in [
            secret().key(Kind::Resync, "kvengine"),
            secret().key(Kind::Frame, "other"),
            ReplicaSecret::new("another-secret-of-16+")
                .unwrap()
                .key(Kind::Frame, "kvengine"),
        ] {
            assert!(other.open(&sealed).is_err());
        }
        // Any flipped bit, a cut, nothing at all, an unsealed payload.
        for i in 0..sealed.len() {
            let mut bad = sealed.to_vec();
            bad[i] ^= 0x01;
            assert!(k.open(&bad).is_err(), "bit flipped at {i}");
        }
        assert!(k.open(&sealed[..sealed.len() - 1]).is_err());
        assert!(k.open(b"").is_err());
        let e = k.open(b"payload").unwrap_err();
        assert!(matches!(e, TransportError::ReplicaMac { .. }), "{e}");
        assert!(e.to_string().contains("--replica-secret"), "{e}");
    }

    #[test]
    fn without_a_key_messages_pass_as_they_are() {
        let payload = Bytes::from_static(b"x");
        assert_eq!(seal(None, payload.clone()), payload);
        assert_eq!(open(None, b"x").unwrap(), b"x");
    }

    #[test]
    fn short_secrets_are_refused_and_none_is_ever_printed() {
        assert!(ReplicaSecret::new("short").is_err());
        let s = ReplicaSecret::new("a-secret-of-enough-bytes").unwrap();
        assert!(!format!("{s:?}").contains("enough"));
        assert!(!format!("{:?}", s.key(Kind::Snapshot, "b")).contains("enough"));
    }
}
