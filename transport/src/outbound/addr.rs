//! Worker addresses, parsed once: [`WorkerUrl`] (`http[s]://host[:port][/path]`, where a
//! worker's HTTP API is) and [`ZmqEndpoint`] (`tcp://host:port`, where its KV events are
//! published and replayed), and [`host_allowed`], the `--worker-hosts` check on a parsed
//! [`Host`].
//!
//! Every address a worker is registered with goes through these parsers, whichever way it
//! arrives: `POST /v1/workers`, `--worker`, `--zmq-worker`, `--trtllm-worker`, the config
//! file, a state snapshot, a Python or native registration ([`crate::hub::Hub::register`]
//! stores the canonical text only).
//!
//! # Invariants
//! 1. A parsed address is a bare base address: a scheme, a host, a port, and for
//!    [`WorkerUrl`] an optional plain path prefix. Userinfo (`@`), queries (`?`),
//!    fragments (`#`), percent-escapes (`%`), backslashes, whitespace, control and
//!    non-ASCII characters are refused before any URI parser sees the text, so no two
//!    parsers can disagree on where the host is (the `http://169.254.169.254#@gpu-1`
//!    class of bugs).
//! 2. The host is checked as parsed by `http::Uri` (`uri.host()`), and must also be a valid
//!    host on its own: a DNS name (letters, digits, `-`, `_` in 1..=63-byte labels; its last
//!    label not a number, so `2852039166` or `0x7f.1` can never be read as an IPv4 address
//!    by a resolver), a dotted-quad IPv4 address, or a bracketed IPv6 address without zone.
//!    The unspecified addresses (`0.0.0.0`, `[::]`) are bind addresses and refused.
//! 3. Canonical text ([`WorkerUrl::as_str`], [`ZmqEndpoint::as_str`]): lowercase scheme
//!    and host, IPv6 in its compressed form, the port only when given, no trailing `/`.
//!    Parsing a canonical text gives it back unchanged.
//! 4. [`host_allowed`] compares hosts, never strings with a scheme or port: names exactly
//!    (ASCII case-insensitive) or by `*.suffix`, addresses as addresses (an entry
//!    `10.0.0.7` matches only that IPv4 address; `[::ffff:10.0.0.7]` is another host).

use std::fmt;
use std::net::{Ipv4Addr, Ipv6Addr};

/// The longest address accepted, in bytes.
pub const MAX_ADDR_LEN: usize = 2048;

/// Why an address was refused (always names the text and the rule it broke).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{text:?}: {why}")]
pub struct AddrError {
    /// The address as given (cut at [`MAX_ADDR_LEN`]).
    pub text: String,
    /// What is wrong with it.
    pub why: String,
}

fn refuse<T>(text: &str, why: impl Into<String>) -> Result<T, AddrError> {
    let cut = text.get(..MAX_ADDR_LEN.min(text.len())).unwrap_or("");
    Err(AddrError {
        text: cut.to_owned(),
        why: why.into(),
    })
}

/// A worker's host, as parsed (see the module's invariant 2).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Host {
    /// A DNS name, lowercase.
    Name(String),
    /// An IPv4 address.
    V4(Ipv4Addr),
    /// An IPv6 address (written in brackets in URLs).
    V6(Ipv6Addr),
}

impl fmt::Display for Host {
    /// As in a URL: a name, a dotted quad, or `[v6]`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Name(n) => f.write_str(n),
            Self::V4(a) => write!(f, "{a}"),
            Self::V6(a) => write!(f, "[{a}]"),
        }
    }
}

