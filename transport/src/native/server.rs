//! The native ingest server: QUIC connections from publishers, one bidirectional stream
//! each, frames validated in place and handed to the [`Hub`].
//!
//! # Invariants
//! 1. Nothing from a connection reaches the hub before its hello is accepted (version,
//!    token, the token's scope covering the hello's worker, block size). The connection
//!    then publishes for that worker only: a batch naming another worker is refused and
//!    counted (`unauthorized` when the token does not cover that worker either,
//!    `unknown_worker` otherwise), never applied.
//! 2. Per publisher instance and dp rank, batches pass an [`EventStream`] (the fencing ZMQ
//!    and HTTP share): a gap clears the rank and marks it resyncing (QUIC has no replay), a
//!    lower number that is not a retry of the last batch (a publisher restart) clears it;
//!    then the batch applies. The streams outlive the connection: a reconnect of the same
//!    instance (the hello's `instance`) goes on with them, so batches lost between two
//!    connections are a gap; a hello with another instance for the worker is a restart,
//!    and the ranks the old instance published are cleared before it is acknowledged.
//!    Instance 0 keeps fences for one connection only.
//! 3. A frame that fails validation is counted and skipped; the length prefix delimits it,
//!    so the stream stays usable. Only a declared length over the limit (the stream can no
//!    longer be trusted to be delimited sensibly) or a broken hello closes the connection.
//! 4. `Done` is sent only after every received batch was handed to the hub.
//! 5. One connection's failure never affects another's (each runs in its own task).
//! 6. An unauthenticated connection is bounded in time, number and memory: it is counted
//!    from its first packet (`Incoming`) until its hello is accepted or it ends; one that has
//!    not had its hello accepted [`QuicServerConfig::hello_timeout`] after its first packet
//!    (TLS handshake, stream, hello frame) is closed with [`CLOSE_HELLO_TIMEOUT`] and counted
//!    (`hello_timeout`); a new connection that arrives while
//!    [`QuicServerConfig::max_unauthenticated`] are counted is refused at once (QUIC
//!    `CONNECTION_REFUSED`, no handshake) and counted (`too_many_unauthenticated`). Until
//!    the hello is accepted, the connection's receive window is
//!    `quic_tls::PRE_HELLO_WINDOW` and frames are bounded by [`MAX_HELLO_BYTES`]; after it,
//!    the window is widened and frames are bounded by `max_frame_bytes`.
//!
//! # Concurrency
//! The accept loop runs on the runtime that called [`serve_quic`]; each connection runs in
//! a task of its own there until its hello is accepted, then on its worker's home core
//! ([`QuicServerConfig::homes`]). The unauthenticated count is the one atomic every task
//! touches (`Shared::unauthenticated`).

use super::auth::{IngestCredentials, WorkerScope};
use super::frame::{
    self, FrameBuf, LEN_BYTES, MAX_FRAME_BYTES, MAX_HELLO_BYTES, access_client_frame,
};
use super::quic_tls::{self, TlsSource};
use super::schema::{ArchivedClientFrame, ArchivedEventBatch, PROTOCOL_VERSION, ServerFrame};
use crate::cores::{Homes, engine_call};
use crate::error::{DropReason, Result, TransportError};
use crate::hub::{Hub, Registration};
use crate::stream::{Action, BatchId, ClearKind, EventStream, clear_keys, skip_duplicate};
use engine::{DpRank, WorkerId, WorkerKey};
use quinn::{Connection, ReadExactError, RecvStream, SendStream, VarInt};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicUsize;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

/// Application error code: normal close (the publisher after `Done`).
pub const CLOSE_DONE: u32 = 0;
/// Application error code: the hello was refused (reason text as in `Refused`).
pub const CLOSE_REFUSED: u32 = 1;
/// Application error code: a frame declared more than the maximum ("frame too large").
pub const CLOSE_FRAME_TOO_LARGE: u32 = 2;
/// Application error code: the stream broke the protocol (ended inside a frame).
pub const CLOSE_PROTOCOL: u32 = 3;
/// Application error code: the server is shutting down.
pub const CLOSE_SHUTDOWN: u32 = 4;
/// Application error code: no hello was accepted within the deadline ("hello timeout").
pub const CLOSE_HELLO_TIMEOUT: u32 = 5;

