//! `kvengine bench soak` flags, and the command itself for the CLI to call.

use super::faults::FaultKind;
use super::{SoakConfig, plot, run};
use anyhow::{Result, bail};
use sim::engine::EngineConfig;
use std::path::PathBuf;
use std::time::Duration;

/// Parsed `--faults`.
#[derive(Clone, Debug)]
pub struct FaultList(pub Vec<FaultKind>);

fn parse_faults(s: &str) -> Result<FaultList, String> {
    FaultKind::parse_list(s).map(FaultList)
}

fn positive(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(x) if x.is_finite() && x > 0.0 => Ok(x),
        _ => Err(format!("{s:?} is not a finite number above 0")),
    }
}

/// `kvengine bench soak` flags.
#[derive(Debug, clap::Args)]
pub struct SoakArgs {
    /// Wall seconds of the whole run: warm-up, faults and checkpoints.
    #[arg(long, default_value_t = 60, env = "KVENGINE_SOAK_DURATION_S",
          value_parser = clap::value_parser!(u64).range(10..=604_800))]
    pub duration_s: u64,
    /// Simulated workers.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(2..=64))]
    pub workers: u32,
    /// The router's engine cores (`kvengine serve --cores`).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub cores: u16,
    /// Completions per second through the OpenAI front door.
    #[arg(long, default_value_t = 20.0, value_parser = positive)]
    pub rate: f64,
    /// `/v1/route` probes per second (the latency figures).
    #[arg(long, default_value_t = 50.0, value_parser = positive)]
    pub route_rate: f64,
    /// KV-cache blocks per worker (small, so caches evict all the time).
    #[arg(long, default_value_t = 1024,
          value_parser = clap::value_parser!(u32).range(64..u32::MAX as i64))]
    pub kv_blocks: u32,
    /// The workers' simulated time runs this many times faster than real time.
    #[arg(long, default_value_t = 20.0, value_parser = positive)]
    pub speedup: f64,
    /// Fault kinds, comma separated: publisher_restart, dropped_batches, slow_consumer,
    /// worker_http_failure, router_restart, all or none.
    #[arg(long, default_value = "all", value_parser = parse_faults)]
    pub faults: FaultList,
    /// Quiet seconds before each fault [default: a 25th of the duration, 2-20].
    #[arg(long, value_parser = positive)]
    pub quiet_s: Option<f64>,
    /// Warm-up seconds, left out of the latency and RSS figures [default: 15% of the
    /// duration, 5-120].
    #[arg(long, value_parser = positive)]
    pub warmup_s: Option<f64>,
    /// Batches of each slow-consumer burst.
    #[arg(long, default_value_t = 5000,
          value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub burst_batches: u32,
    /// Seed of the workload and the fault choices.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Write the whole report here as JSON.
    #[arg(long, env = "KVENGINE_SOAK_JSON")]
    pub json: Option<PathBuf>,
    /// Write an SVG (resident set and route p99 over time) here.
    #[arg(long, env = "KVENGINE_SOAK_PLOT")]
    pub plot: Option<PathBuf>,
    /// Where the router's state directory and logs go [default: a new temporary directory,
    /// removed at the end unless the run found lost or stale entries].
    #[arg(long)]
    pub work_dir: Option<PathBuf>,
    /// Keep the work directory.
    #[arg(long)]
    pub keep_work_dir: bool,
}

impl SoakArgs {
    /// The configuration, with the router run as `router_exe`.
    pub fn config(&self, router_exe: PathBuf) -> SoakConfig {
        SoakConfig {
            router_exe,
            duration: Duration::from_secs(self.duration_s),
            workers: self.workers as usize,
            cores: self.cores,
            seed: self.seed,
            rate: self.rate,
            route_rate: self.route_rate,
            engine: EngineConfig {
                kv_blocks: self.kv_blocks,
                ..EngineConfig::default()
            },
            speedup: self.speedup,
            faults: self.faults.0.clone(),
            quiet: self.quiet_s.map(Duration::from_secs_f64),
            warmup: self.warmup_s.map(Duration::from_secs_f64),
            burst_batches: self.burst_batches,
            replay_buffer: (self.burst_batches as usize * 2).max(16_384),
            work_dir: self.work_dir.clone(),
            keep_work_dir: self.keep_work_dir,
            progress: true,
        }
    }
}

/// Runs `kvengine bench soak`: prints the headline figures as JSON, writes the report
/// (`--json`) and the plot (`--plot`), then fails if entries were lost or stale.
pub fn cli(args: &SoakArgs, router_exe: PathBuf) -> Result<()> {
    let report = run(&args.config(router_exe))?;
    let headline = serde_json::json!({
        "acknowledged_lost": report.acknowledged_lost,
        "stale_entries": report.stale_entries,
        "unacknowledged_lost": report.unacknowledged_lost,
        "faults_injected": report.faults_injected,
        "rss_growth_ratio": report.rss_growth_ratio,
        "route_p99_ms_quiet": report.route_p99_ms_quiet,
        "route_p99_ms_faults": report.route_p99_ms_faults,
        "goals": report.goals,
        "router": report.router,
        "checkpoints": report.checkpoints.len(),
        "duration_s": report.duration_s,
    });
    println!("{}", serde_json::to_string_pretty(&headline)?);
    if let Some(path) = &args.json {
        crate::write_json(&report, path)?;
    }
    if let Some(path) = &args.plot {
        plot::write_svg(&report, path)?;
    }
    let g = &report.goals;
    if !g.every_fault_injected {
        eprintln!("kvengine soak: warning: not every fault kind was injected (run longer)");
    }
    if !g.rss_flat {
        eprintln!(
            "kvengine soak: warning: resident set grew by a factor {:.3} after the warm-up",
            report.rss_growth_ratio
        );
    }
    if !g.route_p99_within_2x {
        eprintln!(
            "kvengine soak: warning: route p99 {:.2} ms during faults, {:.2} ms quiet",
            report.route_p99_ms_faults, report.route_p99_ms_quiet
        );
    }
    if report.unacknowledged_lost > 0 {
        eprintln!(
            "kvengine soak: warning: {} cached blocks came from batches the router never \
             received (a restarted worker's first batches; see the report's checkpoints)",
            report.unacknowledged_lost
        );
    }
    if !(g.no_acknowledged_loss && g.no_stale_entries) {
        bail!(
            "the index lost {} acknowledged entries and kept {} stale ones (see the report)",
            report.acknowledged_lost,
            report.stale_entries
        );
    }
    Ok(())
}