impl Host {
    /// Parses a host as written in a URL (`name`, `1.2.3.4` or `[v6]`).
    pub fn parse(text: &str) -> Result<Self, AddrError> {
        if let Some(inner) = text.strip_prefix('[') {
            let Some(inner) = inner.strip_suffix(']') else {
                return refuse(text, "unterminated IPv6 address");
            };
            return match inner.parse::<Ipv6Addr>() {
                Ok(a) if a.is_unspecified() => refuse(text, "[::] is a bind address, not a host"),
                Ok(a) => Ok(Self::V6(a)),
                Err(_) => refuse(text, "not an IPv6 address (zones are not accepted)"),
            };
        }
        if text.is_empty() {
            return refuse(text, "no host");
        }
        if text.len() > 253 {
            return refuse(text, "host name longer than 253 bytes");
        }
        let last = text.rsplit('.').next().unwrap_or(text);
        if looks_numeric(last) {
            // A resolver reads `1.2.3.4`, but also `2852039166`, `0x7f.1` or `010.0.0.1`,
            // as an IPv4 address: only the one unambiguous form is taken.
            return match text.parse::<Ipv4Addr>() {
                Ok(a) if a.is_unspecified() => {
                    refuse(text, "0.0.0.0 is a bind address, not a host")
                }
                Ok(a) if a.to_string() == text => Ok(Self::V4(a)),
                _ => refuse(
                    text,
                    "a host ending in a number must be a dotted-quad IPv4 address",
                ),
            };
        }
        for label in text.split('.') {
            if label.is_empty() || label.len() > 63 {
                return refuse(text, "empty or over-long label in the host name");
            }
            if label.starts_with('-') || label.ends_with('-') {
                return refuse(text, "a host label may not start or end with '-'");
            }
            if !label
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
            {
                return refuse(
                    text,
                    "a host name is letters, digits, '-', '_' and dots only",
                );
            }
        }
        Ok(Self::Name(text.to_ascii_lowercase()))
    }
}

/// Whether a resolver would read `label` (a host's last label) as a number: all decimal
/// digits, or `0x` and hex digits (the WHATWG URL standard's "ends in a number").
fn looks_numeric(label: &str) -> bool {
    let hex = label
        .strip_prefix("0x")
        .or_else(|| label.strip_prefix("0X"));
    match hex {
        Some(h) => h.bytes().all(|b| b.is_ascii_hexdigit()),
        None => !label.is_empty() && label.bytes().all(|b| b.is_ascii_digit()),
    }
}

/// Refuses what no bare address contains (invariant 1).
fn check_chars(text: &str, what: &str) -> Result<(), AddrError> {
    if text.is_empty() {
        return refuse(text, format!("empty {what}"));
    }
    if text.len() > MAX_ADDR_LEN {
        return refuse(text, format!("longer than {MAX_ADDR_LEN} bytes"));
    }
    for (c, why) in [
        ('@', "no userinfo (user@host) allowed"),
        ('#', "no fragment (#...) allowed"),
        ('?', "no query string allowed"),
        ('%', "no percent-escapes allowed"),
        ('\\', "no backslashes allowed"),
    ] {
        if text.contains(c) {
            return refuse(text, why);
        }
    }
    if !text.bytes().all(|b| b.is_ascii_graphic()) {
        return refuse(
            text,
            "printable ASCII only (no spaces, control or non-ASCII characters)",
        );
    }
    Ok(())
}

/// `host[:port]` (the authority, userinfo already refused): the host text and the port.
fn split_authority(text: &str, authority: &str) -> Result<(String, Option<u16>), AddrError> {
    let (host, port) = match authority.strip_prefix('[') {
        Some(v6) => match v6.split_once(']') {
            Some((inner, "")) => (format!("[{inner}]"), None),
            Some((inner, rest)) => match rest.strip_prefix(':') {
                Some(p) => (format!("[{inner}]"), Some(p)),
                None => return refuse(text, "junk after the host"),
            },
            None => return refuse(text, "unterminated IPv6 address"),
        },
        None => match authority.rsplit_once(':') {
            Some((h, p)) => (h.to_owned(), Some(p)),
            None => (authority.to_owned(), None),
        },
    };
    let port = match port {
        None => None,
        Some(p) if !p.is_empty() && p.len() <= 5 && p.bytes().all(|b| b.is_ascii_digit()) => {
            match p.parse::<u16>() {
                Ok(n) if n > 0 => Some(n),
                _ => return refuse(text, "port must be 1..=65535"),
            }
        }
        Some(_) => return refuse(text, "port must be 1..=65535"),
    };
    Ok((host, port))
}

/// Whether a worker URL is plain HTTP or HTTPS.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Scheme {
    /// `http://`.
    Http,
    /// `https://` (rustls; see [`super::connector`]).
    Https,
}

impl Scheme {
    /// `http` or `https`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Http => "http",
            Self::Https => "https",
        }
    }
}

/// A worker's HTTP base URL: `http[s]://host[:port][/prefix]` (see the module docs).
/// Requests go to `{url}{path}` ([`WorkerUrl::join`]).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct WorkerUrl {
    text: String,
    scheme: Scheme,
    host: Host,
    port: Option<u16>,
    /// Where the path prefix starts in `text` (`text.len()`: none).
    path_at: usize,
}

