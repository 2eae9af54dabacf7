//! `kvengine demo`: KV-aware routing on a simulated cluster.
//!
//! An embedded chat workload (or a Mooncake trace) is routed by each mode in turn onto
//! fresh simulated workers (`sim`), and a table compares the prefix-cache hit rate the
//! workers really got, with the router's other figures. No cluster, GPU or data file is
//! needed.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Args;
use engine::sched::RouteMode;
use sim::cluster::{self, ClusterConfig};
use sim::worker::WorkerConfig;
use sim::workload::chat::{ChatConfig, ChatWorkload};
use sim::workload::mooncake::MooncakeTrace;
use sim::workload::{PrefixReuse, SimRequest};

#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Simulated workers.
    #[arg(long, env = "KVENGINE_WORKERS", default_value_t = 8,
          value_parser = clap::value_parser!(u32).range(1..=4096))]
    workers: u32,
    /// Data-parallel ranks per worker (each rank has its own KV cache).
    #[arg(long, env = "KVENGINE_DP_RANKS", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..=4096))]
    dp_ranks: u32,
    /// KV cache blocks per rank; the default is small enough that the cluster cannot hold
    /// the whole workload, so workers evict and routing matters.
    #[arg(long, env = "KVENGINE_KV_BLOCKS", default_value_t = 4096,
          value_parser = clap::value_parser!(u32).range(1..u32::MAX as i64))]
    kv_blocks: u32,
    /// Tokens per KV block (the engines' page size).
    #[arg(long, env = "KVENGINE_BLOCK_SIZE", default_value_t = 16,
          value_parser = clap::value_parser!(u32).range(1..=4096))]
    block_size: u32,
    /// Requests to route per mode (a trace is cut to this many).
    #[arg(long, env = "KVENGINE_REQUESTS", default_value_t = 4000,
          value_parser = clap::value_parser!(u64).range(1..=10_000_000))]
    requests: u64,
    /// Requests kept active before the oldest is finished.
    #[arg(long, env = "KVENGINE_CONCURRENCY", default_value_t = 64,
          value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    concurrency: u64,
    /// A Mooncake-format JSONL trace to replay instead of the embedded chat workload.
    #[arg(long, env = "KVENGINE_TRACE")]
    trace: Option<PathBuf>,
    /// Routing modes to compare, comma separated: kv, round-robin, random.
    #[arg(long, env = "KVENGINE_MODES", value_delimiter = ',',
          default_value = "kv,round-robin,random", value_parser = parse_mode)]
    modes: Vec<RouteMode>,
    /// Weight of prefill blocks against decode blocks in the kv cost.
    #[arg(long, env = "KVENGINE_OVERLAP_WEIGHT", default_value_t = 1.0,
          value_parser = non_negative)]
    overlap_weight: f64,
    /// Softmax temperature of kv mode (0 picks the cheapest worker).
    #[arg(long, env = "KVENGINE_TEMPERATURE", default_value_t = 0.0,
          value_parser = non_negative)]
    temperature: f64,
    /// Seed of the workload and of the schedulers.
    #[arg(long, env = "KVENGINE_SEED", default_value_t = 0)]
    seed: u64,
    /// Also write the results as JSON to this file.
    #[arg(long, env = "KVENGINE_JSON")]
    json: Option<PathBuf>,
}

fn parse_mode(s: &str) -> Result<RouteMode, String> {
    match s.trim().parse::<RouteMode>() {
        Ok(RouteMode::Direct) => Err("direct needs a target worker; the demo compares \
                                      kv, round-robin and random"
            .into()),
        Ok(mode) => Ok(mode),
        Err(_) => Err(format!(
            "unknown mode {s:?}: expected kv, round-robin or random"
        )),
    }
}

fn non_negative(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(x) if x.is_finite() && x >= 0.0 => Ok(x),
        _ => Err(format!("{s:?} is not a finite non-negative number")),
    }
}

/// Where the demo's requests come from.
enum Source {
    Chat(ChatConfig),
    Trace(MooncakeTrace),
}

impl Source {
    fn requests(&self, n: usize) -> Result<Box<dyn Iterator<Item = SimRequest> + '_>> {
        Ok(match self {
            Source::Chat(c) => Box::new(ChatWorkload::new(c.clone())?.take(n)),
            Source::Trace(t) => Box::new(t.requests().take(n)),
        })
    }

    fn describe(&self, n: usize) -> String {
        match self {
            Source::Chat(c) => format!(
                "embedded chat workload: {n} requests, {} live sessions over {} shared system \
                 prompts, seed {}",
                c.live_sessions, c.system_prompts, c.seed
            ),
            Source::Trace(t) => {
                format!("Mooncake trace: {} of {} requests", n.min(t.len()), t.len())
            }
        }
    }
}

