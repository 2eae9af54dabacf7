//! A worker's HTTP accept loop: the axum app ([`super::http`]) served over HTTP/1.1, one
//! task per connection, with the two ways a worker's server goes away: taken down (a
//! restart, or [`super::HttpMode::Refuse`]: the listener closed and every connection
//! aborted, as a dead process's; the same address bound again once it is up), and shut
//! down (no new connections, the open ones closed gracefully: in-flight answers finish).
//!
//! # Invariants
//! 1. While down, nothing listens on the worker's address and no connection of the
//!    previous listener is left: clients see refused or reset connections.
//! 2. Coming back, the same address is bound again (retried for [`REBIND_FOR`]; a port
//!    that stays taken ends the server, logged).
//! 3. Shutting down stops accepting at once; the connections are told to finish their
//!    answer and close, and the loop returns when they have (the handle bounds the wait).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use axum::Router;
use hyper_util::rt::TokioIo;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;

use super::command::LOG_TARGET;
use super::faults::REBIND_FOR;

/// Binds `addr` again after the server was down (invariant 2).
async fn bind_again(addr: SocketAddr) -> Option<TcpListener> {
    let began = Instant::now();
    loop {
        match TcpListener::bind(addr).await {
            Ok(l) => return Some(l),
            Err(_) if began.elapsed() < REBIND_FOR => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => {
                tracing::error!(target: LOG_TARGET, %addr,
                                "simulated worker cannot bind its HTTP address again: {e}");
                return None;
            }
        }
    }
}

/// Serves `app` on `first` (bound to `addr`) until `shutdown` turns true (or its sender is
/// gone), going down and up as `up` says.
pub(super) async fn serve(
    app: Router,
    first: TcpListener,
    addr: SocketAddr,
    mut up: watch::Receiver<bool>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut listener = Some(first);
    loop {
        let l = match listener.take() {
            Some(l) => l,
            None => {
                tokio::select! {
                    back = up.wait_for(|u| *u) => if back.is_err() { return },
                    _ = shutdown.wait_for(|s| *s) => return,
                }
                match bind_again(addr).await {
                    Some(l) => l,
                    None => return,
                }
            }
        };
        let graceful = GracefulShutdown::new();
        let mut conns = JoinSet::new();
        let shutting_down = loop {
            tokio::select! {
                accepted = l.accept() => {
                    let Ok((stream, _)) = accepted else {
                        // Out of descriptors or similar: do not spin.
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    };
                    let service = TowerToHyperService::new(app.clone());
                    let conn = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service);
                    let conn = graceful.watch(conn);
                    conns.spawn(async move {
                        // A connection's error is the client's business.
                        let _ = conn.await;
                    });
                }
                changed = up.changed() => {
                    if changed.is_err() || !*up.borrow_and_update() {
                        break false;
                    }
                }
                // Shut down, or the handle is gone (the guard `wait_for` gives is not `Send`:
                // dropped inside).
                () = async { drop(shutdown.wait_for(|s| *s).await) } => break true,
                Some(_) = conns.join_next(), if !conns.is_empty() => {}
            }
        };
        drop(l);
        if shutting_down {
            // Invariant 3: the connections finish what is in flight.
            graceful.shutdown().await;
            return;
        }
        // Down (invariant 1).
        conns.abort_all();
        while conns.join_next().await.is_some() {}
    }
}
