//! The peer routers' installs: one Python virtualenv per peer, from PyPI, at a pinned
//! version, cached outside any clone (`~/.cache/kvengine/peers/` by default) and keyed by
//! package, version and Python version, so a machine that has one skips the download.
//!
//! Each peer gets its own virtualenv because sglang-router ships a `smg` executable of its
//! own, which would shadow SMG's.
//!
//! # Invariants
//! 1. A virtualenv counts as installed only once its `pip install` succeeded: the file
//!    [`DONE`] is written in it last (a virtualenv cannot be renamed: its scripts name their
//!    interpreter by absolute path), and a directory without it is built again.
//! 2. Nothing is downloaded unless asked ([`PeerInstalls::find`] with `install`).

use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Written into a virtualenv once its install succeeded (invariant 1).
pub const DONE: &str = ".kvengine-installed";

/// A peer router package.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Peer {
    /// SMG (Shepherd Model Gateway).
    Smg,
    /// SGLang's router.
    SglangRouter,
    /// vLLM's router.
    VllmRouter,
}

impl Peer {
    /// Every peer.
    pub const ALL: [Peer; 3] = [Peer::Smg, Peer::SglangRouter, Peer::VllmRouter];

    /// Its PyPI package.
    pub fn package(self) -> &'static str {
        match self {
            Peer::Smg => "smg",
            Peer::SglangRouter => "sglang-router",
            Peer::VllmRouter => "vllm-router",
        }
    }

    /// The pinned version compared.
    pub fn version(self) -> &'static str {
        match self {
            Peer::Smg => "1.13.0",
            Peer::SglangRouter => "0.3.2",
            Peer::VllmRouter => "0.1.17",
        }
    }

    /// `package==version`.
    pub fn requirement(self) -> String {
        format!("{}=={}", self.package(), self.version())
    }
}

/// One installed peer.
#[derive(Clone, Debug)]
pub struct Install {
    /// Its virtualenv.
    pub dir: PathBuf,
}

impl Install {
    /// An executable of its virtualenv.
    pub fn bin(&self, name: &str) -> PathBuf {
        self.dir.join("bin").join(name)
    }
}

/// The peers found (or installed).
#[derive(Clone, Debug, Default)]
pub struct PeerInstalls {
    found: Vec<(Peer, Install)>,
    /// Why each missing peer is missing.
    pub missing: Vec<(Peer, String)>,
}

impl PeerInstalls {
    /// `peer`'s install, if it has one.
    pub fn get(&self, peer: Peer) -> Option<&Install> {
        self.found.iter().find(|(p, _)| *p == peer).map(|(_, i)| i)
    }

    /// Looks for `peers` under `root` (one virtualenv each, for `python`'s version), and
    /// with `install` creates the missing ones from PyPI first.
    pub fn find(root: &Path, python: &str, peers: &[Peer], install: bool) -> Result<Self> {
        let version = python_version(python)?;
        let mut out = Self::default();
        for &peer in peers {
            let dir = root.join(format!("{}-{}-py{version}", peer.package(), peer.version()));
            let marker = dir.join(DONE);
            if !marker.exists() {
                if !install {
                    out.missing.push((
                        peer,
                        format!(
                            "not installed in {} (run with --install-peers)",
                            dir.display()
                        ),
                    ));
                    continue;
                }
                if let Err(e) = create(&dir, python, peer) {
                    out.missing.push((peer, format!("{e:#}")));
                    continue;
                }
            }
            out.found.push((peer, Install { dir }));
        }
        Ok(out)
    }
}

/// The default root: `$XDG_CACHE_HOME/kvengine/peers`, else `~/.cache/kvengine/peers`.
pub fn default_root() -> PathBuf {
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    cache.join("kvengine").join("peers")
}

/// `MAJOR.MINOR` of `python`.
fn python_version(python: &str) -> Result<String> {
    let out = Command::new(python)
        .args(["-c", "import sys; print('%d.%d' % sys.version_info[:2])"])
        .output()
        .with_context(|| format!("cannot run {python}"))?;
    if !out.status.success() {
        bail!("{python} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// Builds `dir` (invariant 1).
fn create(dir: &Path, python: &str, peer: Peer) -> Result<()> {
    let parent = dir
        .parent()
        .context("the virtualenv has no parent directory")?;
    std::fs::create_dir_all(parent)
        .with_context(|| format!("cannot create {}", parent.display()))?;
    let _ = std::fs::remove_dir_all(dir);
    eprintln!(
        "peers: installing {} into {}",
        peer.requirement(),
        dir.display()
    );
    let run = |cmd: &mut Command, what: &str| -> Result<()> {
        let out = cmd.output().with_context(|| format!("cannot run {what}"))?;
        if !out.status.success() {
            bail!(
                "{what} failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
                    .lines()
                    .rev()
                    .take(5)
                    .collect::<Vec<_>>()
                    .join(" / ")
            );
        }
        Ok(())
    };
    let result = run(
        Command::new(python).args(["-m", "venv"]).arg(dir),
        "python -m venv",
    )
    .and_then(|()| {
        run(
            Command::new(dir.join("bin").join("pip")).args([
                "install",
                "--quiet",
                "--disable-pip-version-check",
                &peer.requirement(),
            ]),
            "pip install",
        )
    })
    .and_then(|()| {
        std::fs::write(dir.join(DONE), peer.requirement())
            .with_context(|| format!("cannot write {}", dir.join(DONE).display()))
    });
    if result.is_err() {
        let _ = std::fs::remove_dir_all(dir);
    }
    result
}
