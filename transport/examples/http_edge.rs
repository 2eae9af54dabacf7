//! The HTTP edge over a 2-core engine, preloaded with overlapping prefixes, for load tests
//! (`benches/http_route/run.sh` drives it with wrk).
//!
//! ```text
//! cargo run --release -p kvengine-transport --example http_edge -- [PORT] [REQUEST_TIMEOUT_SECS]
//! ```
//!
//! 8 workers; 16 "system prompts" of 6,000 tokens (375 blocks, token ids
//! `1000 * p + i`), worker `w` caching prompts `w` and `w + 8` in full and the first half of
//! prompt `(w + 1) % 16`. Requests routed and never freed expire after
//! `REQUEST_TIMEOUT_SECS` (default 2), standing in for completions.

use engine::event::{KvEvent, StoredBlock};
use engine::hash::{lora_seed, tokens_hash};
use engine::runtime::RuntimeConfig;
use engine::sched::SchedulerConfig;
use engine::{EngineHash, WorkerId, WorkerKey};
use std::sync::Arc;
use std::time::Duration;
use transport::http::{HttpConfig, router, serve_http};
use transport::hub::{HubConfig, Registration, start_engine};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const WORKERS: u64 = 8;
const PROMPTS: u32 = 16;
const PROMPT_TOKENS: u32 = 6_000;

/// Token `i` of system prompt `p`.
fn system_prompt(p: u32) -> Vec<u32> {
    (0..PROMPT_TOKENS).map(|i| 1_000 * p + i).collect()
}

fn stored(tokens: &[u32], first_hash: u64) -> KvEvent {
    KvEvent::Stored {
        parent: None,
        blocks: tokens
            .chunks_exact(16)
            .enumerate()
            .map(|(i, c)| StoredBlock {
                engine_hash: EngineHash(first_hash + i as u64),
                tokens_hash: tokens_hash(c, lora_seed(None)),
            })
            .collect(),
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let port: u16 = args.next().map_or(Ok(8088), |a| a.parse())?;
    let timeout: u64 = args.next().map_or(Ok(2), |a| a.parse())?;

    let config = HubConfig {
        scheduler: SchedulerConfig {
            request_timeout: Duration::from_secs(timeout),
            ..SchedulerConfig::default()
        },
    };
    let engine = RuntimeConfig {
        pin_cores: false,
        ingest_handles: 1,
        query_handles: 2,
        ..RuntimeConfig::default()
    };
    let (hub, runtime) = start_engine(config, 2, 4, engine)?;
    let hub = Arc::new(hub);
    for w in 0..WORKERS {
        hub.register(Registration::new(WorkerId(w)))?;
        let key = WorkerKey::new(w, 0);
        let mut next_hash = w << 32;
        let w32 = w as u32;
        for (p, len) in [
            (w32, PROMPT_TOKENS as usize),
            (w32 + 8, PROMPT_TOKENS as usize),
            ((w32 + 1) % PROMPTS, PROMPT_TOKENS as usize / 2),
        ] {
            let tokens = system_prompt(p);
            let tokens = tokens.get(..len).unwrap_or(&tokens);
            hub.ingest(key, vec![stored(tokens, next_hash)])?;
            next_hash += tokens.len() as u64;
        }
    }
    hub.sync()?;
    hub.refresh_cached_blocks()?;
    eprintln!("preloaded {WORKERS} workers; serving on 127.0.0.1:{port}");

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
        let app = router(hub.clone(), HttpConfig::default());
        serve_http(listener, app, std::future::pending()).await?;
        Ok::<_, Box<dyn std::error::Error>>(())
    })?;
    drop(hub);
    let _ = runtime.join();
    Ok(())
}
