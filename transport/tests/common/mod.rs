//! Setup shared by the transport tests: a real engine behind a hub, and an HTTP edge on a
//! free port. Each test crate uses what it needs.
#![allow(dead_code)]

use engine::runtime::{Runtime, RuntimeConfig};
use engine::sched::SchedulerConfig;
use engine::sharding::choice::Sharding;
use std::sync::Arc;
use transport::http::{HttpConfig, router, serve_http};
use transport::hub::{Hub, HubConfig};

/// A hub over an unpinned engine of `cores` shards (blocks shallower than 2 replicated),
/// with two ingest and two query handles.
pub fn hub(cores: usize) -> (Arc<Hub>, Runtime) {
    hub_from(cores, None)
}

/// Like [`hub`], the cores restored from a snapshot's image first (a router restarted on
/// its `--state-dir`).
pub fn hub_from(
    cores: usize,
    image: Option<&engine::snapshot::ArchivedEngineImage>,
) -> (Arc<Hub>, Runtime) {
    let engine = RuntimeConfig {
        pin_cores: false,
        ingest_handles: 2,
        query_handles: 2,
        ..RuntimeConfig::default()
    };
    let config = HubConfig {
        scheduler: SchedulerConfig::default(),
    };
    let (hub, runtime) = transport::hub::start_engine_from(
        config,
        Sharding::adaptive(cores).unwrap(),
        engine,
        image,
    )
    .unwrap();
    (Arc::new(hub), runtime)
}

/// A store of `tokens`' full blocks of `block_size` tokens (no parent), engine hashes
/// `first_hash`, `first_hash + 1`, ...
pub fn stored(tokens: &[u32], block_size: usize, first_hash: u64) -> engine::event::KvEvent {
    use engine::event::{KvEvent, StoredBlock};
    use engine::hash::{lora_seed, tokens_hash};
    KvEvent::Stored {
        parent: None,
        blocks: tokens
            .chunks_exact(block_size)
            .enumerate()
            .map(|(i, c)| StoredBlock {
                engine_hash: engine::EngineHash(first_hash + i as u64),
                tokens_hash: tokens_hash(c, lora_seed(None)),
            })
            .collect(),
    }
}

/// Serves the HTTP edge over `hub` on a free loopback port; returns its base URL and the
/// sender that stops it (dropping the sender stops it too). The engine threads stop when
/// the hub's last holder goes; HTTP tests do not wait for them.
pub async fn http_server(
    hub: Arc<Hub>,
    cfg: HttpConfig,
) -> (String, tokio::sync::oneshot::Sender<()>) {
    let (addr, stop) = serve_app(router(hub, cfg), [127, 0, 0, 1].into()).await;
    (format!("http://{addr}"), stop)
}

/// Serves `app` with `serve_http` on a free port of `bind`; returns the address and the
/// sender that stops it (dropping the sender stops it too).
pub async fn serve_app(
    app: axum::Router,
    bind: std::net::IpAddr,
) -> (std::net::SocketAddr, tokio::sync::oneshot::Sender<()>) {
    let listener = tokio::net::TcpListener::bind((bind, 0)).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        serve_http(listener, app, async {
            let _ = rx.await;
        })
        .await
        .unwrap();
    });
    (addr, tx)
}

/// One HTTP/1.1 request over a fresh connection (`Connection: close`), written by hand so a
/// test controls every header; `extra` holds whole header lines (`"Name: value\r\n"`).
/// Returns the status, the response head lowercased, and the body.
pub async fn raw_request(
    addr: &str,
    method: &str,
    path: &str,
    extra: &str,
    body: &str,
) -> (u16, String, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let addr = addr.trim_start_matches("http://");
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n{extra}\
         Connection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut resp = Vec::new();
    s.read_to_end(&mut resp).await.unwrap();
    let text = String::from_utf8_lossy(&resp).into_owned();
    let status = text[9..12].parse().unwrap();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    (status, head.to_ascii_lowercase(), body.to_owned())
}

