//! The bound sockets kvengine's publisher needs: a PUB socket (fan-out to subscribers,
//! filtered by their subscriptions, dropped for a subscriber whose queue is full) and a
//! ROUTER socket (each request answered on the connection that sent it).
//!
//! # Invariants
//! 1. What a peer sends is bounded by [`PEER_LIMITS`] (subscriptions and replay requests
//!    are small) and its handshake by the same deadline; a peer that breaks a bound is
//!    counted in [`Refusals`], logged (at most once a second) and disconnected. Nothing a
//!    peer sends stops the accept loop or another peer's task.
//! 2. At most [`MAX_PEERS`] connections per socket; more are closed at once.
//! 3. A subscriber's queue holds at most [`SEND_HWM`] messages and [`SEND_HWM_BYTES`]
//!    bytes; beyond either, messages for it are dropped (ZMQ PUB semantics: the other
//!    subscribers and the publisher never wait for a slow one).
//! 4. A ROUTER peer silent for [`ROUTER_IDLE`] is disconnected.
//!
//! # Concurrency
//! One accept task per socket and one task per peer (in the accept task's `JoinSet`:
//! dropping the socket aborts them all). The PUB socket's peer table is a
//! `std::sync::Mutex` held for a scan and `try_send`s ([`PubSocket::send`]) or one
//! subscription change (the peer's task), never across an `.await`. `queued_bytes` is
//! added by the sender before `try_send` (and taken back if it fails) and subtracted by
//! the peer's task after writing, all `Relaxed`: it is a bound, not a synchronisation.

use super::codec::{Decoded, SocketType};
use super::conn::{Connection, Incoming, Writer, incoming, peer_error, split_endpoint};
use super::{Limits, is_violation};
use crate::error::{Result, TransportError};
use bytes::Bytes;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::AtomicUsize;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::{JoinHandle, JoinSet};

/// Connections one bound socket serves at once (invariant 2).
pub const MAX_PEERS: usize = 1024;
/// Messages queued for one subscriber before more are dropped for it (the zeromq crate's
/// PUB queue held as many).
pub const SEND_HWM: usize = 100_000;
/// Bytes queued for one subscriber before more are dropped for it.
pub const SEND_HWM_BYTES: usize = 256 << 20;
/// Subscriptions one subscriber may hold; one more closes its connection.
pub const MAX_SUBSCRIPTIONS: usize = 1024;
/// Bytes of topic prefixes one subscriber may hold (kept as copies, not as slices of its
/// read buffer); more close its connection.
pub const MAX_SUBSCRIPTION_BYTES: usize = 64 << 10;
/// How long a ROUTER peer may stay silent (invariant 4).
pub const ROUTER_IDLE: Duration = Duration::from_secs(60);
/// What peers may send to a bound socket: subscriptions and replay requests, 64 KiB a
/// message at most; 10 s for the handshake.
pub const PEER_LIMITS: Limits = Limits {
    max_message_bytes: 64 << 10,
    handshake_timeout: Duration::from_secs(10),
};
/// Messages a PUB peer's task writes before it flushes.
const WRITE_BATCH: usize = 64;

/// Peers refused for what they sent (shared by the sockets of one publisher).
#[derive(Debug, Default)]
pub struct Refusals {
    count: AtomicU64,
    last_log: Mutex<Option<Instant>>,
}

impl Refusals {
    /// Peers refused so far.
    pub fn count(&self) -> u64 {
        self.count.load(Relaxed)
    }

    /// Counts and logs (once a second at most) a peer refused for `e`; other errors (the
    /// peer left, a timeout) are only logged at debug level.
    fn note(&self, socket: SocketType, peer: SocketAddr, e: &TransportError) {
        if !is_violation(e) {
            tracing::debug!(%peer, "ZMQ {socket} peer gone: {e}");
            return;
        }
        self.count.fetch_add(1, Relaxed);
        let now = Instant::now();
        let log = {
            let mut last = self.last_log.lock().unwrap_or_else(PoisonError::into_inner);
            let due = last.is_none_or(|t| now.duration_since(t) >= Duration::from_secs(1));
            if due {
                *last = Some(now);
            }
            due
        };
        if log {
            tracing::warn!(%peer, reason = e.reason().as_str(),
                "ZMQ {socket} socket refused a peer and closed its connection: {e}");
        }
    }
}

