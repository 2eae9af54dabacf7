//! Everything the router connects to on its workers: where (their addresses, [`addr`]),
//! how ([`Outbound::client`], the one builder of the HTTP(S) clients that talk to workers,
//! over [`connector::Connector`]), and how much it reads back ([`body`]).
//!
//! Users: the OpenAI proxy and its disaggregated flow (`openai::proxy`, `openai::disagg`),
//! the health checks and metrics scrape (`http::health`), and the TensorRT-LLM event
//! poller (`trtllm::poller`). ZMQ subscriptions dial [`addr::ZmqEndpoint`]s through the
//! `zeromq` crate, not through here.
//!
//! # Invariants
//! 1. **Addresses.** A worker is only ever dialled at an address [`addr`] parsed: a bare
//!    `http[s]://host[:port][/prefix]` or `tcp://host:port`, no userinfo, query, fragment or
//!    escapes, its host checked as parsed (and against `--worker-hosts` by [`check_addr`],
//!    for `POST /v1/workers` and for registrations restored from a snapshot).
//!    [`crate::hub::Hub::register`] refuses any other text, whoever calls it.
//! 2. **One builder.** Every client that talks to workers comes from
//!    [`Outbound::client`]: the same connector, TLS settings and bounds everywhere.
//! 3. **TLS.** `https://` workers are verified against the Mozilla roots compiled in
//!    (webpki-roots), or, with `--worker-ca FILE` (`KVENGINE_WORKER_CA`), against that PEM
//!    bundle only (as `curl --cacert` does). Name and validity are always checked; there is
//!    no switch to skip verification. No client certificate is presented.
//! 4. **Bounds.** Every answer the router keeps is read by [`fetch`] (or
//!    [`body::read_capped`]) under its kind's size cap ([`body::BodyKind::cap`]) and one
//!    deadline for the whole exchange, request, headers and body alike; over either bound
//!    it is refused, counted and logged ([`body::Refusals`]). Answers relayed to clients
//!    stream through unbuffered; what the front door holds back of one to patch its usage is
//!    capped too ([`body::BodyKind::Usage`]), past which the answer is relayed unpatched.
//! 5. **Timeouts.** TCP connect [`connector::CONNECT_TIMEOUT`] (10 s), TLS handshake
//!    [`connector::HANDSHAKE_TIMEOUT`] (10 s more); health check and metrics page: the
//!    health timeout each (`kvengine`: the health interval, at most 2 s); model list 5 s;
//!    TensorRT-LLM event page 5 s; a prefill answer, and a proxied answer's headers, the
//!    proxy's upstream timeout (600 s). Idle pooled connections are dropped after the
//!    `idle` given to [`Outbound::client`] (under the 5 s keep-alive of uvicorn, vLLM's
//!    server, for the proxy).
//!
//! # Concurrency
//! An [`Outbound`] and a [`WorkerClient`] are `Clone + Send + Sync`; clones share one
//! connection pool and may be used from any runtime. A connection is driven by a task on
//! the runtime that opened it, so a connection opened on one core and reused from another
//! wakes the first core for every chunk it carries. The proxy therefore uses
//! [`ThreadClients`]: one pool per thread (per core, in the thread-per-core layout), so a
//! request and its upstream connection stay on one thread.
//!
//! # Why webpki-roots rather than the system's store
//! The router's image is `debian:bookworm-slim`, which has no `ca-certificates`: a
//! native-store loader would find no roots there and fail at run time. webpki-roots is
//! already in the lock file (through ureq), needs no file at start, and gives every build
//! the same roots. Workers are internal: most deployments name their own CA with
//! `--worker-ca`, which replaces the compiled-in roots.

pub mod addr;
pub mod body;
pub mod connector;

use crate::error::{Result, TransportError, WorkerCallError, chain};
use crate::tls::{ALPN_HTTP11, pem_err, provider, tls_err};
use body::{BodyKind, Overrun, ReadError, Refusals};
use bytes::Bytes;
use connector::Connector;
use http_body_util::Full;
use hyper::StatusCode;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use quinn::rustls;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio_rustls::TlsConnector;

pub use addr::{AddrError, Host, WorkerUrl, ZmqEndpoint, host_allowed};

/// An HTTP(S) client for workers, from [`Outbound::client`].
pub type WorkerClient = Client<Connector, Full<Bytes>>;

/// What `https://` workers are verified against.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Trust {
    /// The Mozilla roots compiled in (webpki-roots).
    PublicRoots,
    /// Only the CA certificates of this PEM file (`--worker-ca`).
    Ca(PathBuf),
}

