//! `kvengine demo`: KV-aware routing, end to end, on one machine with no GPU or data file.
//!
//! The real router (engine, hub, HTTP edge and OpenAI proxy) and 4 simulated vLLM workers
//! (OpenAI HTTP servers publishing KV events over ZMQ) start in this process; the built-in
//! chat workload (or a Mooncake trace) is replayed open loop through the router's
//! `/v1/completions` in each routing mode in turn, on fresh workers each time, and a table
//! compares time to first token, the prefix-cache hit rate the workers reported, and how
//! evenly prefill work was spread. The replay machinery is `lab::replay`.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use lab::replay::{self, ReplayConfig, RunMode, report, trace};
use sim::engine::EngineConfig;

#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Simulated workers.
    #[arg(long, env = "KVENGINE_WORKERS", default_value_t = 4,
          value_parser = clap::value_parser!(u32).range(1..=64))]
    workers: u32,
    /// Requests replayed per mode (a trace is cut to this many).
    #[arg(long, env = "KVENGINE_REQUESTS", default_value_t = 400,
          value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    requests: u64,
    /// Routing modes to compare, comma separated: kv, round-robin, random, kv-no-events
    /// (kv without KV events: the router predicts the caches), sglang, llm-d,
    /// power-of-two (the peers' policies), or all.
    #[arg(long, env = "KVENGINE_MODES", default_value = "all", value_parser = parse_modes)]
    modes: Modes,
    /// The simulated workers run this many times faster than real time (arrivals are
    /// compressed by as much; the figures are in simulated time).
    #[arg(long, env = "KVENGINE_SPEEDUP", default_value_t = 4.0, value_parser = positive)]
    speedup: f64,
    /// KV cache blocks per worker; the default (3,072 blocks of 16 tokens, or as many
    /// tokens in blocks of --block-size) is small enough that the workers cannot hold the
    /// whole workload, so they evict and routing matters.
    #[arg(long, env = "KVENGINE_KV_BLOCKS",
          value_parser = clap::value_parser!(u32).range(1..u32::MAX as i64))]
    kv_blocks: Option<u32>,
    /// Tokens per KV block (the workers' page size and the router's block size; default 16,
    /// 32 with --engine trtllm).
    #[arg(long, env = "KVENGINE_BLOCK_SIZE",
          value_parser = clap::value_parser!(u32).range(1..=4096))]
    block_size: Option<u32>,
    /// The engine the simulated workers imitate: vllm (KV events over ZMQ) or trtllm
    /// (TensorRT-LLM: the router polls each worker's POST /kv_cache_events).
    #[arg(long, default_value = "vllm", env = "KVENGINE_ENGINE",
          value_parser = lab::replay::parse_engine)]
    engine: lab::workers::EventFormat,
    /// A Mooncake-format JSONL trace to replay instead of the built-in chat workload.
    #[arg(long, env = "KVENGINE_TRACE")]
    trace: Option<PathBuf>,
    /// Seed of the workload and of the router's scheduler.
    #[arg(long, env = "KVENGINE_SEED", default_value_t = 0)]
    seed: u64,
    /// Also write the results as JSON to this file.
    #[arg(long, env = "KVENGINE_JSON")]
    json: Option<PathBuf>,
}

#[derive(Clone, Debug, PartialEq)]
struct Modes(Vec<RunMode>);

fn parse_modes(s: &str) -> Result<Modes, String> {
    RunMode::parse_list(s).map(Modes)
}

fn positive(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(x) if x.is_finite() && x > 0.0 => Ok(x),
        _ => Err(format!("{s:?} is not a finite number above 0")),
    }
}