/// How long a connection has, from its first packet, to have its hello accepted
/// ([`QuicServerConfig::hello_timeout`] by default).
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(5);

/// The longest hello timeout a server accepts.
const MAX_HELLO_TIMEOUT: Duration = Duration::from_secs(3600);

/// Connections that have not been authenticated yet, at most, by default
/// ([`QuicServerConfig::max_unauthenticated`]).
pub const MAX_UNAUTHENTICATED: usize = 128;

/// The start of the `Refused` reason when the token is valid but does not cover the hello's
/// worker (followed by the worker id).
pub const UNAUTHORIZED_WORKER: &str = "unauthorized: the token does not cover worker";

/// How long the server waits for a publisher to close after `Done` or `Refused`.
const LINGER: Duration = Duration::from_secs(3);

/// How the native server is set up.
#[derive(Clone, Debug)]
pub struct QuicServerConfig {
    /// UDP address to listen on (port 0: any).
    pub listen: SocketAddr,
    /// The ingest tokens a hello may present, each with the workers it covers.
    pub credentials: IngestCredentials,
    /// The server certificate.
    pub tls: TlsSource,
    /// Largest frame body accepted ([`MAX_FRAME_BYTES`] by default).
    pub max_frame_bytes: usize,
    /// The cores' runtimes: once a publisher's hello names its worker, its batches are
    /// read, decoded and applied on the worker's home core. `None`: on the runtime that
    /// accepted it.
    pub homes: Option<Homes>,
    /// How long a connection has, from its first packet, to have its hello accepted
    /// ([`HELLO_TIMEOUT`] by default, at most an hour; invariant 6).
    pub hello_timeout: Duration,
    /// Connections not authenticated yet, at most; more are refused at once
    /// ([`MAX_UNAUTHENTICATED`] by default; invariant 6).
    pub max_unauthenticated: usize,
}

impl QuicServerConfig {
    /// A configuration with one ingest token that covers **every** worker (the legacy
    /// single token; set [`QuicServerConfig::credentials`] to bind tokens to workers) and
    /// the default limits. An empty token leaves no credentials: [`serve_quic`] refuses it.
    pub fn new(listen: SocketAddr, token: impl Into<String>, tls: TlsSource) -> Self {
        Self {
            listen,
            credentials: IngestCredentials::any_worker(&token.into()).unwrap_or_default(),
            tls,
            max_frame_bytes: MAX_FRAME_BYTES,
            homes: None,
            hello_timeout: HELLO_TIMEOUT,
            max_unauthenticated: MAX_UNAUTHENTICATED,
        }
    }
}

/// A running native server. Dropping it does not stop it; [`QuicServer::close`] does.
#[derive(Debug)]
pub struct QuicServer {
    endpoint: quinn::Endpoint,
    local_addr: SocketAddr,
    fingerprint: String,
    /// [`Shared::unauthenticated`] (not the whole of it: that holds the hub).
    unauthenticated: Arc<AtomicUsize>,
}

impl QuicServer {
    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Lowercase hex SHA-256 of the server's certificate (what publishers pin).
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    /// Stops accepting and closes every connection (code [`CLOSE_SHUTDOWN`]).
    pub fn close(&self) {
        self.endpoint
            .close(VarInt::from_u32(CLOSE_SHUTDOWN), b"server shutting down");
    }

    /// Waits until every connection has finished closing (after [`QuicServer::close`]).
    pub async fn wait_idle(&self) {
        self.endpoint.wait_idle().await;
    }

    /// Connections counted as not authenticated yet (invariant 6).
    pub fn unauthenticated(&self) -> usize {
        self.unauthenticated.load(Relaxed)
    }
}

