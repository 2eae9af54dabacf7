//! The setup core's work: everything the router starts besides the engine and the core
//! threads ([`serve`]: registrations and subscriptions, the config file's reload task,
//! simulated workers, QUIC, replicas, snapshots, the app and its health checks, then HTTP
//! until stop), and what both layouts need to get there ([`hub_for`], [`edge_tls`],
//! [`print_pinning`]). The layouts (`layout`) decide on which thread it runs.

use crate::serve::args::{ServeArgs, config_workers, load_tokenizer};
#[cfg(unix)]
use crate::serve::reload::reload_on_sighup;
use crate::serve::reload::{file_stamp, register_file_workers};
use anyhow::{Context, Result};
use engine::WorkerId;
use engine::approx::ApproxConfig;
use engine::router::ModelSpec;
use lab::workers::{SimRole, SimWorkerConfig, SimWorkerHandle, spawn_mixed_cluster};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use transport::cores::Homes;
use transport::http::conn::Edge;
use transport::http::{HttpConfig, health::health_loop, router};
use transport::hub::{Hub, Registration};
use transport::native::{QuicServerConfig, TlsSource, serve_quic};
use transport::openai::proxy::{ProxyConfig, openai_router};
use transport::openai::tokenize::PromptTokenizer;
use transport::outbound::Outbound;
use transport::sources::{Sources, SourcesConfig};
use transport::trtllm::TrtllmSource;
use transport::zmq::{SubscriberConfig, ZmqSource};

/// Prints whether (and how) the core threads are pinned to CPUs.
pub(super) fn print_pinning(no_pin: bool, pinned: &[Option<usize>]) {
    let cores = pinned.len();
    let pinned_count = pinned.iter().flatten().count();
    if no_pin {
        println!("kvengine: pinning disabled (--no-pin)");
    } else if pinned_count < cores {
        println!(
            "kvengine: pinned {pinned_count} of {cores} core threads; the other {} share CPUs \
             (more core threads than CPUs)",
            cores - pinned_count
        );
    } else {
        println!("kvengine: every core thread pinned to its own CPU");
    }
}

/// The hub with the router's bounds, and without KV events where `--no-kv-events` says so.
pub(super) fn hub_for(args: &ServeArgs, hub: Hub) -> Result<Arc<Hub>> {
    let hub = hub.with_limits(args.limits()).with_shadow(args.shadow);
    Ok(Arc::new(if args.approximate() {
        hub.without_kv_events(ApproxConfig::default())?
    } else {
        hub
    }))
}

/// What the setup core starts with besides the hub: the edge's TLS and the state directory.
pub(super) struct Startup {
    pub(super) tls: Option<EdgeTls>,
    pub(super) warm: Option<crate::warm::Warm>,
    /// The sharding policy (snapshots record it).
    pub(super) policy: String,
    /// Where the cores' listeners place connections (`--edge-fill`; the edge on the cores).
    pub(super) placement: Option<std::sync::Arc<transport::http::placement::Placement>>,
}