impl WorkerUrl {
    /// Parses a worker's base URL (a trailing `/` is dropped).
    pub fn parse(text: &str) -> Result<Self, AddrError> {
        check_chars(text, "URL")?;
        let Ok(uri) = text.parse::<hyper::Uri>() else {
            return refuse(text, "not a URL");
        };
        let scheme = match uri.scheme_str().map(str::to_ascii_lowercase).as_deref() {
            Some("http") => Scheme::Http,
            Some("https") => Scheme::Https,
            _ => return refuse(text, "only http:// and https:// URLs are accepted"),
        };
        if uri.query().is_some() {
            return refuse(text, "no query string allowed");
        }
        let Some(authority) = uri.authority() else {
            return refuse(text, "no host");
        };
        let (host_text, port) = split_authority(text, authority.as_str())?;
        // The host the URI parser saw must be the one checked here (invariant 2).
        if uri
            .host()
            .is_none_or(|h| !h.eq_ignore_ascii_case(&host_text))
        {
            return refuse(text, "ambiguous host");
        }
        let host = Host::parse(&host_text)?;
        if uri.port_u16() != port {
            return refuse(text, "ambiguous port");
        }
        let path = uri.path().trim_end_matches('/');
        if !path.is_empty() {
            check_path(text, path)?;
        }
        let mut canonical = format!("{}://{host}", scheme.as_str());
        if let Some(p) = port {
            canonical.push_str(&format!(":{p}"));
        }
        let path_at = canonical.len();
        canonical.push_str(path);
        Ok(Self {
            text: canonical,
            scheme,
            host,
            port,
            path_at,
        })
    }

    /// The canonical text (invariant 3).
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// Its scheme.
    pub fn scheme(&self) -> Scheme {
        self.scheme
    }

    /// Its host.
    pub fn host(&self) -> &Host {
        &self.host
    }

    /// Its port, if the URL gave one (else the scheme's: 80 or 443).
    pub fn port(&self) -> Option<u16> {
        self.port
    }

    /// Its path prefix (`""` or `/a/b`).
    pub fn path(&self) -> &str {
        self.text.get(self.path_at..).unwrap_or("")
    }

    /// The URI of `path` (which starts with `/`) under this base URL.
    pub fn join(&self, path: &str) -> Result<hyper::Uri, AddrError> {
        format!("{}{path}", self.text)
            .parse()
            .or_else(|_| refuse(path, "not a path"))
    }
}

impl fmt::Display for WorkerUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

impl std::str::FromStr for WorkerUrl {
    type Err = AddrError;

    fn from_str(s: &str) -> Result<Self, AddrError> {
        Self::parse(s)
    }
}

/// A path prefix: `/`-separated segments of unreserved characters (`A-Z a-z 0-9 - . _ ~`),
/// none of them `.` or `..` (a prefix is where a worker sits behind a proxy, never a way
/// out of it).
fn check_path(text: &str, path: &str) -> Result<(), AddrError> {
    let Some(rest) = path.strip_prefix('/') else {
        return refuse(text, "the path must start with '/'");
    };
    for seg in rest.split('/') {
        if seg.is_empty() || seg == "." || seg == ".." {
            return refuse(text, "empty, '.' or '..' path segment");
        }
        if !seg
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~'))
        {
            return refuse(
                text,
                "a path prefix is letters, digits and '-', '.', '_', '~' between '/'s",
            );
        }
    }
    Ok(())
}

/// A ZMQ endpoint the router connects to: `tcp://host:port` (the only transport its ZMQ
/// library is built with; `ipc://` and `inproc://` are refused, and so is the bind-only
/// `tcp://*:port`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ZmqEndpoint {
    text: String,
    host: Host,
    port: u16,
}

impl ZmqEndpoint {
    /// Parses `tcp://host:port`; every refusal names that form.
    pub fn parse(text: &str) -> Result<Self, AddrError> {
        Self::parse_bare(text).map_err(|mut e| {
            if !e.why.contains("tcp://HOST:PORT") {
                e.why.push_str(" (expected tcp://HOST:PORT)");
            }
            e
        })
    }

