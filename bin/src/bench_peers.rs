//! `kvengine bench peers`: flags and wiring; the comparison lives in `lab::peers`.

use crate::workload_args::{load_workload, positive};
use anyhow::{Context, Result, bail};
use clap::Args;
use lab::peers::venv::{self, Peer, PeerInstalls};
use lab::peers::{self, Contender, PeersConfig};
use lab::replay;
use sim::engine::EngineConfig;
use std::path::PathBuf;
use std::time::Duration;

/// `kvengine bench peers` flags.
#[derive(Debug, Args)]
pub struct PeersBench {
    /// The routers, comma separated: kvengine, kvengine-ttft, kvengine:FLAGS (kvengine
    /// with extra flags, space separated), smg, sglang-router, vllm-router (its default
    /// cache-aware policy), vllm-router-kv (its KV-event policy), or all.
    #[arg(long, default_value = "all", env = "KVENGINE_BENCH_ROUTERS",
          value_parser = parse_routers)]
    routers: RouterList,
    /// Install the peers that are missing (one virtualenv each under --peers-dir, from
    /// PyPI at the pinned versions); without it a missing peer is skipped.
    #[arg(long, env = "KVENGINE_BENCH_INSTALL_PEERS")]
    install_peers: bool,
    /// Fail instead of skipping a peer that is not installed (for CI).
    #[arg(long, env = "KVENGINE_BENCH_REQUIRE_PEERS")]
    require_peers: bool,
    /// Where the peers' virtualenvs live [default: ~/.cache/kvengine/peers].
    #[arg(long, env = "KVENGINE_BENCH_PEERS_DIR")]
    peers_dir: Option<PathBuf>,
    /// The Python that builds the peers' virtualenvs.
    #[arg(long, default_value = "python3", env = "KVENGINE_BENCH_PYTHON")]
    python: String,
    /// Mooncake-format JSONL trace; without it, the built-in chat workload.
    #[arg(long, env = "KVENGINE_BENCH_TRACE")]
    trace: Option<PathBuf>,
    /// Replay only the first K requests (the chat workload generates K; default 400).
    #[arg(long, env = "KVENGINE_BENCH_MAX_REQUESTS",
          value_parser = clap::value_parser!(u64).range(1..=10_000_000))]
    max_requests: Option<u64>,
    /// Multiply the workload's request rate by this.
    #[arg(long, default_value_t = 1.0, env = "KVENGINE_BENCH_RATE_SCALE", value_parser = positive)]
    rate_scale: f64,
    /// Seed of the chat workload.
    #[arg(long, default_value_t = 0, env = "KVENGINE_BENCH_SEED")]
    seed: u64,
    /// Simulated workers per run.
    #[arg(long, default_value_t = 4, env = "KVENGINE_BENCH_WORKERS",
          value_parser = clap::value_parser!(u32).range(1..=64))]
    workers: u32,
    /// KV cache blocks per worker (16 tokens each) [default: 28,000, an 8B model on one
    /// H100].
    #[arg(long, env = "KVENGINE_BENCH_KV_BLOCKS",
          value_parser = clap::value_parser!(u32).range(1..u32::MAX as i64))]
    kv_blocks: Option<u32>,
    /// The simulated workers run this many times faster than real time.
    #[arg(long, default_value_t = 10.0, env = "KVENGINE_BENCH_SPEEDUP", value_parser = positive)]
    speedup: f64,
    /// Runs of every router, interleaved.
    #[arg(long, default_value_t = 3, env = "KVENGINE_BENCH_RUNS",
          value_parser = clap::value_parser!(u32).range(1..=100))]
    runs: u32,
    /// Seconds of each proxy-overhead measurement (tiny requests, closed loops) after each
    /// replay; 0 skips it.
    #[arg(long, default_value_t = 5, env = "KVENGINE_BENCH_OVERHEAD_SECS")]
    overhead_secs: u64,
    /// The overhead measurement's connection counts, comma separated.
    #[arg(
        long,
        default_value = "16,64",
        value_delimiter = ',',
        env = "KVENGINE_BENCH_OVERHEAD_CONNECTIONS"
    )]
    overhead_connections: Vec<usize>,
    /// Where the routers' logs go [default: a new directory under the temp dir].
    #[arg(long, env = "KVENGINE_BENCH_WORKDIR")]
    workdir: Option<PathBuf>,
    /// Write every run's figures here as JSON.
    #[arg(long, env = "KVENGINE_BENCH_JSON")]
    json: Option<PathBuf>,
}

/// Parsed `--routers`.
#[derive(Clone, Debug)]
pub struct RouterList(Vec<Contender>);

fn parse_routers(s: &str) -> Result<RouterList, String> {
    Contender::parse_list(s).map(RouterList)
}