/// Binds `tcp://HOST:PORT` (`*` for every interface; port 0 for any free one) and gives
/// the bound endpoint (the host as given, the port bound).
async fn bind(endpoint: &str) -> Result<(TcpListener, String)> {
    let (host, port) = split_endpoint(endpoint)?;
    let ip = if host == "*" { "0.0.0.0" } else { host };
    let listener = TcpListener::bind((ip, port))
        .await
        .map_err(|source| TransportError::Io {
            context: format!("cannot bind {endpoint}"),
            source,
        })?;
    let port = listener
        .local_addr()
        .map_err(|source| TransportError::Io {
            context: format!("cannot bind {endpoint}"),
            source,
        })?
        .port();
    let shown = match (ip, host.contains(':')) {
        (_, true) => format!("tcp://[{host}]:{port}"),
        ("0.0.0.0", _) => format!("tcp://0.0.0.0:{port}"),
        _ => format!("tcp://{host}:{port}"),
    };
    Ok((listener, shown))
}

/// Accepts connections on `listener` and runs `serve` for each on its own task, at most
/// [`MAX_PEERS`] at once. Aborting the returned task (the socket dropped) aborts every
/// peer's task with it.
fn spawn_accept<F, Fut>(listener: TcpListener, socket: SocketType, serve: F) -> JoinHandle<()>
where
    F: Fn(TcpStream, SocketAddr) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    tokio::spawn(async move {
        let mut peers = JoinSet::new();
        let mut last_full_log: Option<Instant> = None;
        loop {
            let accepted = listener.accept().await;
            while peers.try_join_next().is_some() {}
            let (stream, peer) = match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of descriptors and the like: do not spin.
                    tracing::warn!("ZMQ {socket} socket: accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            if peers.len() >= MAX_PEERS {
                let now = Instant::now();
                if last_full_log.is_none_or(|t| now.duration_since(t) >= Duration::from_secs(1)) {
                    last_full_log = Some(now);
                    tracing::warn!(%peer, "ZMQ {socket} socket has {MAX_PEERS} peers already: \
                        connection closed");
                }
                drop(stream);
                continue;
            }
            peers.spawn(serve(stream, peer));
        }
    })
}

/// A message queued for subscribers (shared by all of them).
type Queued = Arc<[Bytes]>;

#[derive(Debug)]
struct PubPeer {
    id: u64,
    /// Topic prefixes, as a multiset (a CANCEL removes one).
    subscriptions: Vec<Bytes>,
    /// Their bytes.
    subscription_bytes: usize,
    queue: mpsc::Sender<Queued>,
    queued_bytes: Arc<AtomicUsize>,
}

impl PubPeer {
    fn wants(&self, first: &[u8]) -> bool {
        self.subscriptions.iter().any(|s| first.starts_with(s))
    }
}

#[derive(Debug, Default)]
struct PubShared {
    peers: Mutex<Vec<PubPeer>>,
    next_id: AtomicU64,
}

impl PubShared {
    fn with_peer(&self, id: u64, f: impl FnOnce(&mut PubPeer)) {
        let mut peers = self.peers.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(p) = peers.iter_mut().find(|p| p.id == id) {
            f(p);
        }
    }
}

/// Removes a PUB peer from the table when its task ends, however it ends.
struct Deregister<'a>(&'a PubShared, u64);

impl Drop for Deregister<'_> {
    fn drop(&mut self) {
        let mut peers = self.0.peers.lock().unwrap_or_else(PoisonError::into_inner);
        peers.retain(|p| p.id != self.1);
    }
}

/// A bound PUB socket. Owned by one task; [`PubSocket::send`] never waits.
#[derive(Debug)]
pub struct PubSocket {
    shared: Arc<PubShared>,
    endpoint: String,
    accept: JoinHandle<()>,
}