/// A tiny msgpack value tree for hand-built KV-event batches, encoded with rmp's encode
/// functions.
#[derive(Clone, Debug)]
pub enum V {
    Nil,
    U(u64),
    /// Always the 9-byte u64 marker (as msgspec writes hashes above i64::MAX).
    U64(u64),
    I(i64),
    /// Always the 9-byte i64 marker.
    I64(i64),
    F(f64),
    S(&'static str),
    B(Vec<u8>),
    A(Vec<V>),
    M(Vec<(V, V)>),
    /// Bytes written as they are.
    Raw(Vec<u8>),
}

/// Appends `v`'s msgpack encoding to `out`.
pub fn enc(v: &V, out: &mut Vec<u8>) {
    use rmp::encode::*;
    match v {
        V::Nil => write_nil(out).unwrap(),
        V::U(u) => {
            write_uint(out, *u).unwrap();
        }
        V::U64(u) => write_u64(out, *u).unwrap(),
        V::I(i) => {
            write_sint(out, *i).unwrap();
        }
        V::I64(i) => write_i64(out, *i).unwrap(),
        V::F(f) => write_f64(out, *f).unwrap(),
        V::S(s) => write_str(out, s).unwrap(),
        V::B(b) => write_bin(out, b).unwrap(),
        V::A(a) => {
            write_array_len(out, a.len() as u32).unwrap();
            a.iter().for_each(|x| enc(x, out));
        }
        V::M(m) => {
            write_map_len(out, m.len() as u32).unwrap();
            for (k, x) in m {
                enc(k, out);
                enc(x, out);
            }
        }
        V::Raw(r) => out.extend_from_slice(r),
    }
}

/// `v`'s msgpack encoding.
pub fn bytes(v: &V) -> Vec<u8> {
    let mut out = Vec::new();
    enc(v, &mut out);
    out
}

/// A QUIC ingest server over a fresh engine, for the native-protocol tests.
pub struct QuicEnv {
    pub hub: Arc<Hub>,
    pub server: transport::native::QuicServer,
    pub runtime: Runtime,
}

/// Starts a QUIC server over `cores` shards that expects `token`.
pub async fn quic_env(cores: usize, token: &str, tls: transport::native::TlsSource) -> QuicEnv {
    quic_env_with(cores, token, tls, |_| {}).await
}

/// Like [`quic_env`], the server's configuration changed by `change` first.
pub async fn quic_env_with(
    cores: usize,
    token: &str,
    tls: transport::native::TlsSource,
    change: impl FnOnce(&mut transport::native::QuicServerConfig),
) -> QuicEnv {
    let (hub, runtime) = hub(cores);
    let mut cfg =
        transport::native::QuicServerConfig::new("127.0.0.1:0".parse().unwrap(), token, tls);
    change(&mut cfg);
    let server = transport::native::serve_quic(hub.clone(), cfg)
        .await
        .unwrap();
    QuicEnv {
        hub,
        server,
        runtime,
    }
}

/// A self-signed certificate for `localhost`.
pub fn self_signed() -> transport::native::TlsSource {
    transport::native::TlsSource::SelfSigned {
        names: vec!["localhost".into()],
    }
}

impl QuicEnv {
    /// Closes the server, waits for its connections and the hub's other holders to go, and
    /// joins the engine.
    pub async fn shutdown(self) {
        use std::time::{Duration, Instant};
        self.server.close();
        let _ = tokio::time::timeout(Duration::from_secs(5), self.server.wait_idle()).await;
        let deadline = Instant::now() + Duration::from_secs(5);
        while Arc::strong_count(&self.hub) > 1 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        if let Ok(hub) = Arc::try_unwrap(self.hub) {
            drop(hub);
            self.runtime.join().unwrap();
        }
    }
}

/// Block size of the wire events below.
pub const WIRE_BS: usize = 16;

/// A vLLM `BlockStored` of `blocks` blocks for prompt `p`: engine hashes `p * 1000 + i`,
/// tokens `p * 100_000 + t`, block size [`WIRE_BS`], on the GPU.
pub fn wire_store(p: u32, blocks: usize) -> transport::kv_events::WireEvent {
    transport::kv_events::WireEvent::Stored {
        block_hashes: (0..blocks as u64)
            .map(|i| u64::from(p) * 1000 + i)
            .collect(),
        parent: None,
        token_ids: (0..(blocks * WIRE_BS) as u32)
            .map(|t| p * 100_000 + t)
            .collect(),
        block_size: Some(WIRE_BS as u32),
        lora_id: None,
        lora_name: None,
        medium: Some("GPU".into()),
        extra_keys: None,
    }
}

/// A batch of `events` from data-parallel rank `dp_rank`.
pub fn wire_batch(
    dp_rank: u32,
    events: Vec<transport::kv_events::WireEvent>,
) -> transport::kv_events::WireBatch {
    transport::kv_events::WireBatch {
        ts: Some(0.0),
        dp_rank: Some(dp_rank),
        events,
        unknown_events: 0,
    }
}
