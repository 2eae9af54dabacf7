//! A `kvengine` router process for the end-to-end tests: started on free loopback ports,
//! driven over plain HTTP/1.1, stopped with SIGTERM (or killed with SIGKILL) when done.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running router.
pub struct Router {
    pub child: Child,
    /// What it printed up to "Ctrl-C stops".
    pub out: String,
    /// Its HTTP address.
    pub http: String,
    /// From spawn to serving.
    pub started_in: Duration,
}

/// Where a router's log goes: nowhere, or (debugging a test) appended to
/// `$KVENGINE_TEST_ROUTER_LOGS/router.log`.
fn stderr_sink() -> Stdio {
    let Some(dir) = std::env::var_os("KVENGINE_TEST_ROUTER_LOGS") else {
        return Stdio::null();
    };
    std::fs::create_dir_all(&dir).unwrap();
    let path = std::path::Path::new(&dir).join("router.log");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .unwrap();
    Stdio::from(file)
}

impl Router {
    /// Starts a router with `KVENGINE_TEST_CORES` core threads (default 2; CI also runs
    /// some scenarios with 8, more than the machine's CPUs) and `args`.
    pub fn start(args: &[&str]) -> Router {
        Self::start_with_env(args, &[])
    }

    /// Like [`Router::start`], with `env` set for the process.
    pub fn start_with_env(args: &[&str], env: &[(&str, &str)]) -> Router {
        let cores = std::env::var("KVENGINE_TEST_CORES").unwrap_or_else(|_| "2".into());
        let began = Instant::now();
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvengine"))
            .envs(env.iter().copied())
            .args([
                "--cores",
                &cores,
                "--no-pin",
                "--http-host",
                "127.0.0.1",
                "--http-port",
                "0",
            ])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(stderr_sink())
            .spawn()
            .unwrap();
        let mut reader = BufReader::new(child.stdout.take().unwrap());
        let mut out = String::new();
        loop {
            let mut line = String::new();
            assert!(
                reader.read_line(&mut line).unwrap() > 0,
                "exited early: {out}"
            );
            out.push_str(&line);
            if line.contains("Ctrl-C stops") {
                break;
            }
        }
        let started_in = began.elapsed();
        // Keep draining stdout so the router never blocks on a full pipe.
        std::thread::spawn(move || {
            let mut sink = String::new();
            let _ = reader.read_to_string(&mut sink);
        });
        let http = out
            .lines()
            .find_map(|l| l.split("HTTP on http://").nth(1))
            .and_then(|rest| rest.split_whitespace().next())
            .unwrap()
            .to_owned();
        Router {
            child,
            out,
            http,
            started_in,
        }
    }

    /// One HTTP/1.1 request; `None` if the router could not be reached or answered
    /// nonsense.
    pub fn try_call(&self, method: &str, path: &str, body: &str) -> Option<(u16, String)> {
        try_call(&self.http, method, path, body)
    }

    /// One HTTP/1.1 request; returns (status, body).
    pub fn call(&self, method: &str, path: &str, body: &str) -> (u16, String) {
        self.try_call(method, path, body)
            .unwrap_or_else(|| panic!("{method} {path}: no answer"))
    }

    /// The value of the unlabelled series `name` on `/metrics`.
    pub fn metric(&self, name: &str) -> Option<f64> {
        let (_, text) = self.try_call("GET", "/metrics", "")?;
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
    }