    fn parse_bare(text: &str) -> Result<Self, AddrError> {
        check_chars(text, "endpoint")?;
        let Some(authority) = text.strip_prefix("tcp://") else {
            return refuse(text, "only tcp://HOST:PORT endpoints are accepted");
        };
        if authority.contains('/') {
            return refuse(text, "no path allowed (tcp://HOST:PORT)");
        }
        if authority.starts_with("*:") {
            return refuse(
                text,
                "tcp://*:PORT is where a worker binds; name the worker's host",
            );
        }
        let (host_text, port) = split_authority(text, authority)?;
        let Some(port) = port else {
            return refuse(text, "no port (tcp://HOST:PORT)");
        };
        let host = Host::parse(&host_text)?;
        Ok(Self {
            text: format!("tcp://{host}:{port}"),
            host,
            port,
        })
    }

    /// The canonical text (invariant 3).
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// Its host.
    pub fn host(&self) -> &Host {
        &self.host
    }

    /// Its port.
    pub fn port(&self) -> u16 {
        self.port
    }
}

impl fmt::Display for ZmqEndpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

impl std::str::FromStr for ZmqEndpoint {
    type Err = AddrError;

    fn from_str(s: &str) -> Result<Self, AddrError> {
        Self::parse(s)
    }
}

/// Whether `host` matches one of `allowed` (invariant 4); an empty list allows any host.
/// Entries are names (`gpu-1`), `*.suffix` (`*.pool.internal`: any name under it, not the
/// suffix itself), or addresses (`10.0.0.7`, `::1` or `[::1]`).
pub fn host_allowed(allowed: &[String], host: &Host) -> bool {
    allowed.is_empty()
        || allowed
            .iter()
            .any(|entry| entry_matches(entry.trim(), host))
}