/// What every connection task shares.
#[derive(Debug)]
struct Shared {
    hub: Arc<Hub>,
    credentials: IngestCredentials,
    max_frame: usize,
    homes: Option<Homes>,
    hello_timeout: Duration,
    max_unauthenticated: usize,
    /// Connections counted as unauthenticated (invariant 6): incremented only by the accept
    /// loop ([`Unauthenticated::acquire`]), decremented by whichever task drops the
    /// [`Unauthenticated`] slot. `Relaxed`: a count that publishes no other data; the cap is
    /// exact because only one thread adds.
    unauthenticated: Arc<AtomicUsize>,
    /// Per worker: the instance publishing for it and its ranks' fences (invariant 2).
    fences: std::sync::Mutex<HashMap<WorkerId, Arc<std::sync::Mutex<Fences>>>>,
}

/// One publisher instance's fences, per dp rank.
#[derive(Debug, Default)]
struct Fences {
    instance: u64,
    streams: HashMap<u32, EventStream>,
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A connection's place in the unauthenticated count; dropping it frees the place.
#[derive(Debug)]
struct Unauthenticated(Arc<AtomicUsize>);

impl Unauthenticated {
    /// A place for one more unauthenticated connection, or `None` at the cap. Called by
    /// the accept loop only (see [`Shared::unauthenticated`]).
    fn acquire(shared: &Arc<Shared>) -> Option<Unauthenticated> {
        if shared.unauthenticated.load(Relaxed) >= shared.max_unauthenticated {
            return None;
        }
        shared.unauthenticated.fetch_add(1, Relaxed);
        Some(Unauthenticated(shared.unauthenticated.clone()))
    }
}

impl Drop for Unauthenticated {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Relaxed);
    }
}

impl Shared {
    /// The fences a connection of `instance` for `worker` goes on with (invariant 2). A new
    /// instance replaces the old one's, whose ranks are cleared first (a restart).
    fn fences_for(&self, worker: WorkerId, instance: u64) -> Arc<std::sync::Mutex<Fences>> {
        if instance == 0 {
            return Arc::default();
        }
        let (fences, restarted) = {
            let mut all = lock(&self.fences);
            let entry = all.entry(worker).or_insert_with(|| {
                Arc::new(std::sync::Mutex::new(Fences {
                    instance,
                    ..Fences::default()
                }))
            });
            let old = {
                let mut f = lock(entry);
                if f.instance == instance {
                    None
                } else {
                    let ranks: Vec<u32> = f.streams.keys().copied().collect();
                    *f = Fences {
                        instance,
                        ..Fences::default()
                    };
                    Some(ranks)
                }
            };
            (entry.clone(), old)
        };
        if let Some(ranks) = restarted.filter(|r| !r.is_empty()) {
            let keys = ranks.into_iter().map(|r| WorkerKey {
                worker,
                dp_rank: DpRank(r),
            });
            let why = format_args!("worker {worker}: a new publisher instance {instance:#x}");
            // A failed clear is logged by `clear_keys`; the new instance's batches still
            // apply (its first stores start sequences of their own).
            let _ = engine_call(|| clear_keys(&self.hub, keys, ClearKind::Restart, &why));
        }
        fences
    }
}

fn io(
    context: impl Into<String>,
    e: impl Into<Box<dyn std::error::Error + Send + Sync>>,
) -> TransportError {
    TransportError::Io {
        context: context.into(),
        source: std::io::Error::other(e),
    }
}

