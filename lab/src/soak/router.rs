//! The router under test as a child process (`kvengine serve ... --state-dir DIR`), so it
//! can be killed with SIGKILL and started again on the same state directory, and the HTTP
//! client the harness talks to it (and nothing else) with.
//!
//! # Invariants
//! 1. A [`RouterProcess`] is ready once its stdout said it serves (`Ctrl-C stops`); its
//!    stdout is drained by a thread for its whole life (a full pipe would stall it), its
//!    stderr (the log) goes to `router-<generation>.log` in the log directory.
//! 2. Dropping a [`RouterProcess`] kills the child and reaps it.
//!
//! # Concurrency
//! [`RouterProcess::spawn`] blocks (it reads the child's stdout): call it from
//! `spawn_blocking`. [`Http`] is cheap to clone and shared by every task.

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How the router is started.
#[derive(Clone, Debug)]
pub struct RouterSpec {
    /// The `kvengine` binary.
    pub exe: PathBuf,
    /// `--state-dir`.
    pub state_dir: PathBuf,
    /// Where each life's log (stderr) goes.
    pub log_dir: PathBuf,
    /// `--cores`.
    pub cores: u16,
    /// `--snapshot-interval-s`.
    pub snapshot_interval_s: u64,
    /// `--health-interval-secs`.
    pub health_interval_s: f64,
    /// `--health-failures`.
    pub health_failures: u32,
    /// `--worker` values.
    pub workers: Vec<String>,
    /// Longest wait for the router to serve.
    pub start_timeout: Duration,
}

/// One life of the router process.
#[derive(Debug)]
pub struct RouterProcess {
    child: Child,
    /// `HOST:PORT` of its HTTP edge.
    pub addr: String,
    /// 0 for the first life, then one more per restart.
    pub generation: u32,
    /// Spawn to serving.
    pub started_in: Duration,
    /// What it printed before serving.
    pub banner: String,
}

impl RouterProcess {
    /// Starts life `generation` and waits until it serves. Blocking.
    pub fn spawn(spec: &RouterSpec, generation: u32) -> Result<Self> {
        let began = Instant::now();
        let log = std::fs::File::create(spec.log_dir.join(format!("router-{generation}.log")))
            .context("creating the router's log file")?;
        let mut cmd = Command::new(&spec.exe);
        cmd.arg("serve")
            .args(["--cores", &spec.cores.to_string(), "--no-pin"])
            .args(["--http-host", "127.0.0.1", "--http-port", "0"])
            .args(["--tokenizer", "stand-in"])
            .args([
                "--snapshot-interval-s",
                &spec.snapshot_interval_s.to_string(),
            ])
            .args([
                "--health-interval-secs",
                &spec.health_interval_s.to_string(),
            ])
            .args(["--health-failures", &spec.health_failures.to_string()])
            .arg("--state-dir")
            .arg(&spec.state_dir);
        for w in &spec.workers {
            cmd.arg("--worker").arg(w);
        }
        let mut child = cmd
            .env_remove("KVENGINE_CONFIG")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log))
            .spawn()
            .with_context(|| format!("starting {}", spec.exe.display()))?;
        let Some(stdout) = child.stdout.take() else {
            bail!("the router's stdout is not piped");
        };
        // Read lines on a thread so a silent child cannot hang us past the timeout.
        let (tx, rx) = std::sync::mpsc::channel::<String>();
        std::thread::Builder::new()
            .name("kvengine-soak-stdout".into())
            .spawn(move || {
                let mut reader = BufReader::new(stdout);
                loop {
                    let mut line = String::new();
                    match reader.read_line(&mut line) {
                        Ok(0) | Err(_) => return,
                        Ok(_) => {
                            if tx.send(line).is_err() {
                                // Nobody listens any more: drain to the end.
                                let mut sink = Vec::new();
                                let _ = reader.read_to_end(&mut sink);
                                return;
                            }
                        }
                    }
                }
            })
            .context("spawning the stdout reader")?;
        let mut banner = String::new();
        let deadline = began + spec.start_timeout;
        let mut proc = RouterProcess {
            child,
            addr: String::new(),
            generation,
            started_in: Duration::ZERO,
            banner: String::new(),
        };
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(line) => {
                    banner.push_str(&line);
                    if line.contains("Ctrl-C stops") {
                        break;
                    }
                }
                Err(_) => bail!(
                    "router life {generation} did not start within {:?}:\n{banner}",
                    spec.start_timeout
                ),
            }
        }
        // Keep draining (the reader thread drains to the end once we drop `rx`).
        drop(rx);
        proc.addr = banner
            .lines()
            .find_map(|l| l.split("HTTP on http://").nth(1))
            .and_then(|rest| rest.split_whitespace().next())
            .context("no HTTP address in the router's banner")?
            .to_owned();
        proc.started_in = began.elapsed();
        proc.banner = banner;
        Ok(proc)
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The line about the snapshot it started from, if any.
    pub fn restore_line(&self) -> Option<&str> {
        self.banner
            .lines()
            .find(|l| l.contains("restored") || l.contains("starting cold"))
    }

    /// SIGKILL, then reap.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for RouterProcess {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// A pooled HTTP/1 client.