impl fmt::Display for Trust {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::PublicRoots => f.write_str("the public web roots (webpki-roots)"),
            Self::Ca(p) => write!(f, "the CA bundle {}", p.display()),
        }
    }
}

/// How the router reaches its workers: the TLS trust, shared by every client built from
/// it. Cheap to clone.
#[derive(Clone)]
pub struct Outbound {
    trust: Trust,
    /// The TLS client, or why HTTPS is unavailable.
    tls: std::result::Result<TlsConnector, Arc<str>>,
}

impl fmt::Debug for Outbound {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Outbound")
            .field("trust", &self.trust)
            .field("https", &self.tls.is_ok())
            .finish()
    }
}

impl Default for Outbound {
    /// Verifies `https://` workers against the public roots.
    fn default() -> Self {
        let roots = rustls::RootCertStore {
            roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
        };
        Self {
            trust: Trust::PublicRoots,
            tls: tls_connector(roots).map_err(|e| Arc::from(e.to_string())),
        }
    }
}

impl Outbound {
    /// `--worker-ca`: `None` trusts the public roots, `Some(file)` only the PEM CA
    /// certificates in `file`. Errors name the file: unreadable ([`TransportError::Io`]),
    /// or without a usable certificate ([`TransportError::Invalid`]).
    pub fn new(worker_ca: Option<&Path>) -> Result<Self> {
        let Some(path) = worker_ca else {
            return Ok(Self::default());
        };
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_file_iter(path).map_err(|e| pem_err(path, "CA", e))? {
            let cert = cert.map_err(|e| pem_err(path, "CA", e))?;
            roots
                .add(cert)
                .map_err(|e| tls_err(&format!("CA in {}", path.display()), e))?;
        }
        if roots.is_empty() {
            return Err(pem_err(
                path,
                "CA certificate",
                rustls::pki_types::pem::Error::NoItemsFound,
            ));
        }
        Ok(Self {
            trust: Trust::Ca(path.to_owned()),
            tls: Ok(tls_connector(roots)?),
        })
    }

    /// What `https://` workers are verified against.
    pub fn trust(&self) -> &Trust {
        &self.trust
    }

    /// A client for workers (invariant 2), pooling idle connections for `idle`.
    pub fn client(&self, idle: Duration) -> WorkerClient {
        Client::builder(TokioExecutor::new())
            .pool_idle_timeout(idle)
            .build(Connector::new(self.tls.clone()))
    }
}

/// Worker clients, one per thread that asks (invariant 2: each from
/// [`Outbound::client`]), so that a connection is always driven by the thread that uses it
/// (see the module docs). Cheap to clone; clones share the per-thread clients.
#[derive(Clone, Debug)]
pub struct ThreadClients {
    outbound: Outbound,
    idle: Duration,
    /// Identifies this set in each thread's table; its clients are pruned once every clone
    /// is dropped.
    token: Arc<()>,
}

/// Each thread's clients, by the [`ThreadClients`] they belong to.
type ThreadTable = Vec<(std::sync::Weak<()>, WorkerClient)>;

thread_local! {
    static THREAD_CLIENTS: std::cell::RefCell<ThreadTable> =
        const { std::cell::RefCell::new(Vec::new()) };
}

impl ThreadClients {
    /// Clients built by `outbound.client(idle)`, one per thread.
    pub fn new(outbound: Outbound, idle: Duration) -> Self {
        Self {
            outbound,
            idle,
            token: Arc::new(()),
        }
    }

    /// This thread's client (built on first use).
    pub fn get(&self) -> WorkerClient {
        THREAD_CLIENTS.with(|table| {
            let mut table = table.borrow_mut();
            if let Some((_, c)) = table
                .iter()
                .find(|(t, _)| std::ptr::eq(t.as_ptr(), Arc::as_ptr(&self.token)))
            {
                return c.clone();
            }
            // Sets whose every clone is gone leave their clients behind: drop them here.
            table.retain(|(t, _)| t.strong_count() > 0);
            let client = self.outbound.client(self.idle);
            table.push((Arc::downgrade(&self.token), client.clone()));
            client
        })
    }
}

/// The rustls client over `roots`: ring, TLS 1.2 and 1.3, ALPN `http/1.1` (the client is
/// HTTP/1 only).
fn tls_connector(roots: rustls::RootCertStore) -> Result<TlsConnector> {
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| tls_err("TLS versions", e))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = vec![ALPN_HTTP11.to_vec()];
    Ok(TlsConnector::from(Arc::new(cfg)))
}