/// Runs `kvengine bench peers`.
pub fn run(b: &PeersBench) -> Result<()> {
    let block_size = engine::hash::DEFAULT_BLOCK_SIZE as u32;
    let wanted: Vec<Peer> = Peer::ALL
        .into_iter()
        .filter(|p| b.routers.0.iter().any(|c| c.peer() == Some(*p)))
        .collect();
    let root = b.peers_dir.clone().unwrap_or_else(venv::default_root);
    let installs = if wanted.is_empty() {
        PeerInstalls::default()
    } else {
        PeerInstalls::find(&root, &b.python, &wanted, b.install_peers)?
    };
    for (peer, why) in &installs.missing {
        if b.require_peers {
            bail!("{}: {why}", peer.requirement());
        }
        eprintln!("peers: skipping {}: {why}", peer.requirement());
    }
    let contenders: Vec<Contender> = b
        .routers
        .0
        .iter()
        .filter(|c| c.peer().is_none_or(|p| installs.get(p).is_some()))
        .cloned()
        .collect();
    if contenders.is_empty() {
        bail!("no router to compare");
    }
    let max = b
        .max_requests
        .map(usize::try_from)
        .transpose()
        .context("--max-requests is too large")?;
    let workload = load_workload(b.trace.as_deref(), max, b.rate_scale, b.seed, block_size)?;
    let kv_blocks = b
        .kv_blocks
        .unwrap_or_else(|| replay::default_kv_blocks(28_000, block_size));
    let workdir = b.workdir.clone().unwrap_or_else(|| {
        std::env::temp_dir().join(format!("kvengine-peers-{}", std::process::id()))
    });
    let cfg = PeersConfig {
        contenders,
        workers: b.workers as usize,
        engine: EngineConfig {
            kv_blocks,
            block_size,
            ..EngineConfig::default()
        },
        speedup: b.speedup,
        runs: b.runs as usize,
        overhead: Duration::from_secs(b.overhead_secs),
        overhead_connections: b.overhead_connections.clone(),
        kvengine: std::env::current_exe().context("locating the kvengine binary")?,
        installs,
        workdir: workdir.clone(),
        request_timeout: Duration::from_secs(600),
        start_timeout: Duration::from_secs(120),
    };
    let mem_before = lab::calibrate::mem_latency();
    eprintln!(
        "peers: {} ({} requests; an infinite cache would hit {:.1}%), {} workers x {} blocks \
         of {block_size}, {}x real time, {} run(s) of: {}; logs in {}",
        workload.name,
        workload.requests.len(),
        workload.bound.hit_rate() * 100.0,
        cfg.workers,
        kv_blocks,
        cfg.speedup,
        cfg.runs,
        cfg.contenders
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(", "),
        workdir.display()
    );
    for p in &wanted {
        if cfg.installs.get(*p).is_some() {
            eprintln!("peers: {} from {}", p.requirement(), root.display());
        }
    }
    let figures = peers::run(&workload, &cfg, &|f| match &f.failed {
        Some(e) => eprintln!("peers: run {} {}: FAILED: {e}", f.run, f.router),
        None => eprintln!(
            "peers: run {} {}: TTFT p50 {:.0} p99 {:.0} ms, hit {:.1}%, {} errors, CPU {:.2} s{}",
            f.run,
            f.router,
            f.ttft_p50_ms,
            f.ttft_p99_ms,
            f.worker_hit_rate * 100.0,
            f.errors,
            f.router_cpu_s,
            f.misses.map_or(String::new(), |m| {
                let pct = |n: u64| n as f64 * 100.0 / m.total().max(1) as f64;
                format!(
                    " (its attribution: hit {:.1}%, missed by routing {:.1}%, stale {:.1}%, \
                     cold {:.1}%)",
                    pct(m.hit_tokens),
                    pct(m.routing_tokens),
                    pct(m.stale_tokens),
                    pct(m.cold_tokens)
                )
            })
        ),
    })?;
    let mem_after = lab::calibrate::mem_latency();
    let connections = if cfg.overhead.is_zero() {
        Vec::new()
    } else {
        cfg.overhead_connections.clone()
    };
    println!(
        "{}: {} requests, {} workers x {kv_blocks} blocks, {}x real time; an infinite cache \
         would hit {:.1}%",
        workload.name,
        workload.requests.len(),
        cfg.workers,
        cfg.speedup,
        workload.bound.hit_rate() * 100.0
    );
    print!("{}", peers::table(&figures, &connections));
    println!(
        "memory latency (ns per load, 1/4/16/128 MB): before {:.0}/{:.0}/{:.0}/{:.0}, \
         after {:.0}/{:.0}/{:.0}/{:.0}",
        mem_before.mb_1,
        mem_before.mb_4,
        mem_before.mb_16,
        mem_before.mb_128,
        mem_after.mb_1,
        mem_after.mb_4,
        mem_after.mb_16,
        mem_after.mb_128
    );
    if let Some(path) = &b.json {
        lab::write_json(
            &serde_json::json!({
                "workload": workload.name,
                "workers": cfg.workers,
                "kv_blocks": kv_blocks,
                "speedup": cfg.speedup,
                "hit_rate_bound": workload.bound.hit_rate(),
                "peers": wanted.iter().map(|p| p.requirement()).collect::<Vec<_>>(),
                "mem_latency_before_ns": mem_before,
                "mem_latency_after_ns": mem_after,
                "runs": figures,
            }),
            path,
        )?;
    }
    let failed = figures.iter().filter(|f| f.failed.is_some()).count();
    if failed > 0 {
        bail!("{failed} run(s) failed (see above)");
    }
    Ok(())
}