/// The setup and this thread's share of the edge: registrations and subscriptions, simulated
/// workers, QUIC, the app (shared with the other cores through `share`), health checks;
/// then HTTP (over `tls` when given) on `listener` until `stop`.
pub(super) async fn serve(
    hub: Arc<Hub>,
    args: &ServeArgs,
    mut stop: tokio::sync::watch::Receiver<bool>,
    listener: tokio::net::TcpListener,
    spawner: Homes,
    share: Option<tokio::sync::watch::Sender<Option<Edge>>>,
    Startup {
        tls,
        warm,
        policy,
        placement,
    }: Startup,
) -> Result<()> {
    let outbound = Outbound::new(args.worker_ca.as_deref()).context("--worker-ca")?;
    if args.worker_ca.is_some() {
        println!(
            "kvengine: https:// workers are verified against {}",
            outbound.trust()
        );
    }
    let sources = Sources::on_current(
        hub.clone(),
        SourcesConfig {
            zmq: SubscriberConfig {
                limits: transport::zmq::zmtp::Limits {
                    max_message_bytes: args.zmq_max_message_bytes,
                    ..Default::default()
                },
                ..SubscriberConfig::default()
            },
            outbound: outbound.clone(),
            homes: Some(spawner.clone()),
        },
    );
    // Before any subscription starts: restored workers get their resume points.
    let restoring = match warm.as_ref().and_then(|w| w.plan.as_ref()) {
        Some(plan) => Some(transport::state::begin_restore(&hub, plan)?),
        None => None,
    };
    for source in &args.zmq_workers {
        hub.register(Registration {
            zmq: Some(source.publisher.clone()),
            replay: source.replay.clone(),
            ..Registration::new(source.worker)
        })?;
        println!("kvengine: subscribing to worker {source}");
        sources.subscribe(source.clone());
    }
    for source in &args.trtllm_workers {
        hub.register(Registration {
            url: Some(source.url.to_string()),
            trtllm_poll: Some(source.poll_interval),
            ..Registration::new(source.worker)
        })?;
        println!("kvengine: polling TensorRT-LLM worker {source}");
        sources.poll(source.clone());
    }
    // Taken before the file is read: a change from here on is reloaded.
    let stamp = args.config.as_deref().and_then(file_stamp);
    let (file_workers, models) = config_workers(args)?;
    let mut model_tokenizers = std::collections::HashMap::new();
    for m in &models {
        hub.declare_model(&ModelSpec {
            name: m.name.clone(),
            block_size: m.block_size,
        })?;
        if let Some(spec) = &m.tokenizer
            && let Some(t) =
                load_tokenizer(spec).with_context(|| format!("model {:?}: tokenizer", m.name))?
        {
            model_tokenizers.insert(m.name.clone(), t);
        }
        println!(
            "kvengine: serving model {:?} (block size {})",
            m.name,
            hub.routing().block_size_in(&m.name)
        );
    }
    register_file_workers(&hub, &sources, &file_workers)?;
    #[cfg(unix)]
    if let Some(path) = args.config.clone() {
        // The file's own workers: those given with --worker are not the file's to remove.
        let known = file_workers
            .iter()
            .filter(|w| !args.workers.iter().any(|c| c.id == w.id))
            .map(|w| w.id)
            .collect();
        // Installed here, before the router says it is up: a SIGHUP that came before the
        // reload task first ran would otherwise take the default action and end the process.
        let hup = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::warn!("cannot watch SIGHUP (reloads on file changes only): {e}");
                None
            }
        };
        tokio::spawn(reload_on_sighup(
            path,
            stamp,
            known,
            hub.clone(),
            sources.clone(),
            spawner.clone(),
            hup,
        ));
    }

    let tokenizer = match &args.tokenizer {
        Some(spec) => load_tokenizer(&spec.to_string_lossy()).context("--tokenizer")?,
        None => None,
    };
    let sims = start_sim_workers(&hub, &sources, args, tokenizer.clone()).await?;
    for r in &args.disagg.worker_roles {
        hub.register(Registration {
            role: Some(r.role),
            bootstrap_port: r.bootstrap_port,
            ..Registration::new(r.worker)
        })?;
        println!("kvengine: worker {} is a {} worker", r.worker, r.role);
    }

    let quic = match args.quic {
        Some(listen) => {
            let tls = match (&args.tls_cert, &args.tls_key) {
                (Some(cert), Some(key)) => TlsSource::Files {
                    cert: cert.clone(),
                    key: key.clone(),
                },
                _ => TlsSource::SelfSigned {
                    names: vec!["localhost".into(), listen.ip().to_string()],
                },
            };
            let config = QuicServerConfig {
                credentials: args.ingest_credentials()?,
                // Each publisher's batches run on its worker's home core.
                homes: Some(spawner.clone()),
                hello_timeout: Duration::from_millis(args.quic_hello_timeout_ms),
                max_unauthenticated: args.quic_max_unauthenticated as usize,
                ..QuicServerConfig::new(listen, String::new(), tls)
            };
            let server = serve_quic(hub.clone(), config).await.context("--quic")?;
            println!(
                "kvengine: QUIC ingest on {} (ALPN kvengine/1), certificate sha256 {}",
                server.local_addr(),
                server.fingerprint()
            );
            Some(server)
        }
        None => None,
    };

    // After the configured workers are registered: peers' requests on them then apply.
    let replica_link = crate::replicas::start(&hub, &args.replicas).await?;
    if let (Some(done), Some(w)) = (restoring, &warm)
        && let Some(plan) = &w.plan
    {
        let r = transport::state::finish_restore(&hub, plan, done, &args.worker_hosts, &sources)?;
        println!(
            "kvengine: restore: {} worker(s) resume from the snapshot, {} cleared, {} \
             re-registered, {} refused",
            r.kept, r.cleared, r.registered, r.refused
        );
    }
    let snapshots = warm.as_ref().and_then(|w| {
        let (dir, every) = w.dir.as_ref().zip(w.interval)?;
        Some(tokio::spawn(transport::state::snapshot_every(
            hub.clone(),
            dir.clone(),
            w.policy.clone(),
            every,
        )))
    });
    let peer_snapshots = replica_link
        .as_ref()
        .and_then(|link| crate::replicas::put_snapshots(&hub, link, &args.replicas, &policy));
    let app = router(
        hub.clone(),
        HttpConfig {
            max_body_bytes: args.body_limit(),
            max_prompt_tokens: args
                .prompt_cap()
                .unwrap_or(transport::http::DEFAULT_MAX_PROMPT_TOKENS),
            sources: Some(sources.clone()),
            admin_token: args.admin_token.clone().filter(|t| !t.is_empty()),
            routing_token: args.routing_token.clone().filter(|t| !t.is_empty()),
            body_timeout: Duration::from_secs_f64(args.http_body_timeout_secs.max(0.001)),
            worker_hosts: args.worker_hosts.clone(),
            homes: Some(spawner.clone()),
        },
    )
    .merge(openai_router(
        hub.clone(),
        ProxyConfig {
            tokenizer,
            model_tokenizers,
            max_body_bytes: args.body_limit(),
            max_prompt_tokens: args.prompt_cap(),
            body_timeout: Duration::from_secs_f64(args.http_body_timeout_secs.max(0.001)),
            disagg: args.disagg.config()?,
            outbound: outbound.clone(),
            ..ProxyConfig::default()
        },
    ));
    let edge = Edge {
        router: app,
        tls: tls.clone(),
        limits: args.conn_limits(),
        counters: hub.metrics().edge.clone(),
        placement,
    };
    if let Some(share) = share {
        let _ = share.send(Some(edge.clone()));
    }
    let addr = listener.local_addr().context("HTTP listener")?;
    if let Some(warning) = control_plane_warning(args, addr) {
        tracing::warn!("{warning}");
    }
    let scheme = if tls.is_some() { "https" } else { "http" };
    println!(
        "kvengine: HTTP on {scheme}://{addr} (OpenAI /v1/chat/completions and \
         /v1/completions; /v1/route, /v1/events, /v1/workers, /metrics)"
    );
    let interval = Duration::from_secs_f64(args.health_interval_secs.max(0.01));
    let health = tokio::spawn(health_loop(
        hub.clone(),
        interval,
        interval.min(Duration::from_secs(2)),
        args.health_failures,
        outbound.clone(),
    ));
    let events = match args.approximate() {
        true => " without KV events (approximate)",
        false => "",
    };
    println!(
        "kvengine: routing mode {}{events}; Ctrl-C stops",
        args.router_mode
    );

    let shutdown = async move {
        let _ = stop.wait_for(|s| *s).await;
    };
    // This is core 0 (or the one listener of the layout with HTTP threads).
    let served = transport::http::conn::serve_on_core(listener, edge, 0, shutdown).await;
    health.abort();
    if let Some(s) = snapshots {
        s.abort();
    }
    sources.shutdown().await;
    if let Some(p) = peer_snapshots {
        p.abort();
    }
    if let Some(w) = &warm
        && let Some(dir) = &w.dir
    {
        // The subscriptions are stopped: this snapshot holds everything they applied.
        if transport::state::save_now(&hub, dir, &w.policy).await {
            println!(
                "kvengine: snapshot written to {}",
                dir.snapshot_path().display()
            );
        }
    }
    if let Some(q) = quic {
        q.close();
    }
    if let Some(link) = replica_link {
        link.shutdown().await;
    }
    for w in sims {
        w.shutdown().await;
    }
    served.context("HTTP edge")
}

