//! The routers a peers run compares ([`Contender`]) and the command line that starts each
//! one in front of a cluster of simulated workers.
//!
//! * `kvengine[:FLAGS]`: this binary (`kvengine` serving the workers through `--worker`
//!   with their ZMQ KV events, `--tokenizer stand-in`), plus FLAGS (space separated) to
//!   compare a setting against the default; `kvengine-ttft` is `kvengine:--router-cost ttft`.
//! * `kvengine@PATH[:FLAGS]`: another kvengine binary (an earlier build), the same way, to
//!   compare two builds side by side in one session.
//! * `smg`: SMG's `smg launch --policy cache_aware`, its shipped defaults otherwise.
//! * `sglang-router`: `python -m sglang_router.launch_router --policy cache_aware`.
//! * `vllm-router`: `vllm-router --policy cache_aware` (its default policy).
//! * `vllm-router-kv`: `vllm-router --policy kv_aware` fed the workers' ZMQ KV events
//!   (`--kv-event-source`, `--kv-event-replay-source`): vLLM's own event-driven router.
//!
//! Every peer is started with its shipped defaults except the policy, named explicitly so
//! that a future default change does not silently change what is compared.

use super::venv::{Peer, PeerInstalls};
use anyhow::{Result, bail};
use std::fmt;
use std::path::{Path, PathBuf};

/// One router to compare.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Contender {
    /// This binary, with extra flags (none: the default configuration).
    Kvengine {
        /// Extra command-line flags.
        flags: Vec<String>,
        /// Another kvengine binary (`None`: this one).
        bin: Option<PathBuf>,
    },
    /// An installed peer.
    Peer(PeerKind),
}

/// A peer router and the policy it runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerKind {
    /// SMG's cache-aware policy.
    Smg,
    /// sglang-router's cache-aware policy.
    SglangRouter,
    /// vllm-router's cache-aware policy (its default).
    VllmRouter,
    /// vllm-router's KV-event-driven policy.
    VllmRouterKv,
}

impl PeerKind {
    /// The package it comes from.
    pub fn package(self) -> Peer {
        match self {
            PeerKind::Smg => Peer::Smg,
            PeerKind::SglangRouter => Peer::SglangRouter,
            PeerKind::VllmRouter | PeerKind::VllmRouterKv => Peer::VllmRouter,
        }
    }
}

impl fmt::Display for Contender {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Contender::Kvengine { flags, bin } => {
                f.write_str("kvengine")?;
                if let Some(bin) = bin {
                    write!(f, "@{}", bin.display())?;
                }
                if !flags.is_empty() {
                    write!(f, " {}", flags.join(" "))?;
                }
                Ok(())
            }
            Contender::Peer(PeerKind::Smg) => f.write_str("smg"),
            Contender::Peer(PeerKind::SglangRouter) => f.write_str("sglang-router"),
            Contender::Peer(PeerKind::VllmRouter) => f.write_str("vllm-router"),
            Contender::Peer(PeerKind::VllmRouterKv) => f.write_str("vllm-router-kv"),
        }
    }
}

impl Contender {
    /// Every contender `all` names, in table order.
    pub fn all() -> Vec<Contender> {
        vec![
            Contender::Kvengine {
                flags: Vec::new(),
                bin: None,
            },
            Contender::Peer(PeerKind::Smg),
            Contender::Peer(PeerKind::SglangRouter),
            Contender::Peer(PeerKind::VllmRouter),
            Contender::Peer(PeerKind::VllmRouterKv),
        ]
    }

    /// Parses a comma-separated list (`all`, or names as in the module docs).
    pub fn parse_list(s: &str) -> Result<Vec<Contender>, String> {
        let mut out = Vec::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            if part == "all" {
                out.extend(Self::all());
                continue;
            }
            out.push(part.parse()?);
        }
        if out.is_empty() {
            return Err("name at least one router".into());
        }
        Ok(out)
    }

    /// The peer package it needs, if any.
    pub fn peer(&self) -> Option<Peer> {
        match self {
            Contender::Kvengine { .. } => None,
            Contender::Peer(k) => Some(k.package()),
        }
    }

    /// The path a readiness probe asks for (200 once the router can route).
    pub fn ready_path(&self) -> &'static str {
        match self {
            Contender::Kvengine { .. } => "/ready",
            Contender::Peer(_) => "/v1/models",
        }
    }

    /// The command that starts it on `port` in front of `workers`.
    pub fn command(
        &self,
        kvengine: &Path,
        installs: &PeerInstalls,
        port: u16,
        workers: &[WorkerAddrs],
        block_size: u32,
    ) -> Result<(PathBuf, Vec<String>)> {
        let urls: Vec<String> = workers.iter().map(|w| w.url.clone()).collect();
        let port = port.to_string();
        match self {
            Contender::Kvengine { flags, bin } => {
                let kvengine = bin.as_deref().unwrap_or(kvengine);
                let mut args: Vec<String> = vec![
                    "--http-host".into(),
                    "127.0.0.1".into(),
                    "--http-port".into(),
                    port,
                    "--tokenizer".into(),
                    "stand-in".into(),
                    "--kv-cache-block-size".into(),
                    block_size.to_string(),
                ];
                for (i, w) in workers.iter().enumerate() {
                    args.push("--worker".into());
                    args.push(format!(
                        "id={},url={},zmq={},replay={}",
                        i + 1,
                        w.url,
                        w.zmq,
                        w.replay
                    ));
                }
                args.extend(flags.iter().cloned());
                Ok((kvengine.to_owned(), args))
            }
            Contender::Peer(kind) => {
                let Some(install) = installs.get(kind.package()) else {
                    bail!("{self} is not installed");
                };
                let common = |mut args: Vec<String>| {
                    args.extend(["--host".into(), "127.0.0.1".into(), "--port".into()]);
                    args.push(port.clone());
                    args.push("--worker-urls".into());
                    args.extend(urls.iter().cloned());
                    args
                };
                Ok(match kind {
                    PeerKind::Smg => (
                        install.bin("smg"),
                        common(vec![
                            "launch".into(),
                            "--policy".into(),
                            "cache_aware".into(),
                        ]),
                    ),
                    PeerKind::SglangRouter => (
                        install.bin("python"),
                        common(vec![
                            "-m".into(),
                            "sglang_router.launch_router".into(),
                            "--policy".into(),
                            "cache_aware".into(),
                        ]),
                    ),
                    PeerKind::VllmRouter => (
                        install.bin("vllm-router"),
                        common(vec!["--policy".into(), "cache_aware".into()]),
                    ),
                    PeerKind::VllmRouterKv => {
                        let mut args = common(vec!["--policy".into(), "kv_aware".into()]);
                        for w in workers {
                            args.push("--kv-event-source".into());
                            args.push(format!("{}={}", w.url, w.zmq));
                            args.push("--kv-event-replay-source".into());
                            args.push(format!("{}={}", w.url, w.replay));
                        }
                        args.extend([
                            "--kv-event-block-size".into(),
                            block_size.to_string(),
                            "--kv-event-model".into(),
                            "kvengine-sim".into(),
                        ]);
                        (install.bin("vllm-router"), args)
                    }
                })
            }
        }
    }
}

