//! Serving the edge's connections, plain and TLS: one accept loop per listener (one
//! listener per core), and the bounds that keep slow or idle clients from holding the
//! router.
//!
//! * **Connections**: a listener serves at most [`ConnLimits::max_connections`] at once
//!   (`--max-connections-per-core`). One more is refused at once and counted: over plain
//!   HTTP it is answered `503 too_many_connections` (JSON, `Connection: close`), over TLS
//!   it is closed before the handshake.
//! * **Headers**: a request's headers must arrive within [`ConnLimits::header_timeout`]
//!   (`--http-header-timeout-secs`), counted from the moment the connection waits for
//!   them; that includes a keep-alive connection waiting for its next request, so an idle
//!   connection is closed after the same time (hyper's header read timeout).
//! * **Bodies**: the handlers read bodies under [`super::HttpConfig::body_timeout`] (408).
//! * **Responses the client does not read**: a write that stays blocked for
//!   [`ConnLimits::write_timeout`] (the client's receive window full all that time) closes
//!   the connection. A response that is merely slow to produce (a worker prefilling a long
//!   prompt) writes nothing and is never cut.
//! * **TLS handshakes**: [`ConnLimits::handshake_timeout`].
//!
//! Every refusal and closure is counted ([`EdgeCounters`], `/metrics`).
//!
//! On the cores ([`serve_on_core`]), a connection a core accepts may be served by a lower
//! core instead ([`super::placement`]): it is handed over before anything is read from it,
//! and the core it lands on serves it as one of its own accepts (its permits, its bounds,
//! its shutdown).
//!
//! # Invariants
//! 1. Accepting never waits on a peer: each connection (handshake included) runs in its own
//!    task; only the refusal's few bytes are written from the accept loop, without waiting.
//! 2. `open` counts exactly the connections holding a permit; a permit is held from accept
//!    to the connection's end, so a listener never serves more than `max_connections`.
//! 3. Every request carries the peer's `ConnectInfo<SocketAddr>` (the admin gate and the
//!    routing API's reservations read it).
//! 4. When `shutdown` resolves, accepting stops, handshakes under way are dropped (nothing
//!    was read on them), and served connections finish the request in flight (HTTP/1
//!    graceful shutdown) before [`serve`] returns.

use super::placement::{Handed, Placement};
use crate::error::Result;
use crate::metrics::EdgeCounters;
use axum::Router;
use axum::extract::{ConnectInfo, Extension};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use quinn::rustls::ServerConfig;
use std::future::Future;
use std::io;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::sync::{Semaphore, watch};
use tokio_rustls::TlsAcceptor;
use tower::Layer;

/// The default [`ConnLimits::max_connections`] per listener (per core).
pub const DEFAULT_MAX_CONNECTIONS: usize = 8192;
/// The default [`ConnLimits::header_timeout`].
pub const DEFAULT_HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// The default [`ConnLimits::write_timeout`].
pub const DEFAULT_WRITE_TIMEOUT: Duration = Duration::from_secs(30);
/// The default [`ConnLimits::handshake_timeout`]: how long a client has to complete the TLS
/// handshake before its connection is closed.
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The bounds on one listener's connections (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnLimits {
    /// Connections served at once.
    pub max_connections: usize,
    /// Time for a request's headers (and for an idle keep-alive connection's next one).
    pub header_timeout: Duration,
    /// Time a write may stay blocked on a client that does not read.
    pub write_timeout: Duration,
    /// Time for a TLS handshake.
    pub handshake_timeout: Duration,
}

impl Default for ConnLimits {
    fn default() -> Self {
        Self {
            max_connections: DEFAULT_MAX_CONNECTIONS,
            header_timeout: DEFAULT_HEADER_TIMEOUT,
            write_timeout: DEFAULT_WRITE_TIMEOUT,
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
        }
    }
}

/// What one listener serves: the router, TLS or not, its bounds and where it counts.
#[derive(Clone, Debug)]
pub struct Edge {
    /// The routes.
    pub router: Router,
    /// TLS settings; `None`: plain HTTP.
    pub tls: Option<Arc<ServerConfig>>,
    /// The bounds.
    pub limits: ConnLimits,
    /// Where refusals and closures are counted (the hub's `metrics().edge`).
    pub counters: Arc<EdgeCounters>,
    /// Where the cores' listeners place their connections ([`super::placement`]); `None`:
    /// each listener serves what it accepts.
    pub placement: Option<Arc<Placement>>,
}

