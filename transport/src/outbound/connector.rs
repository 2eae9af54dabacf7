//! The connector every worker client dials with: TCP for `http://`, TCP then TLS (rustls,
//! the *ring* provider, TLS 1.2 and 1.3, ALPN `http/1.1`) for `https://`. Our own over
//! tokio-rustls rather than hyper-rustls: it is one small `Service`, and it keeps the
//! dependency tree to the rustls the workspace already builds.
//!
//! # Invariants
//! 1. A URI whose scheme is neither `http` nor `https` is never dialled.
//! 2. An `https://` connection is used only after the handshake verified the worker's
//!    certificate chain against the trust roots and its name against the URI's host (a DNS
//!    name, or an IP address in the certificate's IP SANs). Nothing, not even the request
//!    line, is sent before.
//! 3. Dialling is bounded: [`CONNECT_TIMEOUT`] for TCP, [`HANDSHAKE_TIMEOUT`] more for TLS.
//! 4. A failure names its cause (the TLS alert or the verifier's complaint), so health
//!    checks can show why a worker is unreachable.

use hyper::Uri;
use hyper::rt::{Read, ReadBufCursor, Write};
use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::rt::TokioIo;
use quinn::rustls::pki_types::ServerName;
use std::fmt;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;

/// The longest a TCP connection to a worker may take to open.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The longest a TLS handshake with a worker may take, after the TCP connection opened.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Dials workers (see the module docs). Cheap to clone.
#[derive(Clone)]
pub struct Connector {
    http: HttpConnector,
    /// The TLS client, or why HTTPS is unavailable (a TLS setup that failed).
    tls: Result<TlsConnector, Arc<str>>,
}

impl fmt::Debug for Connector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Connector")
            .field("https", &self.tls.is_ok())
            .finish_non_exhaustive()
    }
}

impl Connector {
    /// A connector whose HTTPS connections use `tls`.
    pub(crate) fn new(tls: Result<TlsConnector, Arc<str>>) -> Self {
        let mut http = HttpConnector::new();
        // https:// URIs come here too; TLS is layered on below.
        http.enforce_http(false);
        http.set_nodelay(true);
        http.set_connect_timeout(Some(CONNECT_TIMEOUT));
        Self { http, tls }
    }
}

impl tower::Service<Uri> for Connector {
    type Response = Conn;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Conn, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        tower::Service::<Uri>::poll_ready(&mut self.http, cx).map_err(Into::into)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let https = match uri.scheme_str() {
            Some("http") => false,
            Some("https") => true,
            other => {
                let msg = format!("refusing to dial scheme {other:?} (http or https only)");
                return Box::pin(async move { Err(msg.into()) });
            }
        };
        let tls = match (https, &self.tls) {
            (false, _) => None,
            (true, Ok(tls)) => {
                let host = uri.host().unwrap_or_default();
                let bare = host
                    .strip_prefix('[')
                    .and_then(|h| h.strip_suffix(']'))
                    .unwrap_or(host);
                match ServerName::try_from(bare.to_owned()) {
                    Ok(name) => Some((tls.clone(), name)),
                    Err(e) => {
                        let msg = format!("{host:?} is not a TLS server name: {e}");
                        return Box::pin(async move { Err(msg.into()) });
                    }
                }
            }
            (true, Err(why)) => {
                let msg = format!("HTTPS is unavailable: {why}");
                return Box::pin(async move { Err(msg.into()) });
            }
        };
        let dial = tower::Service::<Uri>::call(&mut self.http, uri);
        Box::pin(async move {
            let tcp = dial.await?;
            let Some((tls, name)) = tls else {
                return Ok(Conn::Plain(tcp));
            };
            let host = name.to_str().into_owned();
            let handshake = tls.connect(name, tcp.into_inner());
            match tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake).await {
                Ok(Ok(stream)) => Ok(Conn::Tls(Box::new(TokioIo::new(stream)))),
                Ok(Err(e)) => Err(format!("TLS handshake with {host}: {e}").into()),
                Err(_) => Err(format!(
                    "TLS handshake with {host}: no answer within {HANDSHAKE_TIMEOUT:?}"
                )
                .into()),
            }
        })
    }
}

/// A connection to a worker: plain TCP or TLS over TCP.
#[derive(Debug)]
pub enum Conn {
    /// `http://`.
    Plain(TokioIo<TcpStream>),
    /// `https://`, after a verified handshake (boxed: rustls's state is over 1 KiB).
    Tls(Box<TokioIo<TlsStream<TcpStream>>>),
}

impl Connection for Conn {
    fn connected(&self) -> Connected {
        match self {
            Self::Plain(s) => s.connected(),
            Self::Tls(s) => s.inner().get_ref().0.connected(),
        }
    }
}

impl Read for Conn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: ReadBufCursor<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Self::Tls(s) => Pin::new(&mut **s).poll_read(cx, buf),
        }
    }
}

impl Write for Conn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Self::Tls(s) => Pin::new(&mut **s).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_flush(cx),
            Self::Tls(s) => Pin::new(&mut **s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Self::Tls(s) => Pin::new(&mut **s).poll_shutdown(cx),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Self::Plain(s) => s.is_write_vectored(),
            Self::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Self::Tls(s) => Pin::new(&mut **s).poll_write_vectored(cx, bufs),
        }
    }
}
