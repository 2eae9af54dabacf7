//! The edge filling cores in order (`transport::http::placement`), over real sockets: two
//! single-threaded runtimes with one `SO_REUSEPORT` listener each, as `kvengine` runs its
//! cores, each answering `/who` with the name of the thread that served the connection.

use axum::Router;
use axum::routing::get;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use transport::http::conn::{ConnLimits, Edge, serve_on_core};
use transport::http::placement::Placement;
use transport::metrics::EdgeCounters;

const CONNECTIONS: usize = 24;

struct Cores {
    port: u16,
    counters: Arc<EdgeCounters>,
    placement: Arc<Placement>,
    stop: tokio::sync::watch::Sender<bool>,
    threads: Vec<std::thread::JoinHandle<()>>,
    /// Runs a closure on core 0's thread, as a task that blocks it.
    core0: tokio::runtime::Handle,
}

fn listeners() -> (u16, Vec<std::net::TcpListener>) {
    // Called on the test's runtime, which the listeners leave again (`into_std`).
    let mut addr: std::net::SocketAddr = "127.0.0.1:0".parse().unwrap();
    let mut out = Vec::new();
    for _ in 0..2 {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.set_reuseport(true).unwrap();
        socket.bind(addr).unwrap();
        let listener = socket.listen(1024).unwrap();
        addr = listener.local_addr().unwrap();
        out.push(listener.into_std().unwrap());
    }
    (addr.port(), out)
}

fn start(placement: Arc<Placement>) -> Cores {
    start_with(placement, ConnLimits::default())
}

fn start_with(placement: Arc<Placement>, limits: ConnLimits) -> Cores {
    let (port, listeners) = listeners();
    let counters = Arc::new(EdgeCounters::default());
    let (stop, stop_rx) = tokio::sync::watch::channel(false);
    let router = Router::new().route(
        "/who",
        get(|| async { std::thread::current().name().unwrap_or("?").to_owned() }),
    );
    let (handle_tx, handle_rx) = std::sync::mpsc::channel();
    let threads = listeners
        .into_iter()
        .enumerate()
        .map(|(k, listener)| {
            let edge = Edge {
                router: router.clone(),
                tls: None,
                limits,
                counters: counters.clone(),
                placement: Some(placement.clone()),
            };
            let (p, mut stop, handle_tx) = (placement.clone(), stop_rx.clone(), handle_tx.clone());
            std::thread::Builder::new()
                .name(format!("core-{k}"))
                .spawn(move || {
                    let (parks, wakes) = (p.clone(), p);
                    let rt = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .on_thread_park(move || parks.parked(k))
                        .on_thread_unpark(move || wakes.woke(k))
                        .build()
                        .unwrap();
                    handle_tx.send((k, rt.handle().clone())).unwrap();
                    rt.block_on(async move {
                        let listener = tokio::net::TcpListener::from_std(listener).unwrap();
                        let shutdown = async move {
                            let _ = stop.wait_for(|s| *s).await;
                        };
                        serve_on_core(listener, edge, k, shutdown).await.unwrap();
                    });
                })
                .unwrap()
        })
        .collect();
    let mut core0 = None;
    for _ in 0..2 {
        let (k, h) = handle_rx.recv().unwrap();
        if k == 0 {
            core0 = Some(h);
        }
    }
    Cores {
        port,
        counters,
        placement,
        stop,
        threads,
        core0: core0.unwrap(),
    }
}

impl Cores {
    /// Opens `n` connections one after another, asks each which thread serves it, and
    /// returns the answers with the connections, still open (so none is reused).
    async fn ask(&self, n: usize) -> (Vec<String>, Vec<tokio::net::TcpStream>) {
        let mut open = Vec::new();
        let mut answers = Vec::new();
        for _ in 0..n {
            let mut s = tokio::net::TcpStream::connect(("127.0.0.1", self.port))
                .await
                .unwrap();
            s.write_all(b"GET /who HTTP/1.1\r\nhost: x\r\n\r\n")
                .await
                .unwrap();
            let mut buf = Vec::new();
            let mut chunk = [0u8; 512];
            let body = loop {
                let got = s.read(&mut chunk).await.unwrap();
                assert!(
                    got > 0,
                    "closed before the answer: {:?}",
                    String::from_utf8_lossy(&buf)
                );
                buf.extend_from_slice(&chunk[..got]);
                let text = String::from_utf8_lossy(&buf).into_owned();
                if let Some((head, body)) = text.split_once("\r\n\r\n")
                    && let Some(len) = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length: "))
                        .and_then(|v| v.trim().parse::<usize>().ok())
                    && body.len() >= len
                {
                    break body[..len].to_owned();
                }
            };
            answers.push(body);
            open.push(s);
        }
        (answers, open)
    }