/// The answer to a connection past the cap (plain HTTP).
const REFUSAL: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\n\
content-type: application/json\r\n\
retry-after: 1\r\n\
connection: close\r\n\
content-length: 187\r\n\r\n\
{\"error\":{\"message\":\"this router serves its most connections at once (--max-connections-per-core); retry shortly\",\"type\":\"service_unavailable\",\"param\":null,\"code\":\"too_many_connections\"}}";

/// Refused connections lingering to deliver their answer, at most.
const MAX_LINGERING: usize = 64;

/// Serves `edge` on `listener` (TCP_NODELAY on every connection) until `shutdown`
/// resolves, then finishes the requests in flight. See the module docs.
pub async fn serve(
    listener: TcpListener,
    edge: Edge,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<()> {
    serve_listener(listener, edge, None, shutdown).await
}

/// [`serve`] as core `core`'s share of the edge: with `edge.placement`, connections this
/// listener accepts may go to a lower core, and those handed to this core are served here.
pub async fn serve_on_core(
    listener: TcpListener,
    edge: Edge,
    core: usize,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<()> {
    serve_listener(listener, edge, Some(core), shutdown).await
}

async fn serve_listener(
    listener: TcpListener,
    edge: Edge,
    core: Option<usize>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<()> {
    let Edge {
        router,
        tls,
        limits,
        counters,
        placement,
    } = edge;
    let seat = placement.zip(core);
    let permits = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let mut inbox = seat.as_ref().and_then(|(p, k)| p.seat(*k, permits.clone()));
    let acceptor = tls.map(TlsAcceptor::from);
    let lingering = Arc::new(Semaphore::new(MAX_LINGERING));
    // Served connections are watched by `graceful`; handshakes are not connections hyper
    // knows yet, so they listen to `stopping` instead and give up when it changes.
    let graceful = GracefulShutdown::new();
    let (stopping_tx, stopping_rx) = watch::channel(());
    let mut shutdown = pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => accepted.map(|(tcp, peer)| (tcp, peer, None)),
            handed = next_handed(&mut inbox) => match TcpStream::from_std(handed.tcp) {
                Ok(tcp) => Ok((tcp, handed.peer, Some(handed.permit))),
                Err(e) => {
                    counters.handoff_failures.fetch_add(1, Relaxed);
                    tracing::warn!("a connection handed to this core from {}: {e}", handed.peer);
                    continue;
                }
            },
        };
        let (tcp, peer, permit) = match accepted {
            Ok((tcp, peer, Some(permit))) => (tcp, peer, Ok(permit)),
            Ok((tcp, peer, None)) => match &seat {
                Some((placement, me)) => match place(placement, *me, tcp, peer, &counters) {
                    Some((tcp, peer)) => (tcp, peer, permits.clone().try_acquire_owned()),
                    None => continue,
                },
                None => (tcp, peer, permits.clone().try_acquire_owned()),
            },
            Err(e) => {
                if !is_per_connection(&e) {
                    // Out of descriptors or the like: retrying at once would spin.
                    tracing::error!("accepting an HTTP connection: {e}");
                    tokio::select! {
                        () = &mut shutdown => break,
                        () = tokio::time::sleep(Duration::from_secs(1)) => {}
                    }
                }
                continue;
            }
        };
        let Ok(permit) = permit else {
            counters.refused.fetch_add(1, Relaxed);
            tracing::debug!("refused a connection from {peer}: at the connection limit");
            refuse(tcp, acceptor.is_none(), &lingering);
            continue;
        };
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!("could not set TCP_NODELAY: {e}");
        }
        counters.open.fetch_add(1, Relaxed);
        let open = Open {
            counters: counters.clone(),
            _permit: permit,
        };
        // The same extension `into_make_service_with_connect_info` adds (invariant 3).
        // Response bodies see their connection's turns (`super::turns`).
        let turns = super::turns::ConnTurns::default();
        let service = TowerToHyperService::new(
            Extension(ConnectInfo(peer)).layer(Extension(turns.clone()).layer(router.clone())),
        );
        // Taken before the handshake, so a shutdown that comes during it still reaches the
        // connection once it is served (it is then closed as soon as it is idle).
        let watcher = graceful.watcher();
        let mut stopping = stopping_rx.clone();
        let acceptor = acceptor.clone();
        tokio::spawn(async move {
            let open = open;
            let blocked = Arc::new(Blocked::default());
            let mut http = hyper::server::conn::http1::Builder::new();
            http.timer(TokioTimer::new())
                .header_read_timeout(limits.header_timeout);
            let served = match acceptor {
                None => {
                    let io = TokioIo::new(Watched::new(tcp, blocked.clone()));
                    let conn = watcher.watch(http.serve_connection(io, service));
                    guard(conn, &blocked, &turns, limits.write_timeout).await
                }
                Some(acceptor) => {
                    let handshake =
                        tokio::time::timeout(limits.handshake_timeout, acceptor.accept(tcp));
                    let stream = tokio::select! {
                        done = handshake => match done {
                            Ok(Ok(stream)) => stream,
                            Ok(Err(e)) => {
                                open.counters.handshake_failures.fetch_add(1, Relaxed);
                                tracing::debug!("TLS handshake with {peer} failed: {e}");
                                return;
                            }
                            Err(_) => {
                                open.counters.handshake_failures.fetch_add(1, Relaxed);
                                tracing::debug!("TLS handshake with {peer} timed out");
                                return;
                            }
                        },
                        // Shutting down (or the server was dropped): nothing was read yet.
                        _ = stopping.changed() => return,
                    };
                    let io = TokioIo::new(Watched::new(stream, blocked.clone()));
                    let conn = watcher.watch(http.serve_connection(io, service));
                    guard(conn, &blocked, &turns, limits.write_timeout).await
                }
            };
            match served {
                Served::Done(Ok(())) => {}
                Served::Done(Err(e)) if e.is_timeout() => {
                    open.counters.header_timeouts.fetch_add(1, Relaxed);
                    tracing::debug!("connection from {peer}: headers not received in time");
                }
                Served::Done(Err(e)) => tracing::debug!("connection from {peer}: {e}"),
                Served::Stalled => {
                    open.counters.write_stalls.fetch_add(1, Relaxed);
                    tracing::debug!("connection from {peer}: closed, it stopped reading");
                }
            }
        });
    }
    // Stop accepting first: new clients are refused rather than left waiting, and so are
    // connections handed to this core and not taken (placement invariant 3).
    drop(listener);
    drop(inbox);
    // `send` errs only when every handshake task is gone already, which is fine.
    let _ = stopping_tx.send(());
    graceful.shutdown().await;
    Ok(())
}

/// The next connection another core handed to this one; pending forever without an inbox.
async fn next_handed(inbox: &mut Option<UnboundedReceiver<Handed>>) -> Handed {
    loop {
        match inbox {
            Some(rx) => match rx.recv().await {
                Some(handed) => return handed,
                // Every sender is gone: the placement was dropped.
                None => *inbox = None,
            },
            None => std::future::pending().await,
        }
    }
}

/// Hands a connection core `me` accepted to the core placement chooses; `Some`: it stays
/// here (no other core, or that core takes no more: placement invariant 3).
fn place(
    placement: &Placement,
    me: usize,
    tcp: TcpStream,
    peer: std::net::SocketAddr,
    counters: &EdgeCounters,
) -> Option<(TcpStream, std::net::SocketAddr)> {
    let Some((to, permit)) = placement.target(me) else {
        return Some((tcp, peer));
    };
    let handed = match tcp.into_std() {
        Ok(tcp) => Handed { tcp, peer, permit },
        Err(e) => {
            counters.handoff_failures.fetch_add(1, Relaxed);
            tracing::warn!("a connection from {peer}: cannot take it off this core: {e}");
            return None;
        }
    };
    match placement.hand(to, handed) {
        Ok(()) => {
            counters.handed.fetch_add(1, Relaxed);
            None
        }
        Err(back) => match TcpStream::from_std(back.tcp) {
            Ok(tcp) => Some((tcp, peer)),
            Err(e) => {
                counters.handoff_failures.fetch_add(1, Relaxed);
                tracing::warn!("a connection from {peer}: cannot serve it back here: {e}");
                None
            }
        },
    }
}

/// A served connection: counted open until dropped, holding its permit.
struct Open {
    counters: Arc<EdgeCounters>,
    _permit: tokio::sync::OwnedSemaphorePermit,
}

impl Drop for Open {
    fn drop(&mut self) {
        self.counters.open.fetch_sub(1, Relaxed);
    }
}

/// Turns a connection past the cap away: plain HTTP gets the 503 (written without waiting:
/// a fresh socket's send buffer takes it whole), then lingers a moment so the client reads
/// it before the close; TLS is just closed.
fn refuse(tcp: TcpStream, plain: bool, lingering: &Arc<Semaphore>) {
    if !plain {
        return;
    }
    let _ = tcp.try_write(REFUSAL);
    // Closing with the client's request unread would reset the connection and could
    // destroy the answer in flight: read (and drop) what comes for a moment first, at most
    // `MAX_LINGERING` at a time.
    let Ok(permit) = lingering.clone().try_acquire_owned() else {
        return;
    };
    tokio::spawn(async move {
        let _permit = permit;
        let mut tcp = tcp;
        let _ = tokio::io::AsyncWriteExt::shutdown(&mut tcp).await;
        let mut sink = [0u8; 4096];
        let drain = async {
            loop {
                match tokio::io::AsyncReadExt::read(&mut tcp, &mut sink).await {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {}
                }
            }
        };
        let _ = tokio::time::timeout(Duration::from_secs(1), drain).await;
    });
}

/// How a connection ended.
enum Served {
    /// hyper finished with it.
    Done(std::result::Result<(), hyper::Error>),
    /// A write stayed blocked past the write timeout.
    Stalled,
}

/// Drives `conn` until it ends or its writes stay blocked for `timeout`, counting its
/// task's polls in `turns`.
async fn guard(
    conn: impl Future<Output = std::result::Result<(), hyper::Error>>,
    blocked: &Blocked,
    turns: &super::turns::ConnTurns,
    timeout: Duration,
) -> Served {
    let mut conn = pin!(conn);
    let mut conn = std::future::poll_fn(move |cx| {
        turns.bump();
        conn.as_mut().poll(cx)
    });
    let tick = (timeout / 4).max(Duration::from_millis(10));
    loop {
        tokio::select! {
            done = &mut conn => return Served::Done(done),
            () = tokio::time::sleep(tick) => {
                if blocked.longer_than(timeout) {
                    return Served::Stalled;
                }
            }
        }
    }
}

/// Since when a connection's writes have been blocked (none: 0).
#[derive(Debug)]
struct Blocked {
    base: Instant,
    /// Microseconds after `base` plus one, or 0 when not blocked.
    since: AtomicU64,
}

impl Default for Blocked {
    fn default() -> Self {
        Self {
            base: Instant::now(),
            since: AtomicU64::new(0),
        }
    }
}

impl Blocked {
    fn now(&self) -> u64 {
        u64::try_from(self.base.elapsed().as_micros())
            .unwrap_or(u64::MAX - 1)
            .saturating_add(1)
    }

    fn note(&self, pending: bool) {
        if pending {
            if self.since.load(Relaxed) == 0 {
                self.since.store(self.now(), Relaxed);
            }
        } else {
            self.since.store(0, Relaxed);
        }
    }

    fn longer_than(&self, limit: Duration) -> bool {
        let since = self.since.load(Relaxed);
        since != 0 && Duration::from_micros(self.now().saturating_sub(since)) >= limit
    }
}

/// An I/O stream whose blocked writes are timed ([`Blocked`]).
struct Watched<T> {
    inner: T,
    blocked: Arc<Blocked>,
}

impl<T> Watched<T> {
    fn new(inner: T, blocked: Arc<Blocked>) -> Self {
        Self { inner, blocked }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Watched<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Watched<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.blocked.note(r.is_pending());
        r
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.blocked.note(r.is_pending());
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let r = Pin::new(&mut self.inner).poll_flush(cx);
        self.blocked.note(r.is_pending());
        r
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Whether an accept error concerns only the connection being accepted (the listener is
/// fine and the next accept may succeed at once).
fn is_per_connection(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_refusal_is_well_formed_http() {
        let text = std::str::from_utf8(REFUSAL).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        let len: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length: "))
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(body.len(), len);
        let json: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(json["error"]["code"], "too_many_connections");
    }

    #[test]
    fn a_write_counts_as_blocked_only_while_it_is_pending() {
        let b = Blocked::default();
        assert!(!b.longer_than(Duration::ZERO));
        b.note(true);
        assert!(b.longer_than(Duration::ZERO));
        assert!(!b.longer_than(Duration::from_secs(3600)));
        b.note(false);
        assert!(!b.longer_than(Duration::ZERO));
    }
}
