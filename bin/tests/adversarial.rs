//! The router as a hostile client meets it (issue 29): the real binary with simulated
//! workers, over real sockets, and the process must stay up, keep routing everyone else
//! and stay within its memory bound.
//!
//! * Route flooding from one client (its own loopback address) stops at its reservation
//!   cap with 429 `too_many_reservations`; other clients keep routing through `/v1/route`
//!   and the OpenAI front door; a stranger cannot free the flooder's reservations, nor
//!   guess their ids.
//! * 1,000 slowloris connections (half a request header each) leave `/ready` and routing
//!   working, and are closed at the header deadline.
//! * Past `--max-connections-per-core`, a connection gets a clear 503 and the router
//!   serves again once they close; a body that never finishes gets 408.
//! * Giant inputs: a body past the limit (413), prompts past the token cap on the routing
//!   API and the front door (400), a 3M-token text prompt; the router's peak RSS stays
//!   under [`RSS_BOUND`].
//!
//! Different clients are different loopback addresses (`127.0.0.2`, `127.0.0.3`): Linux
//! routes all of 127/8 to the loopback interface.

mod common;

use common::Router;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

/// The router's peak resident set over a whole test must stay below this (it starts at
/// about 35 MB; a 3M-token prompt used to take it to 560 MB).
const RSS_BOUND: u64 = 250 << 20;

/// A keep-alive HTTP/1.1 client bound to a chosen local address.
struct Client {
    s: TcpStream,
}

impl Client {
    fn from(local: &str, router: &str) -> Client {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .build()
            .unwrap();
        let addr: SocketAddr = router.parse().unwrap();
        let s = rt.block_on(async {
            let sock = tokio::net::TcpSocket::new_v4().unwrap();
            sock.bind(format!("{local}:0").parse().unwrap()).unwrap();
            sock.connect(addr).await.unwrap().into_std().unwrap()
        });
        s.set_nonblocking(false).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        s.set_nodelay(true).unwrap();
        Client { s }
    }

    /// One request on the connection; its status and body (Content-Length framed).
    fn call(&mut self, method: &str, path: &str, body: &str) -> (u16, String) {
        write!(
            self.s,
            "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            assert_eq!(self.s.read(&mut byte).unwrap(), 1, "closed mid-answer");
            head.push(byte[0]);
        }
        let head = String::from_utf8(head).unwrap();
        let status = head[9..12].parse().unwrap();
        let len: usize = head
            .lines()
            .find_map(|l| {
                let (k, v) = l.split_once(':')?;
                k.eq_ignore_ascii_case("content-length")
                    .then(|| v.trim().parse().unwrap())
            })
            .expect("a content-length");
        let mut body = vec![0u8; len];
        self.s.read_exact(&mut body).unwrap();
        (status, String::from_utf8(body).unwrap())
    }
}

/// The router's peak resident set (VmHWM), in bytes.
fn peak_rss(r: &Router) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{}/status", r.child.id())).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap()
        * 1024
}