/// `--sim-workers N`: simulated vLLM workers on free loopback ports, worker ids 1..=N, each
/// registered with its URL and subscribed to (unless KV events are off).
async fn start_sim_workers(
    hub: &Hub,
    sources: &Sources,
    args: &ServeArgs,
    tokenizer: Option<Arc<PromptTokenizer>>,
) -> Result<Vec<SimWorkerHandle>> {
    if args.sim_workers == 0 {
        return Ok(Vec::new());
    }
    let mut base = SimWorkerConfig {
        speedup: args.sim_speedup,
        events: args.sim_engine,
        ..SimWorkerConfig::default()
    };
    base.engine.block_size = args.block_size()?;
    if let Some(blocks) = args.sim_kv_blocks {
        base.engine.kv_blocks = blocks;
    }
    let (p, d) = (
        usize::from(args.sim_prefill_workers),
        usize::from(args.sim_decode_workers),
    );
    let roles: Vec<SimRole> = (0..usize::from(args.sim_workers))
        .map(|i| match i {
            i if i < p => SimRole::Prefill,
            i if i < p + d => SimRole::Decode,
            _ => SimRole::Aggregated,
        })
        .collect();
    let workers = spawn_mixed_cluster(&roles, base, tokenizer)
        .await
        .context("--sim-workers")?;
    for (i, w) in workers.iter().enumerate() {
        let id = WorkerId(i as u64 + 1);
        let (zmq, replay) = (w.zmq_endpoint().to_owned(), w.replay_endpoint().to_owned());
        let role = w.role();
        let mut reg = w.registration(id);
        if args.approximate() {
            (reg.zmq, reg.replay) = (None, None);
        }
        hub.register(reg)?;
        if !args.approximate() && w.is_trtllm() {
            let source = TrtllmSource::new(id, &w.url(), transport::trtllm::DEFAULT_POLL_INTERVAL)?;
            sources.poll(source);
        } else if !args.approximate() {
            sources.subscribe(ZmqSource::new(id, &zmq, Some(&replay))?);
        }
        println!("kvengine: simulated worker {id} ({role}) at {}", w.url());
    }
    Ok(workers)
}

