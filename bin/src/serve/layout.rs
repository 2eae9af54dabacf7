//! The two process layouts: the edge on the cores (the default) and the comparison layout
//! with HTTP threads of their own; the listeners and the edge's TLS.

use crate::serve::args::ServeArgs;
use crate::serve::setup::{Startup, edge_tls, hub_for, print_pinning, serve};
use anyhow::{Context, Result, bail};
use engine::runtime::{CoreSummary, RuntimeConfig, start_hosted_from};
use engine::sharding::choice::Sharding;
use std::sync::Arc;
use transport::cores::{self, Homes};
use transport::http::conn::Edge;
use transport::hub::{Hub, HubConfig, start_engine_from};

/// The default layout: the edge on the cores. Each core thread runs a single-threaded
/// runtime that accepts its share of HTTP connections (one `SO_REUSEPORT` listener per
/// core), runs the subscriptions of the workers homed on it, and steps its engine core in
/// between (`transport::cores`). Core 0 also runs the setup, QUIC, the simulated workers and
/// the health checks. No other thread serves requests.
pub(super) fn run_on_cores(
    args: &ServeArgs,
    config: HubConfig,
    sharding: Sharding,
    engine: RuntimeConfig,
    stop: tokio::sync::watch::Receiver<bool>,
) -> Result<Vec<CoreSummary>> {
    let policy = sharding.describe();
    let shards = engine::sharding::ShardPolicy::shards(&sharding);
    let mut peer = crate::replicas::fetch_snapshot(&args.replicas);
    let (hosted, warm) = crate::warm::start_engine(
        peer.snapshot.take(),
        args.state_dir.as_deref(),
        args.snapshot_interval_s,
        shards,
        &policy,
        |image| start_hosted_from(sharding.clone(), engine, image),
    )?;
    let cores = hosted.cores.len();
    let hub = hub_for(args, Hub::hosted(config, hosted.ingest, hosted.query)?)?;
    peer.record(&hub);
    if let Some(w) = &warm {
        w.record(&hub);
    }
    let mut warm = warm;
    let listeners = reuseport_listeners(&args.http_host, args.http_port, cores)?;
    let (handle_tx, handle_rx) = std::sync::mpsc::channel();
    let (app_tx, app_rx) = tokio::sync::watch::channel::<Option<Edge>>(None);
    let mut app_tx = Some(app_tx);
    let mut handle_rx = Some(handle_rx);
    let shared_tls = edge_tls(args)?;
    let placement = (args.edge_fill > 0.0 && cores > 1)
        .then(|| transport::http::placement::Placement::new(cores, args.edge_fill));
    let results: Vec<Result<CoreSummary>> = std::thread::scope(|scope| {
        let mut threads = Vec::with_capacity(cores);
        for (k, (host, listener)) in hosted.cores.into_iter().zip(listeners).enumerate() {
            let (hub, stop, handle_tx, app_rx, tls, policy, placement) = (
                hub.clone(),
                stop.clone(),
                handle_tx.clone(),
                app_rx.clone(),
                shared_tls.clone(),
                policy.clone(),
                placement.clone(),
            );
            let setup = if k == 0 {
                app_tx
                    .take()
                    .zip(handle_rx.take())
                    .map(|(a, h)| (a, h, warm.take()))
            } else {
                None
            };
            let thread = std::thread::Builder::new()
                .name(format!("kvengine-core-{k}"))
                .spawn_scoped(scope, move || -> Result<CoreSummary> {
                    let pinned = host.pin_current_thread();
                    let mut builder = tokio::runtime::Builder::new_current_thread();
                    builder.enable_all();
                    if let Some(p) = &placement {
                        // The busy shares the edge places connections by.
                        let (parks, wakes) = (p.clone(), p.clone());
                        builder
                            .on_thread_park(move || parks.parked(k))
                            .on_thread_unpark(move || wakes.woke(k));
                    }
                    let rt = builder.build().context("cannot start a core's runtime")?;
                    let _ = handle_tx.send((k, pinned, rt.handle().clone()));
                    drop(handle_tx);
                    cores::install(host);
                    let served = rt.block_on(async move {
                        tokio::spawn(cores::drive());
                        let listener =
                            tokio::net::TcpListener::from_std(listener).context("HTTP listener")?;
                        match setup {
                            Some((app_tx, handles, warm)) => {
                                let handles = collect_handles(handles, cores, args.no_pin)?;
                                let share = Some(app_tx);
                                let startup = Startup {
                                    tls,
                                    warm,
                                    policy,
                                    placement,
                                };
                                serve(hub, args, stop, listener, handles, share, startup).await
                            }
                            None => serve_share(listener, k, app_rx, stop).await,
                        }
                    });
                    // Ends every task left (subscriptions, connections, health checks).
                    drop(rt);
                    let summary = cores::finish().context("the core is gone")?;
                    served?;
                    Ok(summary)
                });
            match thread {
                Ok(t) => threads.push(t),
                Err(e) => {
                    tracing::error!("cannot start core thread {k}: {e}");
                    break;
                }
            }
        }
        drop((hub, handle_tx, app_tx, app_rx));
        threads
            .into_iter()
            .map(|t| {
                t.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("a core thread panicked")))
            })
            .collect()
    });
    if results.len() < cores {
        bail!("only {} of {cores} core threads started", results.len());
    }
    results.into_iter().collect()
}