/// Binds the endpoint and spawns the accept loop on the current tokio runtime.
pub async fn serve_quic(hub: Arc<Hub>, cfg: QuicServerConfig) -> Result<QuicServer> {
    if cfg.max_frame_bytes == 0 || u32::try_from(cfg.max_frame_bytes).is_err() {
        return Err(TransportError::Invalid {
            name: "max_frame_bytes",
            reason: format!("{} is not in 1..=u32::MAX", cfg.max_frame_bytes),
        });
    }
    if cfg.credentials.is_empty() {
        return Err(TransportError::Invalid {
            name: "ingest token",
            reason: "no ingest token: publishers must authenticate".into(),
        });
    }
    if cfg.hello_timeout.is_zero() || cfg.hello_timeout > MAX_HELLO_TIMEOUT {
        return Err(TransportError::Invalid {
            name: "hello_timeout",
            reason: format!(
                "{:?} is not in (0, {MAX_HELLO_TIMEOUT:?}]",
                cfg.hello_timeout
            ),
        });
    }
    if cfg.max_unauthenticated == 0 {
        return Err(TransportError::Invalid {
            name: "max_unauthenticated",
            reason: "must be at least 1 (no publisher could connect)".into(),
        });
    }
    let (chain, key) = quic_tls::load(&cfg.tls)?;
    let fingerprint = chain
        .first()
        .map(|c| quic_tls::fingerprint(c.as_ref()))
        .unwrap_or_default();
    let server_config = quic_tls::server_config(chain, key)?;
    let endpoint =
        quinn::Endpoint::server(server_config, cfg.listen).map_err(|e| TransportError::Io {
            context: format!("binding QUIC on {}", cfg.listen),
            source: e,
        })?;
    let local_addr = endpoint.local_addr().map_err(|e| TransportError::Io {
        context: "QUIC local address".into(),
        source: e,
    })?;
    let shared = Arc::new(Shared {
        hub,
        credentials: cfg.credentials,
        max_frame: cfg.max_frame_bytes,
        homes: cfg.homes,
        hello_timeout: cfg.hello_timeout,
        max_unauthenticated: cfg.max_unauthenticated,
        unauthenticated: Arc::default(),
        fences: std::sync::Mutex::new(HashMap::new()),
    });
    tokio::spawn(accept_loop(endpoint.clone(), shared.clone()));
    tracing::info!(
        %local_addr,
        %fingerprint,
        tokens = shared.credentials.len(),
        "native QUIC ingest listening"
    );
    Ok(QuicServer {
        endpoint,
        local_addr,
        fingerprint,
        unauthenticated: shared.unauthenticated.clone(),
    })
}

async fn accept_loop(endpoint: quinn::Endpoint, shared: Arc<Shared>) {
    while let Some(incoming) = endpoint.accept().await {
        let remote = incoming.remote_address();
        let Some(slot) = Unauthenticated::acquire(&shared) else {
            incoming.refuse();
            refused_at_cap(&shared, remote);
            continue;
        };
        let deadline = tokio::time::Instant::now() + shared.hello_timeout;
        let shared = shared.clone();
        tokio::spawn(async move {
            let conn = match tokio::time::timeout_at(deadline, incoming).await {
                Ok(Ok(conn)) => conn,
                Ok(Err(e)) => {
                    tracing::debug!(%remote, "QUIC handshake failed: {e}");
                    return;
                }
                // Dropping the handshake closes the connection.
                Err(_) => return hello_timed_out(&shared, remote),
            };
            if let Err(e) = serve_connection(&conn, &shared, deadline, slot).await {
                tracing::debug!(%remote, "native connection ended: {e}");
            }
        });
    }
}

#[cold]
fn refused_at_cap(shared: &Shared, remote: SocketAddr) {
    shared.hub.metrics().drop_input(
        DropReason::TooManyUnauthenticated,
        1,
        &format_args!(
            "QUIC connection from {remote} refused: {} connections have not authenticated yet",
            shared.max_unauthenticated
        ),
    );
}

#[cold]
fn hello_timed_out(shared: &Shared, remote: SocketAddr) {
    shared.hub.metrics().drop_input(
        DropReason::HelloTimeout,
        1,
        &format_args!(
            "QUIC connection from {remote} closed: no hello accepted within {:?}",
            shared.hello_timeout
        ),
    );
}

/// Why a frame could not be read.
enum ReadFail {
    /// The declared length is over the limit.
    TooLarge(usize),
    /// The stream finished inside a frame.
    Truncated,
    /// The stream or connection failed.
    Lost(TransportError),
}

/// Reads one frame body into `buf`; `Ok(false)` when the stream finished cleanly at a frame
/// boundary.
async fn read_frame(
    recv: &mut RecvStream,
    buf: &mut FrameBuf,
    max: usize,
) -> std::result::Result<bool, ReadFail> {
    let mut len = [0u8; LEN_BYTES];
    match recv.read_exact(&mut len).await {
        Ok(()) => {}
        Err(ReadExactError::FinishedEarly(0)) => return Ok(false),
        Err(ReadExactError::FinishedEarly(_)) => return Err(ReadFail::Truncated),
        Err(ReadExactError::ReadError(e)) => return Err(ReadFail::Lost(io("reading", e))),
    }
    let n = u32::from_le_bytes(len) as usize;
    if n > max {
        return Err(ReadFail::TooLarge(n));
    }
    buf.clear();
    buf.reserve(n);
    while buf.len() < n {
        match recv.read_chunk(n - buf.len(), true).await {
            Ok(Some(chunk)) => buf.extend_from_slice(&chunk.bytes),
            Ok(None) => return Err(ReadFail::Truncated),
            Err(e) => return Err(ReadFail::Lost(io("reading", e))),
        }
    }
    Ok(true)
}

