//! HTTPS for the HTTP edge: [`server_config`] loads a PEM certificate chain and key into a
//! rustls server configuration, and [`serve_https`] serves the edge's router over TLS the
//! way [`super::serve_http`] serves it over plain TCP.
//!
//! rustls is the one quinn uses (0.23, through `quinn::rustls`), with the *ring* provider
//! only, like the native protocol ([`crate::native::quic_tls`]), whose PEM loading
//! ([`crate::tls`]) this shares. TLS 1.2 and 1.3 are offered (HTTP clients and load
//! balancers still speak 1.2); ALPN is `http/1.1` alone, since the edge's hyper is built
//! with HTTP/1 only.
//!
//! # Invariants
//! 1. Accepting never waits on a peer: each connection's handshake runs in its own task,
//!    bounded by [`HANDSHAKE_TIMEOUT`]. A failed or timed-out handshake closes that
//!    connection, is logged at debug, and is never fatal to the server. The accept loop and
//!    the connection bounds are [`super::conn`]'s, shared with plain HTTP.
//! 2. Every request carries the peer's `ConnectInfo<SocketAddr>`, as over plain HTTP, so
//!    the admin gate (`admin.rs`) sees the real peer address and keeps failing closed.
//! 3. When `shutdown` resolves, accepting stops, handshakes still under way are dropped (no
//!    request has been read on them), and served connections finish the request in flight
//!    (HTTP/1 graceful shutdown) before [`serve_https`] returns.
//! 4. No input reaches a panic: bad files are [`TransportError`]s naming the file.
//!
//! [`TransportError`]: crate::error::TransportError

use crate::error::Result;
use crate::tls::{load_pem_files, provider, tls_err};
use axum::Router;
use quinn::rustls::ServerConfig;
use std::future::Future;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;

/// The ALPN protocol the edge negotiates (HTTP/1.1 only).
pub use crate::tls::ALPN_HTTP11;

/// The TLS settings [`serve_https`] takes (rustls's, with the ring provider), as
/// [`server_config`] builds them.
pub type TlsServerConfig = ServerConfig;

/// How long a client has to complete the TLS handshake before its connection is closed
/// (the connection bounds' default, [`super::conn::DEFAULT_HANDSHAKE_TIMEOUT`]).
pub const HANDSHAKE_TIMEOUT: Duration = super::conn::DEFAULT_HANDSHAKE_TIMEOUT;

/// The rustls server configuration for the PEM certificate chain `cert_pem` (end-entity
/// first) and the PEM private key `key_pem` (PKCS#8, PKCS#1/RSA or SEC1).
///
/// Errors: [`TransportError::Io`] when a file cannot be read, [`TransportError::Invalid`]
/// when it holds no usable PEM item or the key does not fit the certificate; both name the
/// file.
///
/// [`TransportError::Io`]: crate::error::TransportError::Io
/// [`TransportError::Invalid`]: crate::error::TransportError::Invalid
pub fn server_config(cert_pem: &Path, key_pem: &Path) -> Result<Arc<ServerConfig>> {
    let (chain, key) = load_pem_files(cert_pem, key_pem)?;
    let mut cfg = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| tls_err("TLS versions", e))?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(|e| {
            tls_err(
                &format!(
                    "certificate {} with key {}",
                    cert_pem.display(),
                    key_pem.display()
                ),
                e,
            )
        })?;
    cfg.alpn_protocols = vec![ALPN_HTTP11.to_vec()];
    Ok(Arc::new(cfg))
}