pub fn run(args: &DemoArgs) -> Result<()> {
    if args.modes.is_empty() {
        bail!("--modes names no mode");
    }
    let requests = usize::try_from(args.requests).context("--requests is too large")?;
    let source = match &args.trace {
        Some(path) => Source::Trace(
            MooncakeTrace::load(path).with_context(|| format!("--trace {}", path.display()))?,
        ),
        None => Source::Chat(ChatConfig {
            seed: args.seed,
            requests,
            ..ChatConfig::default()
        }),
    };
    let base = ClusterConfig {
        workers: args.workers,
        dp_ranks: args.dp_ranks,
        worker: WorkerConfig {
            kv_blocks: args.kv_blocks,
            block_size: args.block_size,
        },
        concurrency: usize::try_from(args.concurrency).context("--concurrency is too large")?,
        mode: RouteMode::Kv,
        overlap_weight: args.overlap_weight,
        temperature: args.temperature,
        seed: args.seed,
    };
    base.validate().context("invalid cluster")?;

    println!("kvengine demo: KV-aware routing on a simulated cluster");
    println!("  {}", source.describe(requests));
    println!(
        "  {} workers x {} dp ranks, {} KV blocks of {} tokens each, {} requests in flight",
        args.workers, args.dp_ranks, args.kv_blocks, args.block_size, args.concurrency
    );
    let reuse = PrefixReuse::measure(source.requests(requests)?, args.block_size);
    let capacity = u64::from(args.workers) * u64::from(args.dp_ranks) * u64::from(args.kv_blocks);
    println!(
        "  {} prompt tokens in {} distinct blocks; the cluster holds {} blocks ({:.0}%)",
        reuse.prompt_tokens,
        reuse.distinct_blocks,
        capacity,
        100.0 * capacity as f64 / reuse.distinct_blocks.max(1) as f64
    );
    println!(
        "  one cache holding every block forever would serve {:.1}% of prompt tokens \
         (the bound for every mode)",
        100.0 * reuse.hit_rate()
    );
    println!();

    let mut reports = Vec::new();
    for &mode in &args.modes {
        let config = ClusterConfig { mode, ..base };
        let report = cluster::run(config, source.requests(requests)?)
            .with_context(|| format!("mode {mode}"))?;
        reports.push(report);
    }
    print!("{}", cluster::report::table(&reports));
    println!();
    println!("{}", cluster::report::verdict(&reports));

    if let Some(path) = &args.json {
        let doc = serde_json::json!({
            "workload": source.describe(requests),
            "workers": args.workers,
            "dp_ranks": args.dp_ranks,
            "kv_blocks": args.kv_blocks,
            "block_size": args.block_size,
            "concurrency": args.concurrency,
            "overlap_weight": args.overlap_weight,
            "temperature": args.temperature,
            "seed": args.seed,
            "prompt_tokens": reuse.prompt_tokens,
            "distinct_blocks": reuse.distinct_blocks,
            "infinite_cache_hit_rate": reuse.hit_rate(),
            "modes": reports,
        });
        let text = serde_json::to_string_pretty(&doc)?;
        std::fs::write(path, text + "\n")
            .with_context(|| format!("cannot write --json {}", path.display()))?;
    }

    let broken: Vec<&str> = reports
        .iter()
        .filter(|r| r.has_rejects())
        .map(|r| r.mode.as_str())
        .collect();
    if !broken.is_empty() {
        bail!(
            "the index refused KV events in mode(s) {}: the simulated workers and the index \
             disagree, which is a bug (please report it)",
            broken.join(", ")
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, clap::Parser)]
    struct Wrapper {
        #[command(flatten)]
        args: DemoArgs,
    }

    fn parse(args: &[&str]) -> Result<DemoArgs, clap::Error> {
        use clap::Parser;
        // The tests spell the subcommand; parse what follows it.
        let rest = args.iter().copied().skip_while(|a| *a == "demo");
        Wrapper::try_parse_from(std::iter::once("demo").chain(rest)).map(|w| w.args)
    }

    #[test]
    fn defaults_and_modes() {
        let d = parse(&["demo"]).unwrap();
        assert_eq!((d.workers, d.dp_ranks, d.block_size), (8, 1, 16));
        assert_eq!(
            d.modes,
            vec![RouteMode::Kv, RouteMode::RoundRobin, RouteMode::Random]
        );
        let d = parse(&["demo", "--modes", "random,kv", "--requests", "10"]).unwrap();
        assert_eq!(d.modes, vec![RouteMode::Random, RouteMode::Kv]);
        assert_eq!(d.requests, 10);
    }

    #[test]
    fn bad_flags_are_refused() {
        for bad in [
            &["demo", "--workers", "0"][..],
            &["demo", "--modes", "kv,fastest"],
            &["demo", "--modes", "direct"],
            &["demo", "--temperature", "-1"],
            &["demo", "--overlap-weight", "nan"],
            &["demo", "--block-size", "0"],
            &["demo", "--concurrency", "0"],
            &["demo", "--kv-blocks", "lots"],
            &["demo", "--bogus"],
        ] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
    }
}
