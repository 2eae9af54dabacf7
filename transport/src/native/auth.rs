//! Who may publish for which worker over the native protocol: ingest tokens, each bound to
//! the workers it covers.
//!
//! A publisher presents its token in the hello; the server looks it up in
//! [`IngestCredentials`] and accepts the hello only when that token's [`WorkerScope`] covers
//! the worker the hello names. A connection then publishes for that one worker (a batch
//! naming another is refused), so a token bound to worker 1 can neither write worker 2's
//! blocks nor clear them (by claiming to be a new publisher instance of worker 2).
//!
//! ```
//! use transport::native::{IngestCredentials, ScopedToken, WorkerScope};
//! use engine::WorkerId;
//! let mut creds = IngestCredentials::default();
//! creds.insert("1,4-7=gpu-pool-a-secret".parse::<ScopedToken>()?)?;
//! creds.insert(ScopedToken::any_worker("legacy-secret"))?;
//! assert!(creds.scope_of("gpu-pool-a-secret").unwrap().covers(WorkerId(5)));
//! assert!(!creds.scope_of("gpu-pool-a-secret").unwrap().covers(WorkerId(2)));
//! assert_eq!(creds.scope_of("legacy-secret"), Some(&WorkerScope::Any));
//! assert_eq!(creds.scope_of("guess"), None);
//! # Ok::<(), transport::TransportError>(())
//! ```
//!
//! # Invariants
//! 1. Tokens are kept only as SHA-256 digests. A presented token is hashed once and its
//!    digest compared with every configured digest, each comparison in constant time and
//!    none skipped after a match, so the answer's timing says nothing about how close a guess
//!    was, nor how long the real tokens are.
//! 2. A token is configured once: a second entry with the same token is refused, so there is
//!    never a question of which scope applies. The empty token is refused.
//! 3. [`WorkerScope::Any`] is what the single legacy `--ingest-token` grants.
//! 4. No error or `Debug` output contains a token.
//!
//! # Concurrency
//! Built once before the server starts, then read-only (shared by every connection task).

use super::quic_tls::constant_time_eq;
use crate::error::{Result, TransportError};
use engine::WorkerId;
use std::fmt;
use std::ops::RangeInclusive;
use std::str::FromStr;

/// The workers one ingest token may publish for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WorkerScope {
    /// Every worker (`*`; what the legacy `--ingest-token` grants).
    Any,
    /// These worker ids (inclusive ranges, as configured).
    Workers(Vec<RangeInclusive<u64>>),
}

impl WorkerScope {
    /// Whether a publisher holding this scope may publish for `worker`.
    pub fn covers(&self, worker: WorkerId) -> bool {
        match self {
            WorkerScope::Any => true,
            WorkerScope::Workers(ranges) => ranges.iter().any(|r| r.contains(&worker.0)),
        }
    }
}

fn invalid(reason: impl Into<String>) -> TransportError {
    TransportError::Invalid {
        name: "ingest token",
        reason: reason.into(),
    }
}

impl FromStr for WorkerScope {
    type Err = TransportError;

    /// `*`, or comma-separated worker ids and inclusive ranges: `1,4-7,12`.
    fn from_str(text: &str) -> Result<WorkerScope> {
        let text = text.trim();
        if text == "*" {
            return Ok(WorkerScope::Any);
        }
        let id = |s: &str| {
            s.trim().parse::<u64>().map_err(|_| {
                invalid(format!(
                    "{s:?} is not a worker id (workers are `*` or ids and ranges like `1,4-7`)"
                ))
            })
        };
        let mut ranges = Vec::new();
        for item in text.split(',') {
            let range = match item.split_once('-') {
                Some((lo, hi)) => id(lo)?..=id(hi)?,
                None => id(item)?..=id(item)?,
            };
            if range.is_empty() {
                return Err(invalid(format!("the worker range {item:?} is empty")));
            }
            ranges.push(range);
        }
        Ok(WorkerScope::Workers(ranges))
    }
}

impl fmt::Display for WorkerScope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WorkerScope::Any => f.write_str("*"),
            WorkerScope::Workers(ranges) => {
                for (i, r) in ranges.iter().enumerate() {
                    if i > 0 {
                        f.write_str(",")?;
                    }
                    if r.start() == r.end() {
                        write!(f, "{}", r.start())?;
                    } else {
                        write!(f, "{}-{}", r.start(), r.end())?;
                    }
                }
                Ok(())
            }
        }
    }
}

/// One token and the workers it covers: `WORKERS=TOKEN` as text (`*=TOKEN` for any worker;
/// the token is everything after the first `=`). `Debug` never shows the token.
#[derive(Clone, PartialEq, Eq)]
pub struct ScopedToken {
    /// The workers it covers.
    pub scope: WorkerScope,
    token: String,
}

impl ScopedToken {
    /// `token`, covering `scope`.
    pub fn new(scope: WorkerScope, token: impl Into<String>) -> ScopedToken {
        ScopedToken {
            scope,
            token: token.into(),
        }
    }

    /// `token`, covering every worker (the legacy single ingest token).
    pub fn any_worker(token: impl Into<String>) -> ScopedToken {
        ScopedToken::new(WorkerScope::Any, token)
    }
}

impl FromStr for ScopedToken {
    type Err = TransportError;

    fn from_str(text: &str) -> Result<ScopedToken> {
        let (workers, token) = text.split_once('=').ok_or_else(|| {
            invalid("expected WORKERS=TOKEN (WORKERS: `*` or ids and ranges like `1,4-7`)")
        })?;
        Ok(ScopedToken::new(workers.parse()?, token.trim()))
    }
}

impl fmt::Debug for ScopedToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ScopedToken")
            .field("scope", &self.scope.to_string())
            .field("token", &"<redacted>")
            .finish()
    }
}