    async fn stop(self) {
        self.stop.send(true).unwrap();
        let threads = self.threads;
        tokio::task::spawn_blocking(move || {
            for t in threads {
                t.join().unwrap();
            }
        })
        .await
        .unwrap();
    }
}

fn on(answers: &[String], core: &str) -> usize {
    answers.iter().filter(|a| a.as_str() == core).count()
}

#[tokio::test]
async fn idle_cores_fill_in_order_every_connection_lands_on_core_0() {
    let cores = start(Placement::with_window(
        2,
        0.5,
        Duration::from_millis(100),
        1_000,
    ));
    let (answers, _open) = cores.ask(CONNECTIONS).await;
    assert_eq!(on(&answers, "core-0"), CONNECTIONS, "{answers:?}");
    // The kernel gave some of them to core 1's listener (all 24 to one listener: 2^-23).
    let handed = cores.counters.handed.load(Relaxed);
    assert!(handed > 0, "none handed");
    assert_eq!(cores.counters.handoff_failures.load(Relaxed), 0);
    assert_eq!(cores.counters.open.load(Relaxed), CONNECTIONS as u64);
    cores.stop().await;
}

#[tokio::test]
async fn a_window_hands_at_most_its_budget_and_the_rest_stay_where_accepted() {
    // One ticket in a window longer than the test: core 1 hands one connection, serves the
    // others itself.
    let cores = start(Placement::with_window(
        2,
        0.5,
        Duration::from_secs(3_600),
        1,
    ));
    let (answers, _open) = cores.ask(CONNECTIONS).await;
    let handed = cores.counters.handed.load(Relaxed);
    assert_eq!(handed, 1, "{answers:?}");
    assert_eq!(on(&answers, "core-0") + on(&answers, "core-1"), CONNECTIONS);
    assert!(
        on(&answers, "core-1") > 0,
        "core 1 got only one connection: {answers:?}"
    );
    cores.stop().await;
}

#[tokio::test]
async fn a_busy_core_is_handed_nothing() {
    let window = Duration::from_millis(20);
    let cores = start(Placement::with_window(2, 0.5, window, 1_000));
    // A task that never lets core 0's runtime park (it yields, so core 0 still serves its
    // own connections): its thread is awake past a window, busy (CoreLoads invariant 2).
    let spin = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let spinning = spin.clone();
    cores.core0.spawn(async move {
        while spinning.load(Relaxed) {
            tokio::task::yield_now().await;
        }
    });
    let since = Instant::now();
    while cores.placement.busy(0) < 1.0 {
        assert!(
            since.elapsed() < Duration::from_secs(10),
            "core 0 never turned busy"
        );
        tokio::task::yield_now().await;
    }
    let (answers, _open) = cores.ask(CONNECTIONS).await;
    spin.store(false, Relaxed);
    assert_eq!(cores.counters.handed.load(Relaxed), 0, "{answers:?}");
    assert!(on(&answers, "core-1") > 0, "{answers:?}");
    assert_eq!(on(&answers, "core-0") + on(&answers, "core-1"), CONNECTIONS);
    cores.stop().await;
}

#[tokio::test]
async fn a_core_at_its_connection_cap_is_handed_nothing() {
    let limits = ConnLimits {
        max_connections: 3,
        ..ConnLimits::default()
    };
    let cores = start_with(
        Placement::with_window(2, 0.5, Duration::from_secs(3_600), 1_000),
        limits,
    );
    let (answers, _open) = cores.ask(CONNECTIONS).await;
    // Core 0 takes core 1's connections until it serves 3; core 1 then serves 3 of its own;
    // the rest are refused (503) by the listener that got them.
    assert_eq!(on(&answers, "core-0"), 3, "{answers:?}");
    assert_eq!(on(&answers, "core-1"), 3, "{answers:?}");
    let refused = answers
        .iter()
        .filter(|a| a.contains("too_many_connections"))
        .count();
    assert_eq!(refused, CONNECTIONS - 6, "{answers:?}");
    assert_eq!(
        cores.counters.refused.load(Relaxed),
        (CONNECTIONS - 6) as u64
    );
    cores.stop().await;
}