#[derive(Clone, Debug)]
pub struct Http {
    client: Client<HttpConnector, Full<Bytes>>,
}

impl Default for Http {
    fn default() -> Self {
        Self::new()
    }
}

impl Http {
    /// A client with keep-alive connections.
    pub fn new() -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(Duration::from_secs(2)));
        Self {
            client: Client::builder(TokioExecutor::new())
                .pool_idle_timeout(Duration::from_secs(20))
                .build(connector),
        }
    }

    /// `method url` with `body` (JSON), within `timeout`: the status and the body.
    pub async fn call(
        &self,
        method: hyper::Method,
        url: &str,
        body: Option<String>,
        timeout: Duration,
    ) -> Result<(u16, Bytes)> {
        let req = hyper::Request::builder()
            .method(method)
            .uri(url)
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .body(Full::new(body.map(Bytes::from).unwrap_or_default()))?;
        let run = async {
            let resp = self.client.request(req).await?;
            let status = resp.status().as_u16();
            let bytes = resp.into_body().collect().await?.to_bytes();
            anyhow::Ok((status, bytes))
        };
        tokio::time::timeout(timeout, run)
            .await
            .map_err(|_| anyhow::anyhow!("{url}: no answer within {timeout:?}"))?
    }
}

/// Prometheus text: the sum of every sample of metric `name` (any labels), if present.
pub fn metric_sum(text: &str, name: &str) -> Option<f64> {
    metric_sum_where(text, name, "")
}

/// [`metric_sum`] over the samples whose label set contains `label` (`cause="stale"`; an
/// empty `label` takes every sample).
pub fn metric_sum_where(text: &str, name: &str, label: &str) -> Option<f64> {
    let mut found = None;
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        if !(rest.starts_with(' ') || rest.starts_with('{')) {
            continue;
        }
        if !label.is_empty() && !rest.split('}').next().is_some_and(|l| l.contains(label)) {
            continue;
        }
        let Some(value) = line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) else {
            continue;
        };
        *found.get_or_insert(0.0) += value;
    }
    found
}

#[cfg(test)]
mod tests {
    use super::metric_sum;

    #[test]
    fn sums_samples_by_exact_name() {
        let page = "# HELP x\nkvengine_index_entries{shard=\"0\"} 3\nkvengine_index_entries{shard=\"1\"} 4\n\
                    kvengine_index_entries_total 9\nprocess_resident_memory_bytes 1.5e6\n";
        assert_eq!(metric_sum(page, "kvengine_index_entries"), Some(7.0));
        assert_eq!(
            metric_sum(page, "process_resident_memory_bytes"),
            Some(1.5e6)
        );
        assert_eq!(metric_sum(page, "missing"), None);
    }
}