/// The HTTP edge's TLS settings (`--tls-cert` / `--tls-key`), if it serves HTTPS.
pub(super) fn edge_tls(args: &ServeArgs) -> Result<Option<EdgeTls>> {
    match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => Ok(Some(
            transport::http::edge_tls::server_config(cert, key)
                .context("--tls-cert / --tls-key")?,
        )),
        _ => Ok(None),
    }
}

pub(super) type EdgeTls = Arc<transport::http::edge_tls::TlsServerConfig>;

/// What to warn about at start when the control plane (registering workers, KV events,
/// load) is served without a token on an address others can reach: the loopback-only rule
/// then stands between anyone on the network and the router's index, and any proxy or
/// sidecar on this host that forwards traffic makes every client look local.
pub(crate) fn control_plane_warning(args: &ServeArgs, addr: SocketAddr) -> Option<String> {
    let token = args.admin_token.as_deref().is_some_and(|t| !t.is_empty());
    (!token && !addr.ip().is_loopback()).then(|| {
        format!(
            "the control plane (POST /v1/workers, /v1/events, /v1/load) is served on {addr} \
             without --admin-token: it is refused to other hosts, but every client behind a \
             proxy or sidecar on this host arrives from 127.0.0.1 and passes; set \
             --admin-token (KVENGINE_ADMIN_TOKEN) (docs/api.md \"Security\")"
        )
    })
}