/// Serves `router` over TLS (`tls`, e.g. from [`server_config`]) on `listener` (TCP_NODELAY
/// on every connection) with the default connection bounds ([`super::conn`]) until
/// `shutdown` resolves, then finishes the requests in flight. See the module docs for the
/// invariants.
pub async fn serve_https(
    listener: TcpListener,
    router: Router,
    tls: Arc<ServerConfig>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<()> {
    serve(listener, router, tls, HANDSHAKE_TIMEOUT, shutdown).await
}

/// [`serve_https`] with the handshake deadline as a parameter (tests shorten it).
async fn serve(
    listener: TcpListener,
    router: Router,
    tls: Arc<ServerConfig>,
    handshake_timeout: Duration,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<()> {
    let edge = super::conn::Edge {
        router,
        tls: Some(tls),
        limits: super::conn::ConnLimits {
            handshake_timeout,
            ..super::conn::ConnLimits::default()
        },
        counters: Arc::default(),
        placement: None,
    };
    super::conn::serve(listener, edge, shutdown).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::TransportError;
    use axum::extract::ConnectInfo;
    use axum::routing::get;
    use quinn::rustls::pki_types::{CertificateDer, ServerName};
    use quinn::rustls::{ClientConfig, RootCertStore};
    use std::net::SocketAddr;
    use std::path::PathBuf;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;
    use tokio::sync::oneshot;
    use tokio::task::JoinHandle;
    use tokio_rustls::TlsConnector;

    /// A fresh directory per test (tests run in parallel in one process).
    fn temp_dir() -> PathBuf {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "kvengine-https-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// A self-signed certificate for `localhost` written as PEM files.
    struct Cert {
        dir: PathBuf,
        cert: PathBuf,
        key: PathBuf,
        der: CertificateDer<'static>,
    }

    impl Cert {
        fn new() -> Self {
            let ck = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
            let dir = temp_dir();
            let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
            std::fs::write(&cert, ck.cert.pem()).unwrap();
            std::fs::write(&key, ck.signing_key.serialize_pem()).unwrap();
            Self {
                dir,
                cert,
                key,
                der: ck.cert.der().clone(),
            }
        }

        fn connector(&self) -> TlsConnector {
            let mut roots = RootCertStore::empty();
            roots.add(self.der.clone()).unwrap();
            let mut cfg = ClientConfig::builder_with_provider(provider())
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_root_certificates(roots)
                .with_no_client_auth();
            cfg.alpn_protocols = vec![b"h2".to_vec(), ALPN_HTTP11.to_vec()];
            TlsConnector::from(Arc::new(cfg))
        }
    }

    impl Drop for Cert {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    struct Server {
        addr: SocketAddr,
        stop: oneshot::Sender<()>,
        task: JoinHandle<Result<()>>,
    }

    async fn start(router: Router, cert: &Cert, handshake_timeout: Duration) -> Server {
        let tls = server_config(&cert.cert, &cert.key).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(serve(listener, router, tls, handshake_timeout, async {
            let _ = rx.await;
        }));
        Server { addr, stop, task }
    }

    impl Server {
        async fn shutdown(self) {
            self.stop.send(()).unwrap();
            tokio::time::timeout(Duration::from_secs(10), self.task)
                .await
                .expect("shutdown finishes")
                .unwrap()
                .unwrap();
        }
    }

    /// Answers with the peer IP the request carries.
    fn echo_peer() -> Router {
        Router::new().route(
            "/",
            get(|ConnectInfo(peer): ConnectInfo<SocketAddr>| async move { peer.ip().to_string() }),
        )
    }

    type Tls = tokio_rustls::client::TlsStream<TcpStream>;

    async fn connect(cert: &Cert, addr: SocketAddr) -> Tls {
        let tcp = TcpStream::connect(addr).await.unwrap();
        let name = ServerName::try_from("localhost").unwrap();
        let tls = cert.connector().connect(name, tcp).await.unwrap();
        assert_eq!(tls.get_ref().1.alpn_protocol(), Some(ALPN_HTTP11));
        tls
    }

    /// One request, `Connection: close`; the whole response.
    async fn request(cert: &Cert, addr: SocketAddr, head: &str) -> String {
        let mut tls = connect(cert, addr).await;
        tls.write_all(head.as_bytes()).await.unwrap();
        let mut resp = Vec::new();
        tls.read_to_end(&mut resp).await.unwrap();
        String::from_utf8(resp).unwrap()
    }

    const GET_CLOSE: &str = "GET / HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n";

    #[tokio::test]
    async fn serves_https_with_the_peer_address() {
        let cert = Cert::new();
        let server = start(echo_peer(), &cert, HANDSHAKE_TIMEOUT).await;
        let resp = request(&cert, server.addr, GET_CLOSE).await;
        assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
        assert!(resp.ends_with("\r\n\r\n127.0.0.1"), "{resp}");
        server.shutdown().await;
    }

    #[tokio::test]
    async fn plain_http_gets_no_answer_and_the_server_keeps_serving() {
        let cert = Cert::new();
        let server = start(echo_peer(), &cert, HANDSHAKE_TIMEOUT).await;
        let mut tcp = TcpStream::connect(server.addr).await.unwrap();
        tcp.write_all(GET_CLOSE.as_bytes()).await.unwrap();
        let mut resp = Vec::new();
        // The handshake fails at once: at most a TLS alert comes back, then the close.
        tokio::time::timeout(Duration::from_secs(5), tcp.read_to_end(&mut resp))
            .await
            .expect("the server closes the connection")
            .ok();
        assert!(!resp.starts_with(b"HTTP"), "{resp:?}");
        let resp = request(&cert, server.addr, GET_CLOSE).await;
        assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
        server.shutdown().await;
    }

    #[tokio::test]
    async fn a_stalled_handshake_blocks_no_one_and_times_out() {
        let cert = Cert::new();
        let server = start(echo_peer(), &cert, Duration::from_millis(300)).await;
        // Connected, never says a word.
        let mut stalled = TcpStream::connect(server.addr).await.unwrap();
        let resp = request(&cert, server.addr, GET_CLOSE).await;
        assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
        let mut buf = Vec::new();
        let n = tokio::time::timeout(Duration::from_secs(5), stalled.read_to_end(&mut buf))
            .await
            .expect("the stalled connection is closed after the handshake deadline");
        assert!(n.is_err() || buf.is_empty(), "{buf:?}");
        server.shutdown().await;
    }

    #[tokio::test]
    async fn shutdown_closes_idle_connections_and_drops_handshakes() {
        let cert = Cert::new();
        // The default deadline: shutdown must not wait for it.
        let server = start(echo_peer(), &cert, HANDSHAKE_TIMEOUT).await;
        let _stalled = TcpStream::connect(server.addr).await.unwrap();
        // A keep-alive connection that has been served one request and then idles.
        let mut idle = connect(&cert, server.addr).await;
        idle.write_all(b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n")
            .await
            .unwrap();
        let mut buf = [0u8; 1024];
        let n = idle.read(&mut buf).await.unwrap();
        assert!(buf[..n].starts_with(b"HTTP/1.1 200"));
        let addr = server.addr;
        let started = std::time::Instant::now();
        server.shutdown().await;
        assert!(
            started.elapsed() < HANDSHAKE_TIMEOUT / 2,
            "{:?}",
            started.elapsed()
        );
        // The idle connection was closed and nothing listens any more.
        let n = tokio::time::timeout(Duration::from_secs(5), idle.read(&mut buf))
            .await
            .unwrap();
        assert!(matches!(n, Ok(0) | Err(_)), "{n:?}");
        assert!(TcpStream::connect(addr).await.is_err());
    }

    #[tokio::test]
    async fn shutdown_lets_the_request_in_flight_finish() {
        let cert = Arc::new(Cert::new());
        let (entered_tx, entered_rx) = oneshot::channel::<()>();
        let entered_tx = Arc::new(std::sync::Mutex::new(Some(entered_tx)));
        let slow = Router::new().route(
            "/",
            get(move || async move {
                if let Some(tx) = entered_tx.lock().unwrap().take() {
                    let _ = tx.send(());
                }
                tokio::time::sleep(Duration::from_millis(300)).await;
                "done"
            }),
        );
        let server = start(slow, &cert, HANDSHAKE_TIMEOUT).await;
        let addr = server.addr;
        let client = tokio::spawn({
            let cert = cert.clone();
            async move { request(&cert, addr, GET_CLOSE).await }
        });
        entered_rx.await.unwrap();
        server.shutdown().await;
        let resp = client.await.unwrap();
        assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
        assert!(resp.ends_with("done"), "{resp}");
    }

    #[tokio::test]
    async fn the_admin_gate_sees_the_peer_over_tls() {
        use crate::hub::{HubConfig, start_engine};
        use engine::runtime::RuntimeConfig;
        use engine::sched::SchedulerConfig;
        use engine::sharding::choice::Sharding;
        let engine = RuntimeConfig {
            pin_cores: false,
            ingest_handles: 1,
            query_handles: 1,
            ..RuntimeConfig::default()
        };
        let config = HubConfig {
            scheduler: SchedulerConfig::default(),
        };
        let (hub, _runtime) = start_engine(config, Sharding::adaptive(1).unwrap(), engine).unwrap();
        let app = super::super::router(Arc::new(hub), super::super::HttpConfig::default());
        let cert = Cert::new();
        let server = start(app, &cert, HANDSHAKE_TIMEOUT).await;
        // A control call from this host without a token: the gate lets it through (a gate
        // without the peer address would answer 403), and the body is then refused.
        let resp = request(
            &cert,
            server.addr,
            "POST /v1/load HTTP/1.1\r\nHost: localhost\r\nContent-Length: 1\r\n\
             Connection: close\r\n\r\n{",
        )
        .await;
        assert!(resp.starts_with("HTTP/1.1 400"), "{resp}");
        server.shutdown().await;
    }

    #[test]
    fn bad_files_are_errors_naming_the_file() {
        let cert = Cert::new();
        let missing = cert.dir.join("missing.pem");
        let garbage = cert.dir.join("garbage.pem");
        std::fs::write(&garbage, "not a PEM file\n").unwrap();
        let broken = cert.dir.join("broken.pem");
        std::fs::write(
            &broken,
            "-----BEGIN CERTIFICATE-----\n!!not base64!!\n-----END CERTIFICATE-----\n",
        )
        .unwrap();
        let unterminated = cert.dir.join("unterminated.pem");
        std::fs::write(&unterminated, "-----BEGIN PRIVATE KEY-----\nAAAA\n").unwrap();
        let other = Cert::new();

        let err = |c: &Path, k: &Path| server_config(c, k).unwrap_err();
        let e = err(&missing, &cert.key);
        assert!(matches!(e, TransportError::Io { .. }), "{e:?}");
        assert!(e.to_string().contains("missing.pem"), "{e}");
        let e = err(&cert.cert, &missing);
        assert!(matches!(e, TransportError::Io { .. }), "{e:?}");
        assert!(e.to_string().contains("missing.pem"), "{e}");
        for (c, k, file) in [
            (&garbage, &cert.key, "garbage.pem"),
            (&broken, &cert.key, "broken.pem"),
            (&cert.cert, &garbage, "garbage.pem"),
            (&cert.cert, &unterminated, "unterminated.pem"),
            // A certificate is no key.
            (&cert.cert, &cert.cert, "cert.pem"),
            // A key that is not the certificate's.
            (&cert.cert, &other.key, "key.pem"),
        ] {
            let e = err(c, k);
            assert!(matches!(e, TransportError::Invalid { .. }), "{file}: {e:?}");
            assert!(e.to_string().contains(file), "{e}");
        }
        // A directory: unreadable, not a panic.
        let e = err(&cert.dir, &cert.key);
        assert!(matches!(e, TransportError::Io { .. }), "{e:?}");
    }
}
