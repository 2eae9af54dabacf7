//! How a replica reaches NATS: the server list of `--replica-nats`, the credentials in its
//! URLs, and TLS (`tls://` URLs, `--replica-nats-ca`, `--replica-nats-cert`/`-key`). The
//! link and the warm-start fetch connect with the same options.
//!
//! `async-nats` (0.51) parses `user:password@` in a server URL but never sends it: the
//! credentials are taken out of the URLs here and given to it as options, and the URLs are
//! shown in logs without them.
//!
//! # Invariants
//! 1. Credentials never appear in what [`NatsAccess::redacted`] returns.
//! 2. Every URL names the same credentials (or none): one connection, one identity.

use crate::error::{Result, TransportError};
use async_nats::{ConnectOptions, ServerAddr};
use std::path::PathBuf;

/// The NATS servers and how to authenticate to them.
#[derive(Clone, Debug, Default)]
pub struct NatsAccess {
    /// `--replica-nats`: one URL or several, comma-separated (`nats://`, `tls://`, with
    /// `user:password@` or `token@` if the server wants them).
    pub url: String,
    /// A PEM file of CA certificates to trust instead of the system's (TLS).
    pub ca: Option<PathBuf>,
    /// A PEM client certificate chain and its key (TLS client auth, the server's `verify`).
    pub client_cert: Option<(PathBuf, PathBuf)>,
}

fn bad(reason: impl Into<String>) -> TransportError {
    TransportError::Invalid {
        name: "--replica-nats",
        reason: reason.into(),
    }
}

/// What a server URL says about authentication.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Credentials {
    None,
    Token(String),
    User(String, String),
}

fn credentials(addr: &ServerAddr) -> Result<Credentials> {
    let decode = |s: &str| {
        percent_decode(s).ok_or_else(|| bad("credentials in a URL are not valid percent-encoding"))
    };
    Ok(match (addr.username(), addr.password()) {
        (None, None) => Credentials::None,
        (Some(t), None) => Credentials::Token(decode(t)?),
        (u, Some(p)) => Credentials::User(decode(u.unwrap_or(""))?, decode(p)?),
    })
}

/// `%XX` escapes decoded (URLs keep credentials percent-encoded); `None` if not UTF-8.
fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while let Some(&b) = bytes.get(i) {
        if b == b'%' {
            let hex = bytes.get(i + 1..i + 3)?;
            let hex = std::str::from_utf8(hex).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

impl NatsAccess {
    /// `url`, without TLS files.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            ..Self::default()
        }
    }

    /// The servers named, parsed (a comma-separated list: `async-nats` parses a string as
    /// one URL).
    pub fn servers(&self) -> Result<Vec<ServerAddr>> {
        let servers: Vec<ServerAddr> = self
            .url
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(|s| {
                s.parse::<ServerAddr>()
                    .map_err(|e| bad(format!("{}: {e}", redact_one(s))))
            })
            .collect::<Result<_>>()?;
        if servers.is_empty() {
            return Err(bad("no server named"));
        }
        Ok(servers)
    }

    /// The URLs as logs may show them: credentials replaced by `***` (invariant 1).
    pub fn redacted(&self) -> String {
        self.url
            .split(',')
            .map(|s| redact_one(s.trim()))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Connect options carrying the URLs' credentials and the TLS files (callers add their
    /// own name, callbacks and retry policy).
    pub fn options(&self) -> Result<ConnectOptions> {
        let servers = self.servers()?;
        let mut found: Option<Credentials> = None;
        for s in &servers {
            let c = credentials(s)?;
            match &found {
                Some(f) if *f != c => {
                    return Err(bad(
                        "the URLs name different credentials (or some none): give every \
                         server the same ones",
                    ));
                }
                _ => found = Some(c),
            }
        }
        let mut options = match found.unwrap_or(Credentials::None) {
            Credentials::None => ConnectOptions::new(),
            Credentials::Token(t) => ConnectOptions::with_token(t),
            Credentials::User(u, p) => ConnectOptions::with_user_and_password(u, p),
        };
        if let Some(ca) = &self.ca {
            if !ca.is_file() {
                return Err(bad(format!("CA file {} not found", ca.display())));
            }
            options = options.add_root_certificates(ca.clone());
        }
        if let Some((cert, key)) = &self.client_cert {
            for f in [cert, key] {
                if !f.is_file() {
                    return Err(bad(format!("TLS file {} not found", f.display())));
                }
            }
            options = options.add_client_certificate(cert.clone(), key.clone());
        }
        if self.ca.is_some() || self.client_cert.is_some() {
            options = options.require_tls(true);
        }
        Ok(options)
    }
}

/// One URL with its credentials replaced by `***`.
fn redact_one(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url
            .rsplit_once('@')
            .map_or(url.to_owned(), |(_, h)| format!("***@{h}"));
    };
    let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    match authority.rsplit_once('@') {
        Some((_, host)) => format!("{scheme}://***@{host}{path}"),
        None => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn servers_are_split_and_credentials_taken_out() {
        let a = NatsAccess::new("nats://u:p%40ss@a:4222, tls://u:p%40ss@b:4333");
        let s = a.servers().unwrap();
        assert_eq!(s.len(), 2);
        assert_eq!((s[0].host(), s[0].port()), ("a", 4222));
        assert!(s[1].tls_required());
        assert_eq!(
            credentials(&s[0]).unwrap(),
            Credentials::User("u".into(), "p@ss".into())
        );
        assert!(a.options().is_ok());
        assert_eq!(a.redacted(), "nats://***@a:4222,tls://***@b:4333");
        assert!(!a.redacted().contains("p%40ss"));
        let t = NatsAccess::new("nats://s3cret-token@a");
        assert_eq!(
            credentials(&t.servers().unwrap()[0]).unwrap(),
            Credentials::Token("s3cret-token".into())
        );
        assert_eq!(t.redacted(), "nats://***@a");
        assert_eq!(NatsAccess::new("nats://a:1").redacted(), "nats://a:1");
    }

    #[test]
    fn mixed_credentials_missing_files_and_bad_urls_are_refused() {
        assert!(NatsAccess::new("nats://u:p@a,nats://b").options().is_err());
        assert!(NatsAccess::new("").servers().is_err());
        assert!(NatsAccess::new("http://a").servers().is_err());
        let e = NatsAccess::new("http://u:secret@a").servers().unwrap_err();
        assert!(!e.to_string().contains("secret"), "{e}");
        let mut a = NatsAccess::new("nats://a");
        a.ca = Some("/nonexistent/ca.pem".into());
        assert!(a.options().is_err());
    }
}