impl std::str::FromStr for Contender {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "kvengine" => Contender::Kvengine {
                flags: Vec::new(),
                bin: None,
            },
            "kvengine-ttft" => Contender::Kvengine {
                flags: vec!["--router-cost".into(), "ttft".into()],
                bin: None,
            },
            "smg" => Contender::Peer(PeerKind::Smg),
            "sglang-router" => Contender::Peer(PeerKind::SglangRouter),
            "vllm-router" => Contender::Peer(PeerKind::VllmRouter),
            "vllm-router-kv" => Contender::Peer(PeerKind::VllmRouterKv),
            other => {
                let unknown = || {
                    format!(
                        "unknown router {other:?}: kvengine, kvengine:FLAGS, kvengine@PATH, \
                         kvengine@PATH:FLAGS, kvengine-ttft, smg, sglang-router, vllm-router, \
                         vllm-router-kv or all"
                    )
                };
                let (bin, flags) = if let Some(rest) = other.strip_prefix("kvengine@") {
                    let (path, flags) = rest.split_once(':').unwrap_or((rest, ""));
                    if path.trim().is_empty() {
                        return Err(unknown());
                    }
                    (Some(PathBuf::from(path.trim())), flags)
                } else if let Some(flags) = other.strip_prefix("kvengine:") {
                    if flags.trim().is_empty() {
                        return Err(unknown());
                    }
                    (None, flags)
                } else {
                    return Err(unknown());
                };
                Contender::Kvengine {
                    flags: flags.split_whitespace().map(str::to_owned).collect(),
                    bin,
                }
            }
        })
    }
}

/// Where a simulated worker listens.
#[derive(Clone, Debug)]
pub struct WorkerAddrs {
    /// Its OpenAI base URL.
    pub url: String,
    /// Its KV-event publisher.
    pub zmq: String,
    /// Its replay endpoint.
    pub replay: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_parse_and_name_themselves() {
        let list = Contender::parse_list(
            "kvengine, kvengine-ttft,smg,kvengine:--a b,kvengine@/old/kvengine,kvengine@/o:--c",
        )
        .unwrap();
        let names: Vec<String> = list.iter().map(ToString::to_string).collect();
        assert_eq!(
            names,
            [
                "kvengine",
                "kvengine --router-cost ttft",
                "smg",
                "kvengine --a b",
                "kvengine@/old/kvengine",
                "kvengine@/o --c"
            ]
        );
        assert!(Contender::parse_list("kvengine@").is_err());
        assert!(Contender::parse_list("kvengine@:--x").is_err());
        assert_eq!(Contender::parse_list("all").unwrap(), Contender::all());
        assert!(Contender::parse_list("nginx").is_err());
        assert!(Contender::parse_list("kvengine:").is_err());
        assert!(Contender::parse_list(" , ").is_err());
    }

    #[test]
    fn kvengine_gets_every_worker_with_its_events() {
        let workers = vec![
            WorkerAddrs {
                url: "http://127.0.0.1:1".into(),
                zmq: "tcp://127.0.0.1:2".into(),
                replay: "tcp://127.0.0.1:3".into(),
            };
            2
        ];
        let exe = PathBuf::from("/bin/kvengine");
        let (bin, args) = Contender::Kvengine {
            flags: vec!["--x".into()],
            bin: None,
        }
        .command(&exe, &PeerInstalls::default(), 9, &workers, 16)
        .unwrap();
        assert_eq!(bin, exe);
        let specs: Vec<&String> = args
            .iter()
            .zip(args.iter().skip(1))
            .filter(|(a, _)| *a == "--worker")
            .map(|(_, v)| v)
            .collect();
        assert_eq!(
            specs,
            [
                "id=1,url=http://127.0.0.1:1,zmq=tcp://127.0.0.1:2,replay=tcp://127.0.0.1:3",
                "id=2,url=http://127.0.0.1:1,zmq=tcp://127.0.0.1:2,replay=tcp://127.0.0.1:3"
            ]
        );
        assert_eq!(args.last().map(String::as_str), Some("--x"));
        // A peer that is not installed is an error, not a silent skip.
        assert!(
            Contender::Peer(PeerKind::Smg)
                .command(&exe, &PeerInstalls::default(), 9, &workers, 16)
                .is_err()
        );
    }
}