    /// The sum of every series of `name` on `/metrics`, whatever its labels.
    pub fn metric_sum(&self, name: &str) -> f64 {
        let (_, text) = self.call("GET", "/metrics", "");
        text.lines()
            .filter(|l| {
                l.strip_prefix(name)
                    .is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{'))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    /// Kills the process with SIGKILL (a crash: nothing is flushed).
    pub fn kill9(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One HTTP/1.1 request to `addr` (`host:port`); `None` if it could not be reached or
/// answered nonsense.
pub fn try_call(addr: &str, method: &str, path: &str, body: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(30))).ok()?;
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .ok()?;
    let mut resp = String::new();
    s.read_to_string(&mut resp).ok()?;
    let status = resp.get(9..12)?.parse().ok()?;
    let (head, body) = resp.split_once("\r\n\r\n").unwrap_or((&resp, ""));
    if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        return Some((status, dechunk(body)));
    }
    Some((status, body.to_owned()))
}

/// The payload of a chunked HTTP/1.1 body.
fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        body = rest.get(n + 2..).unwrap_or("");
    }
    out
}

impl Drop for Router {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(Some(_))) {
            return;
        }
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let _ = self.child.wait();
    }
}

/// One HTTP/1.1 `POST` of a JSON `body` to `addr`, with `headers` (whole lines, each ending
/// in CRLF), waiting at most `timeout` for the answer: its status and lowercased head.
pub fn post_head(
    addr: &str,
    path: &str,
    headers: &str,
    body: &str,
    timeout: Duration,
) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(timeout)).unwrap();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n{headers}\
         Connection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    let status = resp[9..12].parse().unwrap();
    let head = resp.split_once("\r\n\r\n").map_or(&*resp, |(h, _)| h);
    (status, head.to_ascii_lowercase())
}

/// Waits up to `secs` for `check`; panics with `what` and the last state otherwise.
pub fn eventually(secs: u64, what: &str, mut check: impl FnMut() -> Result<(), String>) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        match check() {
            Ok(()) => return,
            Err(e) if Instant::now() > deadline => panic!("{what}: {e}"),
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

/// A `kvengine sim` process, its workers' URLs and their `--zmq-worker` flags.
pub struct Sims {
    child: Child,
    pub urls: Vec<String>,
    pub flags: Vec<String>,
}

impl Sims {
    /// `workers` simulated workers at 1000x real time.
    pub fn start(workers: usize) -> Sims {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvengine"))
            .args(["sim", "--workers", &workers.to_string(), "--port", "0"])
            .args(["--speedup", "1000"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut text = String::new();
        while !text.contains("Ctrl-C stops") {
            let mut line = String::new();
            assert!(out.read_line(&mut line).unwrap() > 0, "sim exited: {text}");
            text.push_str(&line);
        }
        std::thread::spawn(move || {
            let mut sink = String::new();
            let _ = out.read_to_string(&mut sink);
        });
        // "worker 0: http://H:P  --zmq-worker 0=tcp://H:P,replay=tcp://H:P"
        let lines: Vec<&str> = text
            .lines()
            .filter(|l| l.contains("--zmq-worker "))
            .collect();
        let flags = lines
            .iter()
            .filter_map(|l| l.split("--zmq-worker ").nth(1))
            .map(|f| f.trim().to_owned())
            .collect();
        let urls = lines
            .iter()
            .filter_map(|l| l.split_whitespace().find(|w| w.starts_with("http://")))
            .map(str::to_owned)
            .collect();
        Sims { child, urls, flags }
    }

    /// Each worker as a `--worker` value: `id=ID,url=URL,zmq=...,replay=...`.
    pub fn worker_specs(&self) -> Vec<String> {
        self.urls
            .iter()
            .zip(&self.flags)
            .filter_map(|(url, flag)| {
                let (id, zmq) = flag.split_once('=')?;
                Some(format!("id={id},url={url},zmq={zmq}"))
            })
            .collect()
    }

    /// Has worker `w` serve a prompt (so it caches the prompt's blocks and says so).
    pub fn serve(&self, w: usize, tokens: &[u32]) {
        let addr = self.urls[w].strip_prefix("http://").unwrap();
        let ids: Vec<String> = tokens.iter().map(u32::to_string).collect();
        let body = format!(r#"{{"prompt": [{}], "max_tokens": 2}}"#, ids.join(","));
        let (status, answer) = try_call(addr, "POST", "/v1/completions", &body).unwrap();
        assert_eq!(status, 200, "{answer}");
    }
}

impl Drop for Sims {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
