//! `kvengine publish --quic ADDR --events FILE.jsonl`: send KV events to a kvengine over the
//! native protocol (QUIC + rkyv).
//!
//! Each line of the file is one batch in the shape `POST /v1/events` takes
//! (`{"worker_id", "dp_rank"?, "seq"?, "events": [...]}`). Token ids are hashed here with the
//! router's block size, so the router receives hashed blocks (the protocol's fast path).
//! One connection per worker id; batches keep their file order per worker. A line that does
//! not parse stops the run with its line number (nothing after it is sent).

use anyhow::{Context, Result};
use clap::Args;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use transport::json_events::{parse_events_body, to_engine};
use transport::native::{NativeEvent, Publisher, PublisherConfig, Trust};

/// `kvengine publish` flags.
#[derive(Debug, Args)]
pub struct PublishArgs {
    /// The router's QUIC address.
    #[arg(long, env = "KVENGINE_PUBLISH_QUIC")]
    quic: SocketAddr,
    /// JSON lines of event batches (see `docs/api.md`, `POST /v1/events`).
    #[arg(long, env = "KVENGINE_PUBLISH_EVENTS")]
    events: PathBuf,
    /// An ingest token the router accepts for every worker in the file (its
    /// --ingest-token, or a --scoped-ingest-token covering them).
    #[arg(long, env = "KVENGINE_INGEST_TOKEN", hide_env_values = true)]
    ingest_token: String,
    /// Trust the router's certificate by its SHA-256 fingerprint (hex, as the router logs it).
    #[arg(
        long,
        env = "KVENGINE_PUBLISH_FINGERPRINT",
        required_unless_present = "ca"
    )]
    fingerprint: Option<String>,
    /// Or trust certificates signed by this CA (PEM).
    #[arg(long, env = "KVENGINE_PUBLISH_CA", conflicts_with = "fingerprint")]
    ca: Option<PathBuf>,
    /// The name the router's certificate is for.
    #[arg(
        long,
        env = "KVENGINE_PUBLISH_SERVER_NAME",
        default_value = "localhost"
    )]
    server_name: String,
    /// Tokens per block (the router's --kv-cache-block-size).
    #[arg(long, env = "KVENGINE_KV_CACHE_BLOCK_SIZE", default_value_t = 16,
          value_parser = clap::value_parser!(u32).range(1..=65536))]
    kv_cache_block_size: u32,
}

/// One worker's batches: `(dp_rank, seq, events)` in file order.
type Batches = Vec<(u32, Option<u64>, Vec<NativeEvent>)>;

fn read_batches(args: &PublishArgs) -> Result<BTreeMap<u64, Batches>> {
    let text = std::fs::read_to_string(&args.events)
        .with_context(|| format!("reading {}", args.events.display()))?;
    let mut by_worker: BTreeMap<u64, Batches> = BTreeMap::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let where_ = || format!("{}:{}", args.events.display(), i + 1);
        let body = parse_events_body(line.as_bytes()).with_context(where_)?;
        let events = body
            .events
            .iter()
            .map(|e| to_engine(e, args.kv_cache_block_size).map(|e| NativeEvent::from_engine(&e)))
            .collect::<Result<Vec<_>, _>>()
            .with_context(where_)?;
        by_worker.entry(body.worker_id).or_default().push((
            body.dp_rank.unwrap_or(0),
            body.seq,
            events,
        ));
    }
    Ok(by_worker)
}

pub fn run(args: &PublishArgs) -> Result<()> {
    let by_worker = read_batches(args)?;
    let trust = match (&args.fingerprint, &args.ca) {
        (Some(f), _) => Trust::Fingerprint(f.clone()),
        (None, Some(ca)) => Trust::CaPem(ca.clone()),
        (None, None) => anyhow::bail!("--fingerprint or --ca is required"),
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("tokio runtime")?;
    rt.block_on(async {
        for (worker, batches) in by_worker {
            let mut ranks: Vec<u32> = batches.iter().map(|b| b.0).collect();
            ranks.sort_unstable();
            ranks.dedup();
            let mut publisher = Publisher::connect(PublisherConfig {
                server: args.quic,
                server_name: args.server_name.clone(),
                trust: trust.clone(),
                token: args.ingest_token.clone(),
                worker_id: worker,
                dp_ranks: ranks,
                block_size: args.kv_cache_block_size,
                instance: 0,
            })
            .await
            .with_context(|| format!("connecting as worker {worker}"))?;
            for (dp_rank, seq, events) in &batches {
                match seq {
                    Some(s) => publisher.send_with_seq(*dp_rank, *s, events).await?,
                    None => {
                        publisher.send(*dp_rank, events).await?;
                    }
                }
            }
            let done = publisher.finish().await?;
            println!(
                "kvengine publish: worker {worker}: {} batches, {} events accepted by the router",
                done.batches, done.events
            );
        }
        Ok(())
    })
}