fn entry_matches(entry: &str, host: &Host) -> bool {
    let bare = entry
        .strip_prefix('[')
        .and_then(|e| e.strip_suffix(']'))
        .unwrap_or(entry);
    match host {
        Host::V4(a) => bare.parse::<Ipv4Addr>().is_ok_and(|e| e == *a),
        Host::V6(a) => bare.parse::<Ipv6Addr>().is_ok_and(|e| e == *a),
        Host::Name(name) => match entry.strip_prefix("*.") {
            Some(suffix) => {
                let suffix = suffix.to_ascii_lowercase();
                name.len() > suffix.len() + 1
                    && name.ends_with(&suffix)
                    && name.as_bytes().get(name.len() - suffix.len() - 1) == Some(&b'.')
            }
            None => name.eq_ignore_ascii_case(entry),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_urls_are_canonical_and_round_trip() {
        for (given, canonical) in [
            ("http://gpu-1:8000", "http://gpu-1:8000"),
            ("http://GPU-1:8000/", "http://gpu-1:8000"),
            ("HTTP://gpu-1", "http://gpu-1"),
            (
                "https://gpu-1.pool.internal:8443",
                "https://gpu-1.pool.internal:8443",
            ),
            ("http://10.0.0.7:8000", "http://10.0.0.7:8000"),
            ("http://[::1]:8000", "http://[::1]:8000"),
            ("http://[0:0:0:0:0:0:0:1]:8000", "http://[::1]:8000"),
            ("http://gpu-1:8000/v1", "http://gpu-1:8000/v1"),
            (
                "http://gpu-1:8000/pool/a.b_c~d/",
                "http://gpu-1:8000/pool/a.b_c~d",
            ),
            ("http://my_worker:80", "http://my_worker:80"),
        ] {
            let u = WorkerUrl::parse(given).unwrap_or_else(|e| panic!("{given}: {e}"));
            assert_eq!(u.as_str(), canonical, "{given}");
            assert_eq!(WorkerUrl::parse(canonical).unwrap(), u, "{canonical}");
        }
        let u = WorkerUrl::parse("https://[::1]:8443/v1").unwrap();
        assert_eq!(
            (u.scheme(), u.host(), u.port(), u.path()),
            (
                Scheme::Https,
                &Host::V6(Ipv6Addr::LOCALHOST),
                Some(8443),
                "/v1"
            )
        );
        assert_eq!(
            u.join("/health").unwrap().to_string(),
            "https://[::1]:8443/v1/health"
        );
    }

    #[test]
    fn anything_but_a_bare_base_url_is_refused() {
        for bad in [
            "http://169.254.169.254#@gpu-1",
            "http://169.254.169.254/#@gpu-1",
            "http://gpu-1@169.254.169.254",
            "http://gpu-1:x@169.254.169.254",
            "http://evil?@gpu-1",
            "http://gpu-1?x=1",
            "http://gpu-1:8000/v1?x",
            "http://gpu-1:8000#frag",
            "http://gpu-1%2e169.254.169.254",
            "http://169.254.169.254%23@gpu-1",
            "http://gpu-1\\@169.254.169.254",
            "http://gpu-1 :80",
            "http://gpu-1:80/a b",
            "http://gpü:80",
            "ftp://gpu-1",
            "file:///etc/passwd",
            "gopher://gpu-1:70",
            "//gpu-1:80",
            "gpu-1:8000",
            "http://",
            "http://:80",
            "http://gpu-1:",
            "http://gpu-1:0",
            "http://gpu-1:65536",
            "http://gpu-1:+80",
            "http://gpu-1.:80",
            "http://.gpu-1",
            "http://-gpu:80",
            "http://2852039166",
            "http://0x7f.1",
            "http://0xa9fea9fe",
            "http://010.0.0.1",
            "http://169.254.169",
            "http://1.2.3.4.5",
            "http://0.0.0.0:80",
            "http://[::]:80",
            "http://[::1%25eth0]:80",
            "http://[::1",
            "http://gpu-1:80/../metadata",
            "http://gpu-1:80/./x",
            "http://gpu-1:80//x",
            "http://gpu-1:80/a;b",
            "http://gpu-1:80/a:b",
            "",
        ] {
            assert!(WorkerUrl::parse(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn zmq_endpoints_are_tcp_host_port_only() {
        for (given, canonical) in [
            ("tcp://gpu-1:5557", "tcp://gpu-1:5557"),
            ("tcp://GPU-1:5557", "tcp://gpu-1:5557"),
            ("tcp://10.0.0.5:5557", "tcp://10.0.0.5:5557"),
            ("tcp://[::1]:5557", "tcp://[::1]:5557"),
        ] {
            let e = ZmqEndpoint::parse(given).unwrap_or_else(|e| panic!("{given}: {e}"));
            assert_eq!(e.as_str(), canonical);
            assert_eq!(ZmqEndpoint::parse(canonical).unwrap(), e);
        }
        for bad in [
            "tcp://169.254.169.254:5557#@gpu-1",
            "tcp://gpu-1@169.254.169.254:5557",
            "tcp://evil?@gpu-1:5557",
            "tcp://gpu-1:5557/x",
            "tcp://gpu-1:5557?x",
            "tcp://gpu-1",
            "tcp://gpu-1:",
            "tcp://:5557",
            "tcp://*:5557",
            "tcp://gpu-1:0",
            "tcp://gpu-1:99999",
            "tcp://2852039166:5557",
            "tcp://0.0.0.0:5557",
            "ipc:///tmp/kv.sock",
            "inproc://kv",
            "udp://gpu-1:5557",
            "TCP://gpu-1:5557",
            "tcp://gpu 1:5557",
            "",
        ] {
            assert!(ZmqEndpoint::parse(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn hosts_are_matched_exactly_or_by_suffix() {
        let allowed = vec![
            "gpu-1".to_owned(),
            "*.pool.internal".to_owned(),
            "10.0.0.7".into(),
            "[fd00::7]".into(),
        ];
        let url = |s: &str| WorkerUrl::parse(s).unwrap().host().clone();
        for (addr, ok) in [
            ("http://gpu-1:8000", true),
            ("http://GPU-1:8000/v1", true),
            ("http://a.pool.internal:5557", true),
            ("http://pool.internal:5557", false),
            ("http://apool.internal:5557", false),
            ("http://a.pool.internal.evil.com:5557", false),
            ("http://gpu-1.evil.com", false),
            ("http://10.0.0.7", true),
            ("http://[::ffff:10.0.0.7]", false),
            ("http://[fd00:0::7]:80", true),
            ("http://gpu-2:8000", false),
            ("http://[::1]:5557", false),
            ("http://169.254.169.254", false),
        ] {
            assert_eq!(host_allowed(&allowed, &url(addr)), ok, "{addr}");
        }
        assert!(host_allowed(&[], &url("http://anything:1")));
    }
}
