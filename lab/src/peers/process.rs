//! A router under test as a child process: started with its output in a log file, waited
//! for until it routes, its CPU time read from `/proc`, and stopped.
//!
//! # Invariants
//! 1. A [`RouterChild`] owns its process: [`RouterChild::stop`] (or dropping it) kills and
//!    reaps it, so no router outlives its run.
//! 2. [`RouterChild::wait_ready`] returns only once the router answered its readiness path
//!    with 200 *and* routed one probe completion to a worker; it fails early with the log's
//!    end if the process exits.

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How often readiness is asked for while a router starts.
const READY_POLL: Duration = Duration::from_millis(100);

/// A running router.
#[derive(Debug)]
pub struct RouterChild {
    child: Option<Child>,
    log: PathBuf,
    port: u16,
}

impl RouterChild {
    /// Starts `exe args`, its stdout and stderr appended to `log`.
    pub fn spawn(exe: &Path, args: &[String], log: &Path, port: u16) -> Result<Self> {
        let out = std::fs::File::create(log)
            .with_context(|| format!("cannot create {}", log.display()))?;
        let err = out.try_clone().context("cannot share the log file")?;
        let child = Command::new(exe)
            .args(args)
            .env("RUST_LOG", "warn")
            .env("KVENGINE_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::from(out))
            .stderr(Stdio::from(err))
            .spawn()
            .with_context(|| format!("cannot start {}", exe.display()))?;
        Ok(Self {
            child: Some(child),
            log: log.to_owned(),
            port,
        })
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Its process id.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Its CPU time so far (user + system, its threads included), in seconds.
    pub fn cpu_seconds(&self) -> Option<f64> {
        self.pid().and_then(transport::http::process::cpu_seconds)
    }

    /// The last lines of its log.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(12)..].join("\n")
    }

    /// Waits (at most `within`) until it routes (invariant 2).
    pub async fn wait_ready(&mut self, ready_path: &str, within: Duration) -> Result<()> {
        let client: Client<HttpConnector, Full<Bytes>> =
            Client::builder(TokioExecutor::new()).build_http();
        let deadline = Instant::now() + within;
        let mut last = String::from("no answer yet");
        let mut ready = false;
        loop {
            if let Some(Ok(Some(status))) = self.child.as_mut().map(Child::try_wait) {
                bail!(
                    "the router exited at start ({status}); its log ends:\n{}",
                    self.log_tail()
                );
            }
            if Instant::now() > deadline {
                bail!(
                    "the router did not route within {within:?} ({last}); its log ends:\n{}",
                    self.log_tail()
                );
            }
            let attempt = if ready {
                let body =
                    r#"{"model":"kvengine-sim","prompt":"kvengine peers probe","max_tokens":1}"#;
                hyper::Request::post(format!("{}/v1/completions", self.url()))
                    .header(hyper::header::CONTENT_TYPE, "application/json")
                    .body(Full::new(Bytes::from_static(body.as_bytes())))
            } else {
                hyper::Request::get(format!("{}{ready_path}", self.url()))
                    .body(Full::new(Bytes::new()))
            };
            let req = attempt.context("building a readiness request")?;
            match tokio::time::timeout(Duration::from_secs(5), client.request(req)).await {
                Ok(Ok(resp)) if resp.status().is_success() => {
                    let _ = resp.into_body().collect().await;
                    if ready {
                        return Ok(());
                    }
                    ready = true;
                    continue;
                }
                Ok(Ok(resp)) => last = format!("status {}", resp.status()),
                Ok(Err(e)) => last = e.to_string(),
                Err(_) => last = "no answer within 5 s".into(),
            }
            tokio::time::sleep(READY_POLL).await;
        }
    }

    /// Kills and reaps it (invariant 1).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for RouterChild {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A free TCP port on 127.0.0.1 (bound and released: another process could take it before
/// the router binds it, which the router's start then reports).
pub fn free_port() -> Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("cannot bind a free port")?;
    Ok(l.local_addr().context("no local address")?.port())
}