/// Bytes of a token digest.
const DIGEST_BYTES: usize = 32;

fn digest(token: &str) -> [u8; DIGEST_BYTES] {
    let d = ring::digest::digest(&ring::digest::SHA256, token.as_bytes());
    let mut out = [0u8; DIGEST_BYTES];
    out.copy_from_slice(d.as_ref());
    out
}

/// Every token the server accepts, with its scope (see the module docs).
#[derive(Clone, Default)]
pub struct IngestCredentials {
    entries: Vec<([u8; DIGEST_BYTES], WorkerScope)>,
}

impl IngestCredentials {
    /// Credentials of one token covering every worker (the legacy single ingest token).
    pub fn any_worker(token: &str) -> Result<IngestCredentials> {
        let mut creds = IngestCredentials::default();
        creds.insert(ScopedToken::any_worker(token))?;
        Ok(creds)
    }

    /// Adds a token; refuses the empty token and a token already configured (invariant 2).
    pub fn insert(&mut self, token: ScopedToken) -> Result<()> {
        if token.token.is_empty() {
            return Err(invalid("the empty token"));
        }
        let d = digest(&token.token);
        if self.entries.iter().any(|(e, _)| constant_time_eq(e, &d)) {
            return Err(invalid(format!(
                "a token (for workers {}) is configured twice: each token has one scope",
                token.scope
            )));
        }
        self.entries.push((d, token.scope));
        Ok(())
    }

    /// Adds the tokens of a token file: one `WORKERS=TOKEN` a line; blank lines and lines
    /// starting with `#` are skipped, whitespace around a line is ignored. An error names
    /// the line, never the token.
    pub fn insert_lines(&mut self, text: &str) -> Result<()> {
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let at_line = |e: TransportError| match e {
                TransportError::Invalid { reason, .. } => {
                    invalid(format!("line {}: {reason}", i + 1))
                }
                other => other,
            };
            let token = line.parse::<ScopedToken>().map_err(at_line)?;
            self.insert(token).map_err(at_line)?;
        }
        Ok(())
    }

    /// How many tokens are configured.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no token is configured (a server refuses to start so).
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The scope of `presented`, or `None` when no configured token equals it (constant
    /// time, invariant 1).
    pub fn scope_of(&self, presented: &str) -> Option<&WorkerScope> {
        let d = digest(presented);
        let mut found = None;
        for (e, scope) in &self.entries {
            if constant_time_eq(e, &d) {
                found = Some(scope);
            }
        }
        found
    }
}

impl fmt::Debug for IngestCredentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IngestCredentials")
            .field(
                "scopes",
                &self
                    .entries
                    .iter()
                    .map(|(_, s)| s.to_string())
                    .collect::<Vec<_>>(),
            )
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scopes_parse_print_and_cover() {
        let s: WorkerScope = " 1, 4-7 ,12".parse().unwrap();
        assert_eq!(s.to_string(), "1,4-7,12");
        for (w, yes) in [
            (0, false),
            (1, true),
            (3, false),
            (4, true),
            (7, true),
            (12, true),
        ] {
            assert_eq!(s.covers(WorkerId(w)), yes, "worker {w}");
        }
        assert_eq!("*".parse::<WorkerScope>().unwrap(), WorkerScope::Any);
        assert!(WorkerScope::Any.covers(WorkerId(u64::MAX)));
        for bad in ["", "x", "1,", "7-4", "1-", "-3", "*,1", "1 2"] {
            assert!(bad.parse::<WorkerScope>().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn tokens_compare_exactly_and_never_show() {
        let t: ScopedToken = "2=a=b".parse().unwrap();
        assert_eq!(
            t,
            ScopedToken::new(WorkerScope::Workers(vec![2..=2]), "a=b")
        );
        assert!(!format!("{t:?}").contains("a=b"));
        assert!("no-separator".parse::<ScopedToken>().is_err());
        let mut c = IngestCredentials::any_worker("s3cret").unwrap();
        c.insert(t).unwrap();
        assert_eq!(c.scope_of("s3cret"), Some(&WorkerScope::Any));
        assert_eq!(c.scope_of("a=b"), Some(&WorkerScope::Workers(vec![2..=2])));
        for wrong in ["s3cres", "s3cret ", "", "a=", "S3CRET"] {
            assert_eq!(c.scope_of(wrong), None, "{wrong:?}");
        }
        assert!(!format!("{c:?}").contains("s3cret"));
        // Once per token, never empty.
        assert!(c.insert(ScopedToken::new(WorkerScope::Any, "a=b")).is_err());
        assert!(c.insert(ScopedToken::any_worker("")).is_err());
        assert!(IngestCredentials::any_worker("").is_err());
        assert_eq!(c.len(), 2);
    }

    #[test]
    fn token_files_name_the_bad_line_not_the_token() {
        let mut c = IngestCredentials::default();
        c.insert_lines("# pool a\n\n 1-3 = alpha \n*=omega\n")
            .unwrap();
        assert_eq!(c.len(), 2);
        assert!(c.scope_of("alpha").unwrap().covers(WorkerId(3)));
        assert_eq!(c.scope_of("omega"), Some(&WorkerScope::Any));
        let err = c.insert_lines("\nfoo=x\n").unwrap_err().to_string();
        assert!(err.contains("line 2"), "{err}");
        let err = c.insert_lines("1=zeta\n2=alpha\n").unwrap_err().to_string();
        assert!(err.contains("line 2") && !err.contains("alpha"), "{err}");
        let err = c.insert_lines("just-a-token\n").unwrap_err().to_string();
        assert!(
            err.contains("line 1") && !err.contains("just-a-token"),
            "{err}"
        );
    }
}