/// Sends `req` and reads its answer whole within `deadline` (request, headers and body),
/// holding at most `kind`'s cap (invariant 4). Refusals are counted in `refusals`. Any
/// status is returned with its body; the caller judges it.
pub async fn fetch(
    client: &WorkerClient,
    req: hyper::Request<Full<Bytes>>,
    kind: BodyKind,
    deadline: Duration,
    refusals: &Refusals,
) -> std::result::Result<(StatusCode, Bytes), WorkerCallError> {
    let uri = req.uri().clone();
    let exchange = async {
        let resp = client
            .request(req)
            .await
            .map_err(|e| WorkerCallError::Connect(chain(&e)))?;
        let status = resp.status();
        match body::read_capped(resp.into_body(), kind.cap()).await {
            Ok(bytes) => Ok((status, bytes)),
            Err(ReadError::TooLarge) => Err(WorkerCallError::TooLarge {
                kind,
                cap: kind.cap(),
            }),
            Err(ReadError::Broken(why)) => Err(WorkerCallError::Broken(why)),
        }
    };
    let result = match tokio::time::timeout(deadline, exchange).await {
        Ok(r) => r,
        Err(_) => Err(WorkerCallError::TooSlow { kind, deadline }),
    };
    match &result {
        Err(e @ WorkerCallError::TooLarge { .. }) => {
            refusals.refused(kind, Overrun::TooLarge, &format_args!("{uri}: {e}"));
        }
        Err(e @ WorkerCallError::TooSlow { .. }) => {
            refusals.refused(kind, Overrun::TooSlow, &format_args!("{uri}: {e}"));
        }
        _ => {}
    }
    result
}

/// `TransportError::Invalid` for the address field `name`.
pub(crate) fn invalid_addr(name: &'static str, e: &AddrError) -> TransportError {
    TransportError::Invalid {
        name,
        reason: e.to_string(),
    }
}

/// The canonical text of an optional worker URL (invariant 1), for [`crate::hub::Hub`].
pub(crate) fn canonical_url(url: Option<String>) -> Result<Option<String>> {
    url.map(|u| {
        WorkerUrl::parse(&u)
            .map(|u| u.as_str().to_owned())
            .map_err(|e| invalid_addr("url", &e))
    })
    .transpose()
}

/// The canonical text of an optional ZMQ endpoint (`name`: `zmq` or `replay`).
pub(crate) fn canonical_endpoint(
    name: &'static str,
    endpoint: Option<String>,
) -> Result<Option<String>> {
    endpoint
        .map(|e| {
            ZmqEndpoint::parse(&e)
                .map(|e| e.as_str().to_owned())
                .map_err(|err| invalid_addr(name, &err))
        })
        .transpose()
}

/// Why [`check_addr`] refused a worker address; each holds the message that says so.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AddrRefusal {
    /// Not a bare base address.
    Invalid(String),
    /// Its host is not in `--worker-hosts`.
    HostNotAllowed(String),
}

impl fmt::Display for AddrRefusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Invalid(m) | Self::HostNotAllowed(m) => f.write_str(m),
        }
    }
}

/// `field`'s worker address `text`, parsed by `parse` ([`addr`]), its host (`host`) checked
/// against `allowed` (`--worker-hosts`, [`host_allowed`]): the check of invariant 1 that
/// `POST /v1/workers` and restored registrations go through. The router must not be
/// pointed at hosts the operator did not name, even by an authenticated caller's mistake.
pub fn check_addr<T>(
    allowed: &[String],
    field: &str,
    text: &str,
    parse: impl Fn(&str) -> std::result::Result<T, AddrError>,
    host: impl Fn(&T) -> &Host,
) -> std::result::Result<T, AddrRefusal> {
    let addr = parse(text).map_err(|e| AddrRefusal::Invalid(format!("invalid {field}: {e}")))?;
    if !host_allowed(allowed, host(&addr)) {
        return Err(AddrRefusal::HostNotAllowed(format!(
            "{field} {text:?}: its host {} is not in --worker-hosts",
            host(&addr)
        )));
    }
    Ok(addr)
}

