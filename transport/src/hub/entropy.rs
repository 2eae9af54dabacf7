//! The system's CSPRNG as the source of generated request ids ([`engine::router::ids`]):
//! holding an id is what lets a caller of the routing API mark or free its request, so a
//! serving router's ids must be unguessable.

use engine::router::ids::Entropy;

/// Random bytes drawn from the system's CSPRNG a page at a time (one `getrandom` per 256
/// ids rather than one per id). Should the system's generator ever fail, the bytes come
/// from a hash of the time and a counter instead: still unique, only guessable with effort.
pub struct SystemEntropy {
    pool: Box<[u8; 4096]>,
    used: usize,
    fallbacks: u64,
}

impl std::fmt::Debug for SystemEntropy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SystemEntropy").finish_non_exhaustive()
    }
}

impl Default for SystemEntropy {
    fn default() -> Self {
        Self {
            pool: Box::new([0; 4096]),
            used: 4096,
            fallbacks: 0,
        }
    }
}

impl Entropy for SystemEntropy {
    fn fill(&mut self, out: &mut [u8; 16]) {
        use ring::rand::{SecureRandom, SystemRandom};
        if self.used + out.len() > self.pool.len() {
            if SystemRandom::new().fill(&mut self.pool[..]).is_err() {
                self.fallbacks += 1;
                fallback_random(&mut self.pool[..], self.fallbacks);
            }
            self.used = 0;
        }
        if let Some(src) = self.pool.get(self.used..self.used + out.len()) {
            out.copy_from_slice(src);
        }
        self.used += out.len();
    }
}

/// Fills `out` from SHA-256 of the time, the process and a counter.
fn fallback_random(out: &mut [u8], counter: u64) {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    for (i, chunk) in out.chunks_mut(32).enumerate() {
        let seed = format!("{nanos}/{}/{counter}/{i}", std::process::id());
        let d = ring::digest::digest(&ring::digest::SHA256, seed.as_bytes());
        let n = chunk.len();
        chunk.copy_from_slice(&d.as_ref()[..n]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use engine::router::ids::RequestIds;

    #[test]
    fn system_ids_are_unique_and_unrelated() {
        let mut ids = RequestIds::new(Box::new(SystemEntropy::default()));
        let all: std::collections::HashSet<String> = (0..1000).map(|_| ids.draw()).collect();
        assert_eq!(all.len(), 1000);
        let (a, b) = (ids.draw(), ids.draw());
        assert_ne!(a[..12], b[..12], "{a} {b}");
        let mut out = [0u8; 64];
        fallback_random(&mut out, 1);
        assert_ne!(out[..32], out[32..]);
    }
}