async fn write_frame(send: &mut SendStream, out: &mut FrameBuf, frame: &ServerFrame) -> Result<()> {
    frame::encode_server_frame(frame, out)?;
    let prefix = frame::length_prefix(out.len(), MAX_FRAME_BYTES)?;
    send.write_all(&prefix)
        .await
        .map_err(|e| io("writing", e))?;
    send.write_all(out).await.map_err(|e| io("writing", e))?;
    Ok(())
}

/// Closes `conn` after a refusal: sends `Refused`, lets the publisher read it, closes.
async fn refuse(
    conn: &Connection,
    send: &mut SendStream,
    out: &mut FrameBuf,
    reason: String,
) -> Result<()> {
    let sent = write_frame(
        send,
        out,
        &ServerFrame::Refused {
            reason: reason.clone(),
        },
    )
    .await;
    let _ = send.finish();
    if sent.is_ok() {
        let _ = tokio::time::timeout(LINGER, conn.closed()).await;
    }
    conn.close(VarInt::from_u32(CLOSE_REFUSED), reason.as_bytes());
    Err(TransportError::Invalid {
        name: "hello",
        reason,
    })
}

fn close_too_large(conn: &Connection, hub: &Hub, n: usize, limit: usize) {
    hub.metrics().drop_input(
        DropReason::Oversized,
        1,
        &format_args!(
            "frame of {n} bytes over the limit of {limit} from {}",
            conn.remote_address()
        ),
    );
    conn.close(VarInt::from_u32(CLOSE_FRAME_TOO_LARGE), b"frame too large");
}

/// The accepted hello.
struct Hello {
    worker: WorkerId,
    /// The workers its token covers (it covers `worker`).
    scope: WorkerScope,
    instance: u64,
}

/// Reads the hello frame: the stream, then one frame of at most `limit` bytes.
async fn read_hello(
    conn: &Connection,
    limit: usize,
) -> Result<(
    SendStream,
    RecvStream,
    FrameBuf,
    std::result::Result<bool, ReadFail>,
)> {
    let (send, mut recv) = conn
        .accept_bi()
        .await
        .map_err(|e| io("accepting a stream", e))?;
    let mut buf = FrameBuf::new();
    let read = read_frame(&mut recv, &mut buf, limit).await;
    Ok((send, recv, buf, read))
}