fn route_body(tokens: usize) -> String {
    let ids: Vec<String> = (0..tokens).map(|t| (t % 30_000).to_string()).collect();
    format!(r#"{{"token_ids": [{}]}}"#, ids.join(","))
}

fn chat_body() -> String {
    serde_json::json!({
        "model": "kvengine-sim",
        "messages": [{"role": "user", "content": "what is a kv cache"}],
        "max_tokens": 2
    })
    .to_string()
}

#[test]
fn a_route_flood_from_one_client_leaves_every_other_client_routed() {
    let r = Router::start(&["--sim-workers", "2", "--sim-speedup", "100"]);
    let mut flooder = Client::from("127.0.0.2", &r.http);
    let body = route_body(64);
    let (mut granted, mut refused) = (Vec::new(), 0);
    for _ in 0..1_500 {
        let (status, text) = flooder.call("POST", "/v1/route", &body);
        match status {
            200 => {
                let v: serde_json::Value = serde_json::from_str(&text).unwrap();
                granted.push(v["request_id"].as_str().unwrap().to_owned());
            }
            429 => {
                assert!(text.contains("too_many_reservations"), "{text}");
                refused += 1;
            }
            s => panic!("{s}: {text}"),
        }
    }
    assert_eq!(
        granted.len(),
        engine::router::reservations::DEFAULT_MAX_RESERVATIONS_PER_CLIENT
    );
    assert_eq!(refused, 1_500 - granted.len());
    assert_eq!(
        r.metric("kvengine_routes_too_many_reservations_total"),
        Some(refused as f64)
    );
    // Ids are 128 random bits, not a counter.
    for id in &granted[..10] {
        let hex = id.strip_prefix("kvr-").unwrap();
        assert_eq!(hex.len(), 32, "{id}");
    }
    assert_ne!(granted[0][..12], granted[1][..12]);

    // Another client routes, and is served through the front door.
    let mut other = Client::from("127.0.0.3", &r.http);
    let (status, text) = other.call("POST", "/v1/route", &body);
    assert_eq!(status, 200, "{text}");
    let (status, text) = r.call("POST", "/v1/chat/completions", &chat_body());
    assert_eq!(status, 200, "{text}");

    // A stranger can neither free nor mark the flooder's reservations.
    let victim = &granted[0];
    let (status, text) = other.call("DELETE", &format!("/v1/requests/{victim}"), "");
    assert_eq!(status, 404, "{text}");
    let (status, _) = other.call("POST", &format!("/v1/requests/{victim}/prefilled"), "");
    assert_eq!(status, 404);
    // Its owner can; freed, it routes again.
    let (status, text) = flooder.call("DELETE", &format!("/v1/requests/{victim}"), "");
    assert_eq!(status, 200, "{text}");
    let (status, text) = flooder.call("POST", "/v1/route", &body);
    assert_eq!(status, 200, "{text}");
    eprintln!("figure: route flood: peak RSS {} MB", peak_rss(&r) >> 20);
    assert!(peak_rss(&r) < RSS_BOUND, "{}", peak_rss(&r));
}

#[test]
fn reservations_expire_at_their_own_lifetime() {
    let r = Router::start(&[
        "--sim-workers",
        "1",
        "--max-reservations-per-client",
        "3",
        "--reservation-timeout-secs",
        "8",
    ]);
    let mut c = Client::from("127.0.0.4", &r.http);
    let body = route_body(32);
    let t0 = Instant::now();
    for _ in 0..3 {
        assert_eq!(c.call("POST", "/v1/route", &body).0, 200);
    }
    let (status, text) = c.call("POST", "/v1/route", &body);
    assert!(t0.elapsed() < Duration::from_secs(8), "too slow to tell");
    assert_eq!(status, 429, "{text}");
    // Never freed, they lapse after 8 s (not the 300 s of --request-timeout-secs).
    loop {
        let (status, text) = c.call("POST", "/v1/route", &body);
        if status == 200 {
            break;
        }
        assert_eq!(status, 429, "{text}");
        assert!(t0.elapsed() < Duration::from_secs(30), "never expired");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(t0.elapsed() >= Duration::from_secs(8), "{:?}", t0.elapsed());
}

/// Raises this test process's soft limit on open files to its hard limit (a machine with a
/// soft limit of 1,024 would otherwise refuse the test's own 1,000 sockets; the router
/// raises its own at start).
fn raise_fd_limit() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit read or write one `rlimit` through a valid pointer to
    // a local.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}

/// Opens `n` connections that each send half a request header and nothing more.
fn slowloris(addr: &str, n: usize) -> Vec<TcpStream> {
    (0..n)
        .map(|_| {
            let mut s = TcpStream::connect(addr).unwrap();
            s.write_all(b"POST /v1/route HTTP/1.1\r\nHost: x\r\nContent-Le")
                .unwrap();
            s
        })
        .collect()
}

#[test]
fn a_thousand_slowloris_connections_neither_stop_the_router_nor_stay() {
    let r = Router::start(&[
        "--sim-workers",
        "2",
        "--sim-speedup",
        "100",
        "--http-header-timeout-secs",
        "3",
    ]);
    raise_fd_limit();
    let began = Instant::now();
    let mut held = slowloris(&r.http, 1_000);
    // While they hang: ready, routing, and the front door all answer.
    let asked = Instant::now();
    let (status, text) = r.call("GET", "/ready", "");
    let ready_in = asked.elapsed();
    assert_eq!(status, 200, "{text}");
    let (status, text) = r.call("POST", "/v1/route", &route_body(64));
    assert_eq!(status, 200, "{text}");
    let (status, text) = r.call("POST", "/v1/chat/completions", &chat_body());
    assert_eq!(status, 200, "{text}");
    // Each is closed at the header deadline: its read ends (EOF or reset), not times out.
    for s in &mut held {
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let mut buf = [0u8; 64];
        match s.read(&mut buf) {
            // EOF, or whatever the router said before it closed.
            Ok(n) => assert!(n <= buf.len()),
            Err(e) => assert!(
                !matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ),
                "still open: {e}"
            ),
        }
    }
    let all_closed = began.elapsed();
    assert!(all_closed < Duration::from_secs(30));
    eprintln!(
        "figure: slowloris 1000: /ready answered in {:.1} ms while held; all closed {:.2} s \
         after the first opened (deadline 3 s); peak RSS {} MB",
        ready_in.as_secs_f64() * 1e3,
        all_closed.as_secs_f64(),
        peak_rss(&r) >> 20
    );
    let (_, metrics) = r.call("GET", "/metrics", "");
    let closed = metrics
        .lines()
        .find_map(|l| {
            l.strip_prefix(r#"kvengine_http_connections_refused_total{reason="header_timeout"} "#)
        })
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(0.0);
    assert!(closed >= 1_000.0, "{closed}");
    assert!(peak_rss(&r) < RSS_BOUND, "{}", peak_rss(&r));
}

#[test]
fn past_the_connection_cap_clients_get_a_clear_503_and_slow_bodies_a_408() {
    let r = Router::start(&[
        "--sim-workers",
        "1",
        "--max-connections-per-core",
        "20",
        "--http-body-timeout-secs",
        "1",
    ]);
    // Two cores share the connections (SO_REUSEPORT), 20 each at most: of 80, at least 40
    // are turned away, each with the 503.
    let mut conns: Vec<TcpStream> = (0..80)
        .map(|_| TcpStream::connect(&r.http).unwrap())
        .collect();
    let mut refused = 0;
    for s in &mut conns {
        s.set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
        let mut text = String::new();
        if s.read_to_string(&mut text).is_ok() && !text.is_empty() {
            assert!(text.starts_with("HTTP/1.1 503"), "{text}");
            assert!(text.contains("too_many_connections"), "{text}");
            refused += 1;
        }
    }
    assert!(refused >= 40, "{refused}");
    drop(conns);
    // Once they are gone, the router serves again.
    let began = Instant::now();
    while r.try_call("GET", "/ready", "").map(|(s, _)| s) != Some(200) {
        assert!(began.elapsed() < Duration::from_secs(20));
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(r.metric_sum("kvengine_http_connections_refused_total") >= 40.0);

    // A body promised and never sent: 408 after the body deadline.
    let mut s = TcpStream::connect(&r.http).unwrap();
    s.write_all(
        b"POST /v1/route HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
          Content-Length: 100\r\n\r\n{\"token_ids\"",
    )
    .unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut text = String::new();
    let _ = s.read_to_string(&mut text);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(text.contains("body_timeout"), "{text}");
}

#[test]
fn giant_inputs_are_refused_and_the_router_stays_small() {
    let r = Router::start(&["--sim-workers", "1", "--sim-speedup", "100"]);
    // A body past the limit is refused from its declared length, before any of it is sent.
    let mut s = TcpStream::connect(&r.http).unwrap();
    s.write_all(
        b"POST /v1/route HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
          Content-Length: 1073741824\r\n\r\n",
    )
    .unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut text = String::new();
    let _ = s.read_to_string(&mut text);
    assert!(text.starts_with("HTTP/1.1 413"), "{text}");

    // Prompts past the default cap (1,048,576 tokens): 2M token ids on the routing API and
    // the front door.
    let ids: Vec<String> = (0..2_000_000).map(|t| (t % 9).to_string()).collect();
    let ids = ids.join(",");
    let (status, text) = r.call("POST", "/v1/route", &format!(r#"{{"token_ids":[{ids}]}}"#));
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("prompt_too_long"), "{text}");
    let (status, text) = r.call(
        "POST",
        "/v1/completions",
        &format!(r#"{{"model":"kvengine-sim","prompt":[{ids}]}}"#),
    );
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("context_length_exceeded"), "{text}");
    // A 3M-token text (the built-in tokenizer: a token a word), tokenized off the cores.
    let text_prompt = "ab ".repeat(3_000_000);
    let body = serde_json::json!({"model": "kvengine-sim", "prompt": text_prompt}).to_string();
    let (status, text) = r.call("POST", "/v1/completions", &body);
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("context_length_exceeded"), "{text}");
    // Still serving, and small.
    let (status, text) = r.call("POST", "/v1/chat/completions", &chat_body());
    assert_eq!(status, 200, "{text}");
    let peak = peak_rss(&r);
    eprintln!("figure: giant inputs: peak RSS {} MB", peak >> 20);
    assert!(peak < RSS_BOUND, "peak RSS {} MB", peak >> 20);
}