impl PubSocket {
    /// Binds `endpoint`; peers refused for what they send are counted in `refusals`.
    pub async fn bind(endpoint: &str, refusals: Arc<Refusals>) -> Result<Self> {
        let (listener, endpoint) = bind(endpoint).await?;
        let shared = Arc::new(PubShared::default());
        let s = shared.clone();
        let accept = spawn_accept(listener, SocketType::Pub, move |stream, peer| {
            serve_pub_peer(stream, peer, s.clone(), refusals.clone())
        });
        Ok(Self {
            shared,
            endpoint,
            accept,
        })
    }

    /// The bound endpoint.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Queues `frames` for every subscriber whose subscription prefixes the first frame;
    /// a subscriber whose queue is full misses it (invariant 3).
    pub fn send(&self, frames: Vec<Bytes>) {
        let size: usize = frames.iter().map(Bytes::len).sum();
        let message: Queued = frames.into();
        let first = message.first().map_or(&[][..], |f| f.as_ref());
        let peers = self
            .shared
            .peers
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        for p in peers.iter().filter(|p| p.wants(first)) {
            let before = p.queued_bytes.fetch_add(size, Relaxed);
            if before.saturating_add(size) > SEND_HWM_BYTES
                || p.queue.try_send(message.clone()).is_err()
            {
                p.queued_bytes.fetch_sub(size, Relaxed);
            }
        }
    }
}

impl Drop for PubSocket {
    fn drop(&mut self) {
        self.accept.abort();
        // Closing the queues ends the peers' tasks (and their connections).
        self.shared
            .peers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
    }
}

async fn serve_pub_peer(
    stream: TcpStream,
    peer: SocketAddr,
    shared: Arc<PubShared>,
    refusals: Arc<Refusals>,
) {
    let conn = match Connection::accept(stream, SocketType::Pub, &PEER_LIMITS).await {
        Ok(c) => c,
        Err(e) => return refusals.note(SocketType::Pub, peer, &e),
    };
    let (mut reader, mut writer) = conn.into_split();
    let (tx, mut rx) = mpsc::channel::<Queued>(SEND_HWM);
    let queued_bytes = Arc::new(AtomicUsize::new(0));
    let id = shared.next_id.fetch_add(1, Relaxed);
    shared
        .peers
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .push(PubPeer {
            id,
            subscriptions: Vec::new(),
            subscription_bytes: 0,
            queue: tx,
            queued_bytes: queued_bytes.clone(),
        });
    let _deregister = Deregister(&shared, id);
    let ended: Result<()> = loop {
        tokio::select! {
            queued = rx.recv() => {
                let Some(first) = queued else { break Ok(()) };
                if let Err(e) = write_queued(&mut writer, &mut rx, first, &queued_bytes).await {
                    break Err(e);
                }
            }
            unit = reader.next() => {
                let change = match unit {
                    Ok(Decoded::Message(frames)) => incoming(frames),
                    Ok(Decoded::Command(c)) => match c {
                        super::codec::Command::Subscribe(t) => Incoming::Subscribe(t),
                        super::codec::Command::Cancel(t) => Incoming::Cancel(t),
                        super::codec::Command::Ping { context } => {
                            if let Err(e) = writer.pong(&context).await {
                                break Err(e);
                            }
                            continue;
                        }
                        super::codec::Command::Error(reason) => break Err(peer_error(&reason)),
                        _ => continue,
                    },
                    Ok(Decoded::Greeting(_)) => {
                        break Err(TransportError::MalformedFrame("ZMTP: a second greeting".into()));
                    }
                    Err(e) => break Err(e),
                };
                if let Err(e) = subscribe(&shared, id, change) {
                    break Err(e);
                }
            }
        }
    };
    if let Err(e) = ended {
        refusals.note(SocketType::Pub, peer, &e);
    }
}

