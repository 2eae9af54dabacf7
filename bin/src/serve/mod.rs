//! `kvengine [serve]`: the router: engine, ingest transports and the HTTP edge in one
//! process.
//!
//! Starts one core thread per core (`--cores`, default: the CPUs this process may use),
//! pinned where a CPU exists. Each core thread runs a single-threaded tokio runtime that
//! serves its share of the HTTP edge (`--http-port`, one `SO_REUSEPORT` listener per core),
//! the subscriptions to the vLLM/SGLang KV events of the `--zmq-worker`s homed on it (and of
//! workers registered later over HTTP with a `zmq` endpoint), and its engine core in between
//! (`transport::cores`); core 0 also accepts native publishers (`--quic`).
//! Waits for SIGINT or SIGTERM; then stops accepting, lets each core drain what it was sent,
//! joins them and prints their figures.
//!
//! Flags follow Dynamo's router where one exists (`--router-mode`, `--kv-cache-block-size`,
//! `--router-temperature`, `--kv-overlap-score-weight`, `--kv-events/--no-kv-events`,
//! `--http-port`), so an operator can switch without relearning.
//!
//! The parts, each using only those after it: this file checks the flags and picks a layout
//! ([`run`]); `layout` starts the core threads (or the HTTP threads) and the hub; `setup`
//! is the setup core's work (registrations, sources, QUIC, replicas, the app, HTTP);
//! `reload` registers the config file's workers, at start and on changes; `args` holds the
//! flags. Children name what they use by its path (`crate::serve::args::..`), never
//! `super`, so no part reaches back up.

use anyhow::{Context, Result, bail};
use engine::runtime::RuntimeConfig;
use engine::sharding::choice::Sharding;
use std::time::Duration;
use transport::hub::HubConfig;

mod args;
mod layout;
mod reload;
mod setup;

pub use args::ServeArgs;
use args::{STAND_IN, config_workers};
use layout::{run_on_cores, run_threaded};
#[cfg(test)]
pub(crate) use setup::control_plane_warning;

pub fn run(args: &ServeArgs) -> Result<()> {
    crate::logging::init("info", args.log_format);
    let available = std::thread::available_parallelism().map_or(1, |n| n.get());
    let cores = args.cores.map_or(available, usize::from);
    transport::cores::set_idle_polls(args.core_idle_polls);
    let scheduler = args.scheduler()?;
    if args.quic.is_some() && args.ingest_credentials()?.is_empty() {
        bail!(
            "--quic needs --ingest-token, --scoped-ingest-token or --ingest-token-file (or \
             KVENGINE_INGEST_TOKEN, ..._SCOPED_INGEST_TOKEN, ..._INGEST_TOKEN_FILE): \
             publishers must authenticate"
        );
    }
    if u32::from(args.sim_prefill_workers) + u32::from(args.sim_decode_workers)
        > u32::from(args.sim_workers)
    {
        bail!("--sim-prefill-workers plus --sim-decode-workers exceed --sim-workers");
    }
    args.disagg.config()?;
    if args.sim_workers > 0 && !(args.sim_speedup.is_finite() && args.sim_speedup > 0.0) {
        bail!("--sim-speedup must be a finite number above 0");
    }
    if args.approximate() && !args.zmq_workers.is_empty() {
        bail!("--zmq-worker subscribes to KV events, which --no-kv-events turns off");
    }
    if args.approximate() && !args.trtllm_workers.is_empty() {
        bail!("--trtllm-worker polls KV events, which --no-kv-events turns off");
    }
    let (workers, models) = config_workers(args)?;
    // A publishing worker whose model has no tokenizer of its own falls back to
    // --tokenizer: that must then be given.
    let own_tokenizer = |m: &Option<String>| {
        models
            .iter()
            .any(|e| Some(&e.name) == m.as_ref() && e.tokenizer.is_some())
    };
    let untokenized_publishers = workers.iter().any(|w| {
        (w.zmq.is_some() || w.kv_events_config.is_some() || w.is_trtllm())
            && !own_tokenizer(&w.model)
    });
    if args.tokenizer.is_none()
        && (!args.zmq_workers.is_empty()
            || !args.trtllm_workers.is_empty()
            || untokenized_publishers)
        && scheduler.mode == engine::sched::RouteMode::Kv
    {
        bail!(
            "real workers (--zmq-worker, --trtllm-worker) and no --tokenizer: the OpenAI \
             front door would \
             tokenize prompts with the one-token-per-word stand-in, no block would ever match \
             what the workers cache, and kv routing would become load balancing. Pass \
             --tokenizer <the model's tokenizer directory or tokenizer.json>, or \
             --tokenizer {STAND_IN} to use the stand-in anyway (when clients send token ids \
             to /v1/route only)"
        );
    }
    let rx = crate::signals::stop_channel()?;

    let sharding = Sharding::configured(cores, args.replicate_depth, args.junction_fanout)
        .context("invalid sharding flags")?;
    println!(
        "kvengine: {cores} core thread(s) up ({available} CPU(s) available); sharding {}",
        sharding.describe()
    );
    println!("kvengine: {}", crate::memory::huge_pages().describe());
    let engine = RuntimeConfig {
        ring_capacity: args.ring_capacity as usize,
        pin_cores: !args.no_pin,
        call_timeout: Duration::from_millis(args.engine_timeout_ms),
        max_blocks_per_key: args.limits().max_blocks_per_key,
        ..RuntimeConfig::default()
    };
    let summaries = match args.http_threads {
        Some(n) => run_threaded(
            args,
            HubConfig { scheduler },
            sharding,
            engine,
            n.into(),
            rx,
        )?,
        None => run_on_cores(args, HubConfig { scheduler }, sharding, engine, rx)?,
    };
    for s in &summaries {
        println!(
            "kvengine: {} applied {} block ops, answered {} queries, {} entries live",
            s.shard, s.applied, s.queries, s.index.entries
        );
    }
    println!("kvengine: stopped");
    Ok(())
}