/// A registration's address `text` in field `field` (`url`: a [`WorkerUrl`]; `zmq` or
/// `replay`: a [`ZmqEndpoint`]) checked as [`check_addr`] checks it.
pub fn check_field(
    allowed: &[String],
    field: &str,
    text: &str,
) -> std::result::Result<(), AddrRefusal> {
    match field {
        "url" => check_addr(allowed, field, text, WorkerUrl::parse, WorkerUrl::host).map(drop),
        _ => check_addr(allowed, field, text, ZmqEndpoint::parse, ZmqEndpoint::host).map(drop),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::SocketAddr;

    /// A keep-alive HTTP/1.1 server answering every request with an empty 200; returns its
    /// address and how many connections it accepted.
    fn counting_server() -> (SocketAddr, Arc<std::sync::atomic::AtomicUsize>) {
        use std::io::{Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let count = accepted.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut conn) = conn else { return };
                count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                std::thread::spawn(move || {
                    let mut seen = Vec::new();
                    let mut buf = [0u8; 4096];
                    while let Ok(n) = conn.read(&mut buf) {
                        if n == 0 {
                            return;
                        }
                        seen.extend_from_slice(&buf[..n]);
                        while let Some(end) = seen.windows(4).position(|w| w == b"\r\n\r\n") {
                            seen.drain(..end + 4);
                            let answer = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n";
                            if conn.write_all(answer).is_err() {
                                return;
                            }
                        }
                    }
                });
            }
        });
        (addr, accepted)
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    /// Sends `n` GETs one after the other through `clients` on `rt`, of this thread.
    fn get_n(rt: &tokio::runtime::Runtime, clients: &ThreadClients, addr: SocketAddr, n: usize) {
        rt.block_on(async {
            for _ in 0..n {
                let req = hyper::Request::get(format!("http://{addr}/"))
                    .body(Full::new(Bytes::new()))
                    .unwrap();
                // A connection borrowed from another thread is driven by that thread's
                // runtime, idle here: it would never answer.
                let resp =
                    tokio::time::timeout(Duration::from_secs(10), clients.get().request(req))
                        .await
                        .expect("answered by a connection of this thread")
                        .unwrap();
                assert!(resp.status().is_success());
                http_body_util::BodyExt::collect(resp.into_body())
                    .await
                    .unwrap();
            }
        });
    }

    #[test]
    fn each_thread_reuses_its_own_connections_and_never_another_threads() {
        let (addr, accepted) = counting_server();
        let clients = ThreadClients::new(Outbound::default(), Duration::from_secs(30));
        let accepted = move || accepted.load(std::sync::atomic::Ordering::SeqCst);
        // This thread's runtime stays up throughout, its idle connection pooled and alive.
        let rt = runtime();
        get_n(&rt, &clients, addr, 3);
        assert_eq!(
            accepted(),
            1,
            "one thread, three requests in turn: one connection"
        );
        // Another thread does not borrow it (a shared pool would hand it over): it opens
        // its own, then reuses that.
        let other = clients.clone();
        std::thread::spawn(move || get_n(&runtime(), &other, addr, 2))
            .join()
            .unwrap();
        assert_eq!(accepted(), 2);
        // Back on this thread, the first connection is still the one used.
        get_n(&rt, &clients, addr, 2);
        assert_eq!(accepted(), 2);
        // A second set on this thread has a pool of its own.
        let second = ThreadClients::new(Outbound::default(), Duration::from_secs(30));
        get_n(&rt, &second, addr, 1);
        assert_eq!(accepted(), 3);
        // Once every clone of a set is gone, the next new client prunes its entry.
        drop(second);
        let third = ThreadClients::new(Outbound::default(), Duration::from_secs(30));
        third.get();
        let live = THREAD_CLIENTS.with(|t| t.borrow().len());
        assert_eq!(live, 2, "the first set and the third remain");
    }

    #[test]
    fn a_ca_file_must_hold_a_certificate() {
        let dir = std::env::temp_dir().join(format!("kvengine-outbound-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let missing = dir.join("missing.pem");
        assert!(matches!(
            Outbound::new(Some(&missing)),
            Err(TransportError::Io { .. })
        ));
        let empty = dir.join("empty.pem");
        std::fs::write(&empty, "no PEM here\n").unwrap();
        let e = Outbound::new(Some(&empty)).unwrap_err().to_string();
        assert!(e.contains("empty.pem"), "{e}");
        let ck = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
        let ca = dir.join("ca.pem");
        std::fs::write(&ca, ck.cert.pem()).unwrap();
        let o = Outbound::new(Some(&ca)).unwrap();
        assert_eq!(o.trust(), &Trust::Ca(ca.clone()));
        assert_eq!(Outbound::new(None).unwrap().trust(), &Trust::PublicRoots);
        let _ = std::fs::remove_dir_all(dir);
    }

    #[derive(Debug)]
    struct Outer(std::io::Error);

    impl fmt::Display for Outer {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("client error (Connect)")
        }
    }

    impl std::error::Error for Outer {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn error_chains_name_every_cause() {
        let e = Outer(std::io::Error::other(
            "invalid peer certificate: UnknownIssuer",
        ));
        assert_eq!(
            chain(&e),
            "client error (Connect): invalid peer certificate: UnknownIssuer"
        );
    }
}