/// Applies a subscription change from peer `id` (other messages a SUB sends are ignored,
/// as libzmq does).
fn subscribe(shared: &PubShared, id: u64, change: Incoming) -> Result<()> {
    let mut full = false;
    match change {
        Incoming::Subscribe(topic) => shared.with_peer(id, |p| {
            let bytes = p.subscription_bytes.saturating_add(topic.len());
            full = p.subscriptions.len() >= MAX_SUBSCRIPTIONS || bytes > MAX_SUBSCRIPTION_BYTES;
            if !full {
                // A copy: a slice would keep the peer's read buffer alive.
                p.subscriptions.push(Bytes::copy_from_slice(&topic));
                p.subscription_bytes = bytes;
            }
        }),
        Incoming::Cancel(topic) => shared.with_peer(id, |p| {
            if let Some(i) = p.subscriptions.iter().position(|s| *s == topic) {
                let gone = p.subscriptions.swap_remove(i);
                p.subscription_bytes = p.subscription_bytes.saturating_sub(gone.len());
            }
        }),
        Incoming::Message(_) => {}
    }
    match full {
        true => Err(TransportError::MalformedFrame(format!(
            "ZMTP: more than {MAX_SUBSCRIPTIONS} subscriptions or {MAX_SUBSCRIPTION_BYTES} \
             bytes of them"
        ))),
        false => Ok(()),
    }
}

/// Writes `first` and whatever else is queued (up to [`WRITE_BATCH`]), then flushes.
async fn write_queued(
    writer: &mut Writer,
    rx: &mut mpsc::Receiver<Queued>,
    first: Queued,
    queued_bytes: &AtomicUsize,
) -> Result<()> {
    let mut next = Some(first);
    let mut written = 0;
    while let Some(m) = next.take() {
        writer.write(&m).await?;
        let size: usize = m.iter().map(Bytes::len).sum();
        queued_bytes.fetch_sub(size, Relaxed);
        written += 1;
        if written < WRITE_BATCH {
            next = rx.try_recv().ok();
        }
    }
    writer.flush().await
}

/// Answers one request (its frames, as the peer sent them) with messages to send back.
pub type Handler = Arc<dyn Fn(Vec<Bytes>) -> Vec<Vec<Bytes>> + Send + Sync>;

/// A bound ROUTER socket whose requests are answered by a [`Handler`], on the connection
/// that sent them (so no identity frame is needed: a DEALER or REQ peer sees what a
/// libzmq ROUTER would send it).
pub struct RouterSocket {
    endpoint: String,
    accept: JoinHandle<()>,
}

impl std::fmt::Debug for RouterSocket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RouterSocket")
            .field("endpoint", &self.endpoint)
            .finish_non_exhaustive()
    }
}

impl RouterSocket {
    /// Binds `endpoint`, answering with `handler`; peers refused for what they send are
    /// counted in `refusals`.
    pub async fn bind(endpoint: &str, handler: Handler, refusals: Arc<Refusals>) -> Result<Self> {
        let (listener, endpoint) = bind(endpoint).await?;
        let accept = spawn_accept(listener, SocketType::Router, move |stream, peer| {
            serve_router_peer(stream, peer, handler.clone(), refusals.clone())
        });
        Ok(Self { endpoint, accept })
    }

    /// The bound endpoint.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }
}

impl Drop for RouterSocket {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

async fn serve_router_peer(
    stream: TcpStream,
    peer: SocketAddr,
    handler: Handler,
    refusals: Arc<Refusals>,
) {
    match router_session(stream, &handler).await {
        Err(e) => refusals.note(SocketType::Router, peer, &e),
        Ok(never) => match never {},
    }
}

/// Answers one ROUTER peer's requests until it leaves, goes idle or breaks a bound.
async fn router_session(stream: TcpStream, handler: &Handler) -> Result<Infallible> {
    let mut conn = Connection::accept(stream, SocketType::Router, &PEER_LIMITS).await?;
    loop {
        let request = tokio::time::timeout(ROUTER_IDLE, conn.recv())
            .await
            .map_err(|_| TransportError::Io {
                context: "ZMQ ROUTER".into(),
                source: std::io::Error::new(std::io::ErrorKind::TimedOut, "idle peer"),
            })??;
        let Incoming::Message(frames) = request else {
            continue;
        };
        for reply in handler(frames) {
            conn.write(&reply).await?;
        }
        conn.flush().await?;
    }
}