async fn serve_connection(
    conn: &Connection,
    shared: &Arc<Shared>,
    deadline: tokio::time::Instant,
    slot: Unauthenticated,
) -> Result<()> {
    let hub = &*shared.hub;
    let mut out = FrameBuf::new();

    // ----- hello -----
    let hello_limit = MAX_HELLO_BYTES.min(shared.max_frame);
    let Ok(hello) = tokio::time::timeout_at(deadline, read_hello(conn, hello_limit)).await else {
        hello_timed_out(shared, conn.remote_address());
        conn.close(VarInt::from_u32(CLOSE_HELLO_TIMEOUT), b"hello timeout");
        return Ok(());
    };
    let (mut send, recv, buf, read) = hello?;
    match read {
        Ok(true) => {}
        Ok(false) => return Ok(()),
        Err(ReadFail::TooLarge(n)) => {
            close_too_large(conn, hub, n, hello_limit);
            return Ok(());
        }
        Err(ReadFail::Truncated) => {
            conn.close(
                VarInt::from_u32(CLOSE_PROTOCOL),
                b"stream ended inside a frame",
            );
            return Ok(());
        }
        Err(ReadFail::Lost(e)) => return Err(e),
    }
    let hello = match check_hello(&buf, shared) {
        Ok(h) => h,
        Err((reason, message)) => {
            hub.metrics().drop_input(
                reason,
                1,
                &format_args!("hello from {} refused: {message}", conn.remote_address()),
            );
            return refuse(conn, &mut send, &mut out, message).await;
        }
    };
    // Authenticated: no longer counted, and the window opens for batches (invariant 6).
    drop(slot);
    conn.set_receive_window(VarInt::from_u32(quic_tls::RECEIVE_WINDOW));
    // A restarted publisher's old blocks are cleared before it is acknowledged.
    let fences = shared.fences_for(hello.worker, hello.instance);
    write_frame(
        &mut send,
        &mut out,
        &ServerFrame::HelloAck {
            version: PROTOCOL_VERSION,
            block_size: hub.block_size_of(hello.worker),
        },
    )
    .await?;
    tracing::info!(worker = hello.worker.0, remote = %conn.remote_address(), "native publisher connected");

    // The worker's batches are read, decoded and applied on its home core, so they reach
    // its directory without a hop between cores (the endpoint stays here).
    let batches = serve_batches(
        conn.clone(),
        send,
        recv,
        buf,
        out,
        (hello.worker, hello.scope, fences),
        shared.clone(),
    );
    match shared.homes.as_ref().and_then(|h| h.home(hello.worker)) {
        Some(home) => home
            .spawn(batches)
            .await
            .map_err(|e| io("publisher task", e))?,
        None => batches.await,
    }
}

/// A publisher's batches after its hello, then `Done`.
async fn serve_batches(
    conn: Connection,
    mut send: SendStream,
    mut recv: RecvStream,
    mut buf: FrameBuf,
    mut out: FrameBuf,
    (worker, scope, fences): (WorkerId, WorkerScope, Arc<std::sync::Mutex<Fences>>),
    shared: Arc<Shared>,
) -> Result<()> {
    let conn = &conn;
    let hub = &*shared.hub;
    // ----- batches -----
    let mut state = Stream {
        worker,
        scope,
        fences,
        batches: 0,
        events: 0,
    };
    loop {
        match read_frame(&mut recv, &mut buf, shared.max_frame).await {
            Ok(true) => {}
            Ok(false) => break,
            Err(ReadFail::TooLarge(n)) => {
                close_too_large(conn, hub, n, shared.max_frame);
                return Ok(());
            }
            Err(ReadFail::Truncated) => {
                hub.metrics().drop_input(
                    DropReason::MalformedFrame,
                    1,
                    &format_args!("worker {}: stream ended inside a frame", worker),
                );
                break;
            }
            Err(ReadFail::Lost(e)) => return Err(e),
        }
        match access_client_frame(&buf) {
            Ok(ArchivedClientFrame::Batch(batch)) => state.apply(hub, batch, &buf),
            Ok(ArchivedClientFrame::Hello { .. }) => hub.metrics().drop_input(
                DropReason::MalformedFrame,
                1,
                &format_args!("worker {}: a second hello", worker),
            ),
            Err(e) => hub.metrics().drop_input(
                DropReason::MalformedFrame,
                1,
                &format_args!("worker {}: {e}", worker),
            ),
        }
    }

    // ----- done -----
    write_frame(
        &mut send,
        &mut out,
        &ServerFrame::Done {
            batches: state.batches,
            events: state.events,
        },
    )
    .await?;
    let _ = send.finish();
    let _ = tokio::time::timeout(LINGER, conn.closed()).await;
    Ok(())
}

