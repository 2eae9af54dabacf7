//! The native ingest server: QUIC connections from publishers, one bidirectional stream
//! each, frames validated in place and handed to the [`Hub`].
//!
//! # Invariants
//! 1. Nothing from a connection reaches the hub before its hello is accepted (version,
//!    token, block size).
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

use super::frame::{
    self, FrameBuf, LEN_BYTES, MAX_FRAME_BYTES, MAX_HELLO_BYTES, access_client_frame,
};
use super::schema::{ArchivedClientFrame, ArchivedEventBatch, PROTOCOL_VERSION, ServerFrame};
use super::tls::{self, TlsSource};
use crate::cores::{Homes, engine_call};
use crate::error::{DropReason, Result, TransportError};
use crate::hub::{Hub, Registration};
use crate::stream::{Action, BatchId, ClearKind, EventStream, clear_keys, skip_duplicate};
use engine::{DpRank, WorkerId, WorkerKey};
use quinn::{Connection, ReadExactError, RecvStream, SendStream, VarInt};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
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

/// How long the server waits for a publisher to close after `Done` or `Refused`.
const LINGER: Duration = Duration::from_secs(3);

/// How the native server is set up.
#[derive(Clone, Debug)]
pub struct QuicServerConfig {
    /// UDP address to listen on (port 0: any).
    pub listen: SocketAddr,
    /// The ingest token every hello must present.
    pub token: String,
    /// The server certificate.
    pub tls: TlsSource,
    /// Largest frame body accepted ([`MAX_FRAME_BYTES`] by default).
    pub max_frame_bytes: usize,
    /// The cores' runtimes: once a publisher's hello names its worker, its batches are
    /// read, decoded and applied on the worker's home core. `None`: on the runtime that
    /// accepted it.
    pub homes: Option<Homes>,
}

impl QuicServerConfig {
    /// A configuration with the default frame limit.
    pub fn new(listen: SocketAddr, token: impl Into<String>, tls: TlsSource) -> Self {
        Self {
            listen,
            token: token.into(),
            tls,
            max_frame_bytes: MAX_FRAME_BYTES,
            homes: None,
        }
    }
}

/// A running native server. Dropping it does not stop it; [`QuicServer::close`] does.
#[derive(Debug)]
pub struct QuicServer {
    endpoint: quinn::Endpoint,
    local_addr: SocketAddr,
    fingerprint: String,
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
}

/// What every connection task shares.
#[derive(Debug)]
struct Shared {
    hub: Arc<Hub>,
    token: String,
    max_frame: usize,
    homes: Option<Homes>,
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
    let (chain, key) = tls::load(&cfg.tls)?;
    let fingerprint = chain
        .first()
        .map(|c| tls::fingerprint(c.as_ref()))
        .unwrap_or_default();
    let server_config = tls::server_config(chain, key)?;
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
        token: cfg.token,
        max_frame: cfg.max_frame_bytes,
        homes: cfg.homes,
        fences: std::sync::Mutex::new(HashMap::new()),
    });
    tokio::spawn(accept_loop(endpoint.clone(), shared));
    tracing::info!(%local_addr, %fingerprint, "native QUIC ingest listening");
    Ok(QuicServer {
        endpoint,
        local_addr,
        fingerprint,
    })
}

async fn accept_loop(endpoint: quinn::Endpoint, shared: Arc<Shared>) {
    while let Some(incoming) = endpoint.accept().await {
        let shared = shared.clone();
        tokio::spawn(async move {
            let remote = incoming.remote_address();
            match incoming.await {
                Ok(conn) => {
                    if let Err(e) = serve_connection(&conn, &shared).await {
                        tracing::debug!(%remote, "native connection ended: {e}");
                    }
                }
                Err(e) => tracing::debug!(%remote, "QUIC handshake failed: {e}"),
            }
        });
    }
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
    instance: u64,
}

async fn serve_connection(conn: &Connection, shared: &Arc<Shared>) -> Result<()> {
    let hub = &*shared.hub;
    let (mut send, mut recv) = conn
        .accept_bi()
        .await
        .map_err(|e| io("accepting a stream", e))?;
    let mut buf = FrameBuf::with_capacity(64 << 10);
    let mut out = FrameBuf::new();

    // ----- hello -----
    let hello_limit = MAX_HELLO_BYTES.min(shared.max_frame);
    match read_frame(&mut recv, &mut buf, hello_limit).await {
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
        (hello.worker, fences),
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
    (worker, fences): (WorkerId, Arc<std::sync::Mutex<Fences>>),
    shared: Arc<Shared>,
) -> Result<()> {
    let conn = &conn;
    let hub = &*shared.hub;
    // ----- batches -----
    let mut state = Stream {
        worker,
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
    if !tls::token_eq(token.as_str(), &shared.token) {
        return Err((DropReason::Unauthorized, "unauthorized".into()));
    }
    let worker = WorkerId(worker_id.to_native());
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
        if registered.is_ok() && hub.note_config_error(worker, message.clone()) {
            tracing::warn!(worker = worker.0, "{message}");
        }
        return Err((DropReason::BlockSizeMismatch, message));
    }
    engine_call(|| hub.register(registration))
        .map_err(|e| (DropReason::Other, format!("registration failed: {e}")))?;
    Ok(Hello {
        worker,
        instance: instance.to_native(),
    })
}

/// One accepted stream's position.
struct Stream {
    worker: WorkerId,
    fences: Arc<std::sync::Mutex<Fences>>,
    batches: u64,
    events: u64,
}

impl Stream {
    fn apply(&mut self, hub: &Hub, batch: &ArchivedEventBatch, bytes: &[u8]) {
        let metrics = hub.metrics();
        let worker = batch.worker_id.to_native();
        if worker != self.worker.0 {
            metrics.drop_input(
                DropReason::UnknownWorker,
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