/// The runtimes of every core, by core, as each thread reports its own (it also reports the
/// CPU it pinned itself to, printed here).
pub(super) fn collect_handles(
    rx: std::sync::mpsc::Receiver<(usize, Option<usize>, tokio::runtime::Handle)>,
    cores: usize,
    no_pin: bool,
) -> Result<Homes> {
    let mut handles: Vec<Option<tokio::runtime::Handle>> = vec![None; cores];
    let mut pinned = vec![None; cores];
    for _ in 0..cores {
        let (k, cpu, h) = rx
            .recv()
            .context("a core thread ended before its runtime started")?;
        if let (Some(slot), Some(p)) = (handles.get_mut(k), pinned.get_mut(k)) {
            (*slot, *p) = (Some(h), cpu);
        }
    }
    print_pinning(no_pin, &pinned);
    println!("kvengine: HTTP and ingest run on the core threads");
    let handles: Option<Vec<_>> = handles.into_iter().collect();
    Homes::new(handles.context("a core's runtime is missing")?).context("no core runtimes")
}

/// Another core's share of the HTTP edge: the edge core 0 built, on this core's listener.
pub(super) async fn serve_share(
    listener: tokio::net::TcpListener,
    core: usize,
    mut app: tokio::sync::watch::Receiver<Option<Edge>>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> Result<()> {
    let Ok(ready) = app.wait_for(Option::is_some).await else {
        // Core 0's setup failed; it reports why.
        return Ok(());
    };
    let Some(edge) = ready.clone() else {
        return Ok(());
    };
    let shutdown = async move {
        let _ = stop.wait_for(|s| *s).await;
    };
    transport::http::conn::serve_on_core(listener, edge, core, shutdown)
        .await
        .context("HTTP edge")
}

/// `cores` listeners on one address with `SO_REUSEPORT`, so the kernel spreads connections
/// over the cores (with port 0, the port the first one got).
pub(super) fn reuseport_listeners(
    host: &str,
    port: u16,
    cores: usize,
) -> Result<Vec<std::net::TcpListener>> {
    use std::net::ToSocketAddrs;
    let context = || format!("--http-host/--http-port {host}:{port}");
    let mut addr = (host, port)
        .to_socket_addrs()
        .with_context(context)?
        .next()
        .with_context(context)?;
    // SO_REUSEPORT lets any process of this user join a port already listened on; a second
    // kvengine started on the same port would silently take half the connections. Probe
    // with a plain socket first, which fails if anything listens there.
    if port != 0 {
        drop(std::net::TcpListener::bind(addr).with_context(context)?);
    }
    // Registering a socket needs a runtime; the listeners move to the cores' runtimes.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
        .context("cannot start a runtime to bind with")?;
    let _entered = rt.enter();
    let mut out = Vec::with_capacity(cores);
    for _ in 0..cores {
        let socket = if addr.is_ipv4() {
            tokio::net::TcpSocket::new_v4()
        } else {
            tokio::net::TcpSocket::new_v6()
        }
        .with_context(context)?;
        socket.set_reuseaddr(true).with_context(context)?;
        socket.set_reuseport(true).with_context(context)?;
        socket.bind(addr).with_context(context)?;
        let listener = socket.listen(1024).with_context(context)?;
        addr = listener.local_addr().with_context(context)?;
        out.push(listener.into_std().with_context(context)?);
    }
    Ok(out)
}

/// The comparison layout (`--http-threads N`): core threads of their own and a separate
/// N-thread runtime for HTTP and ingest, which reaches the cores over rings and parks for
/// their replies. Kept to measure the edge on the cores against (docs/architecture.md).
pub(super) fn run_threaded(
    args: &ServeArgs,
    config: HubConfig,
    sharding: Sharding,
    engine: RuntimeConfig,
    http_threads: usize,
    stop: tokio::sync::watch::Receiver<bool>,
) -> Result<Vec<CoreSummary>> {
    let cores = engine::sharding::ShardPolicy::shards(&sharding);
    let engine = RuntimeConfig {
        ingest_handles: cores,
        query_handles: http_threads + 1,
        ..engine
    };
    let policy = sharding.describe();
    let mut peer = crate::replicas::fetch_snapshot(&args.replicas);
    let ((hub, runtime), warm) = crate::warm::start_engine(
        peer.snapshot.take(),
        args.state_dir.as_deref(),
        args.snapshot_interval_s,
        cores,
        &policy,
        |image| start_engine_from(config, sharding.clone(), engine, image),
    )?;
    let hub = hub_for(args, hub)?;
    peer.record(&hub);
    if let Some(w) = &warm {
        w.record(&hub);
    }
    print_pinning(args.no_pin, runtime.pinned());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(http_threads)
        .thread_name("kvengine-io")
        .enable_all()
        .build()
        .context("cannot start the I/O runtime")?;
    let served = rt.block_on(async {
        let listener = tokio::net::TcpListener::bind((args.http_host.as_str(), args.http_port))
            .await
            .with_context(|| {
                format!(
                    "--http-host/--http-port {}:{}",
                    args.http_host, args.http_port
                )
            })?;
        let spawner = Homes::new(vec![tokio::runtime::Handle::current()])
            .context("no runtime for the subscriptions")?;
        serve(
            hub.clone(),
            args,
            stop,
            listener,
            spawner,
            None,
            Startup {
                tls: edge_tls(args)?,
                warm,
                policy: policy.clone(),
                placement: None,
            },
        )
        .await
    });
    // Dropping the runtime ends every task (subscriptions, connections, health checks).
    drop(rt);
    println!("kvengine: stopping: draining the cores");
    let hub = Arc::try_unwrap(hub).map_err(|_| anyhow::anyhow!("the hub is still shared"))?;
    drop(hub);
    let summaries = runtime.join().context("a shard thread failed")?;
    served?;
    Ok(summaries)
}