/// Checks the hello in `buf` and registers its worker; on refusal returns the drop reason
/// and the `Refused` text.
fn check_hello(buf: &[u8], shared: &Shared) -> std::result::Result<Hello, (DropReason, String)> {
    let hub = &*shared.hub;
    let frame = access_client_frame(buf)
        .map_err(|e| (DropReason::MalformedFrame, format!("malformed hello: {e}")))?;
    let ArchivedClientFrame::Hello {
        version,
        worker_id,
        dp_ranks,
        block_size,
        token,
        instance,
    } = frame
    else {
        return Err((
            DropReason::MalformedFrame,
            "malformed hello: the first frame must be a hello".into(),
        ));
    };
    let version = version.to_native();
    if version != PROTOCOL_VERSION {
        return Err((
            DropReason::UnsupportedVersion,
            format!("unsupported version {version}: this server speaks {PROTOCOL_VERSION}"),
        ));
    }
    let Some(scope) = shared.credentials.scope_of(token.as_str()) else {
        return Err((DropReason::Unauthorized, "unauthorized".into()));
    };
    let worker = WorkerId(worker_id.to_native());
    if !scope.covers(worker) {
        return Err((
            DropReason::Unauthorized,
            format!("{UNAUTHORIZED_WORKER} {worker}"),
        ));
    }
    let registration = Registration {
        dp_ranks: dp_ranks.iter().map(|r| DpRank(r.to_native())).collect(),
        ..Registration::new(worker)
    };
    let block_size = block_size.to_native();
    let expected = hub.block_size_of(worker);
    if block_size != expected {
        let message = format!(
            "block size mismatch: the publisher hashes blocks of {block_size} tokens, this \
             router uses {expected} for its model"
        );
        // Registered (out of routing, when new) so `/v1/workers` shows the error.
        let registered = engine_call(|| -> Result<()> {
            if hub.register(registration)? {
                hub.set_healthy(worker, false)?;
            }
            Ok(())
        });
        if registered.is_ok() && hub.registry().note_config_error(worker, message.clone()) {
            tracing::warn!(worker = worker.0, "{message}");
        }
        return Err((DropReason::BlockSizeMismatch, message));
    }
    engine_call(|| hub.register(registration))
        .map_err(|e| (DropReason::Other, format!("registration failed: {e}")))?;
    Ok(Hello {
        worker,
        scope: scope.clone(),
        instance: instance.to_native(),
    })
}

/// One accepted stream's position.
struct Stream {
    worker: WorkerId,
    /// The workers the connection's token covers.
    scope: WorkerScope,
    fences: Arc<std::sync::Mutex<Fences>>,
    batches: u64,
    events: u64,
}

impl Stream {
    fn apply(&mut self, hub: &Hub, batch: &ArchivedEventBatch, bytes: &[u8]) {
        let metrics = hub.metrics();
        let worker = WorkerId(batch.worker_id.to_native());
        if worker != self.worker {
            // One connection, one worker (invariant 1); a batch for a worker the token does
            // not cover either is an attempt to write it.
            let reason = if self.scope.covers(worker) {
                DropReason::UnknownWorker
            } else {
                DropReason::Unauthorized
            };
            metrics.drop_input(
                reason,
                1,
                &format_args!(
                    "batch for worker {worker} on worker {}'s connection",
                    self.worker
                ),
            );
            return;
        }
        let dp_rank = batch.dp_rank.to_native();
        let seq = batch.seq.to_native();
        let key = WorkerKey {
            worker: self.worker,
            dp_rank: DpRank(dp_rank),
        };
        let mut events = Vec::new();
        frame::batch_events(batch, hub.block_size_of(self.worker), &mut events, |e| {
            metrics.drop_input(e.reason(), 1, &format_args!("worker {key}: {e}"))
        });
        let action = lock(&self.fences)
            .streams
            .entry(dp_rank)
            .or_insert_with(|| EventStream::new(false))
            .live(BatchId::of(seq, bytes));
        self.batches += 1;
        let n = events.len() as u64;
        let result = engine_call(|| -> Result<()> {
            match action {
                Action::Apply => {}
                Action::ClearThenApply(kind) => {
                    clear_keys(hub, [key], kind, &format_args!("worker {key}: batch {seq}"))?;
                }
                // QUIC has no replay: a stream made without one never asks for it.
                Action::Replay { from, .. } => {
                    let why = format_args!("worker {key}: batches {from}..{seq}");
                    clear_keys(hub, [key], ClearKind::Resync, &why)?;
                }
                Action::Skip => {
                    skip_duplicate(hub, 1, &format_args!("worker {key}: batch {seq} again"));
                    return Ok(());
                }
            }
            hub.ingest(key, events)
        });
        match result {
            Ok(()) if action != Action::Skip => self.events += n,
            Ok(()) => {}
            Err(e) => metrics.drop_input(e.reason(), n.max(1), &format_args!("worker {key}: {e}")),
        }
    }
}