pub fn run(args: &DemoArgs) -> Result<()> {
    let requests = usize::try_from(args.requests).context("--requests is too large")?;
    let block_size = args
        .block_size
        .unwrap_or_else(|| replay::default_block_size(args.engine));
    let kv_blocks = args
        .kv_blocks
        .unwrap_or_else(|| replay::default_kv_blocks(3072, block_size));
    let workload = match &args.trace {
        Some(path) => trace::load_trace(
            path,
            &trace::TraceOptions {
                max_requests: Some(requests),
                block_size,
                ..trace::TraceOptions::default()
            },
        )
        .context("--trace")?,
        None => trace::chat_workload(replay::demo_chat_config(args.seed, requests), block_size)?,
    };
    let cfg = ReplayConfig {
        workers: args.workers as usize,
        speedup: args.speedup,
        engine: EngineConfig {
            kv_blocks,
            block_size,
            ..EngineConfig::default()
        },
        seed: args.seed,
        progress: true,
        events: args.engine,
        ..ReplayConfig::default()
    };
    cfg.validate()
        .context("--workers, --speedup or --kv-blocks")?;

    let (engine_name, events_how) = if args.engine.is_trtllm() {
        (
            "TensorRT-LLM",
            "polled from each worker's POST /kv_cache_events",
        )
    } else {
        ("vLLM", "over ZMQ")
    };
    println!("kvengine demo: the router and simulated {engine_name} workers, in this process");
    println!(
        "  {} workers (simulated H100s serving an 8B model), routing over HTTP; KV events \
         {events_how}",
        args.workers
    );
    println!("{}", replay::describe(&workload, &cfg));
    println!(
        "  modes: {}",
        args.modes
            .0
            .iter()
            .map(|m| m.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!();
    let reports = replay::run(&workload, &args.modes.0, &cfg)?;
    print!("{}", report::table(&reports));
    print!("{}", report::index_summary(&reports));
    println!();
    println!("{}", verdict(&reports));
    println!("  {}", report::legend(&reports).trim_end());

    if let Some(path) = &args.json {
        let doc = serde_json::json!({
            "workload": workload.name,
            "workers": args.workers,
            "kv_blocks": kv_blocks,
            "block_size": block_size,
            "engine": if args.engine.is_trtllm() { "trtllm" } else { "vllm" },
            "speedup": args.speedup,
            "seed": args.seed,
            "prompt_tokens": workload.bound.prompt_tokens,
            "distinct_blocks": workload.bound.distinct_blocks,
            "hit_rate_bound": workload.bound.hit_rate(),
            "modes": reports,
        });
        lab::write_json(&doc, path).context("--json")?;
    }
    let errors: u64 = reports.iter().map(|r| r.errors).sum();
    if errors > 0 {
        let samples: Vec<&str> = reports
            .iter()
            .flat_map(|r| r.error_samples.iter().map(String::as_str))
            .take(3)
            .collect();
        anyhow::bail!("{errors} request(s) failed, e.g. {}", samples.join("; "));
    }
    Ok(())
}

/// One sentence comparing kv with the best mode that ignores caches.
fn verdict(reports: &[report::ModeReport]) -> String {
    let kv = reports.iter().find(|r| r.mode == RunMode::Kv.as_str());
    let blind = reports
        .iter()
        .filter(|r| r.mode == "round-robin" || r.mode == "random")
        .min_by(|a, b| a.ttft_p50_ms.total_cmp(&b.ttft_p50_ms));
    match (kv, blind) {
        (Some(kv), Some(b)) if kv.ttft_p50_ms > 0.0 => format!(
            "kv routing: median TTFT {:.1}x lower than {} ({:.0} vs {:.0} ms), cache hit rate \
             {:.1}% vs {:.1}%",
            b.ttft_p50_ms / kv.ttft_p50_ms,
            b.mode,
            kv.ttft_p50_ms,
            b.ttft_p50_ms,
            100.0 * kv.cache_hit_rate,
            100.0 * b.cache_hit_rate
        ),
        _ => "run kv together with round-robin or random to compare them".into(),
    }
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
        assert_eq!((d.workers, d.block_size), (4, None));
        assert!(!d.engine.is_trtllm());
        let d = parse(&["demo", "--engine", "trtllm"]).unwrap();
        assert!(d.engine.is_trtllm());
        assert!(parse(&["demo", "--engine", "tgi"]).is_err());
        assert_eq!(d.modes.0, RunMode::ALL.to_vec());
        let d = parse(&["demo", "--modes", "random,kv", "--requests", "10"]).unwrap();
        assert_eq!(d.modes.0, vec![RunMode::Random, RunMode::Kv]);
        assert_eq!(d.requests, 10);
        let d = parse(&["demo", "--modes", "kv-no-events"]).unwrap();
        assert_eq!(d.modes.0, vec![RunMode::KvNoEvents]);
    }

    #[test]
    fn bad_flags_are_refused() {
        for bad in [
            &["demo", "--workers", "0"][..],
            &["demo", "--workers", "65"],
            &["demo", "--modes", "kv,fastest"],
            &["demo", "--modes", "direct"],
            &["demo", "--modes", ""],
            &["demo", "--speedup", "0"],
            &["demo", "--speedup", "nan"],
            &["demo", "--block-size", "0"],
            &["demo", "--kv-blocks", "lots"],
            &["demo", "--bogus"],
        ] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
    }
}
