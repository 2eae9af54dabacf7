//! The worker's OpenAI HTTP server: `POST /v1/completions` (the prompt queued in the
//! engine, the whole answer sent when it finishes), `GET /health`, and `GET /metrics` with
//! vLLM's load gauges (`vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`), so the
//! router's health checks and load scrapes see a vLLM.
//!
//! # Invariants
//! 1. While the worker's HTTP is down ([`HttpMode::Refuse`], or a restart) the listener is
//!    closed and every connection aborted: clients see refused or reset connections, as
//!    from a dead process; it binds the same address again when up.
//! 2. [`HttpMode::Fail500`] answers 500 to completions and health checks, nothing else
//!    changes.

use super::{HttpMode, Pending, REBIND_FOR, Shared, wall_ts};
use bytes::Bytes;
use engine::RequestId;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use sim::engine::NewRequest;
use sim::server::openai::{Api, Envelope, parse};
use sim::server::tokens::Prompter;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinSet;

async fn bind_again(addr: SocketAddr) -> Option<TcpListener> {
    let began = Instant::now();
    loop {
        match TcpListener::bind(addr).await {
            Ok(l) => return Some(l),
            Err(_) if began.elapsed() < REBIND_FOR => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => {
                eprintln!("kvengine soak: cannot re-bind HTTP on {addr}: {e}");
                return None;
            }
        }
    }
}

/// The HTTP server: accepts while up; when taken down, closes the listener and aborts
/// every connection, then binds the same address again once up.
pub(super) async fn serve(shared: Arc<Shared>, addr: SocketAddr, first: TcpListener) {
    let mut up = shared.http_up.subscribe();
    let mut listener = Some(first);
    loop {
        let l = match listener.take() {
            Some(l) => l,
            None => {
                if up.wait_for(|u| *u).await.is_err() {
                    return;
                }
                match bind_again(addr).await {
                    Some(l) => l,
                    None => return,
                }
            }
        };
        let mut conns = JoinSet::new();
        loop {
            tokio::select! {
                accepted = l.accept() => {
                    let Ok((stream, _)) = accepted else {
                        // Out of descriptors or similar: do not spin.
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    };
                    let s = shared.clone();
                    conns.spawn(async move {
                        let svc = service_fn(move |req| handle(s.clone(), req));
                        let _ = hyper::server::conn::http1::Builder::new()
                            .serve_connection(TokioIo::new(stream), svc)
                            .await;
                    });
                }
                changed = up.changed() => {
                    if changed.is_err() || !*up.borrow_and_update() {
                        break;
                    }
                }
                Some(_) = conns.join_next(), if !conns.is_empty() => {}
            }
        }
        drop(l);
        conns.abort_all();
        while conns.join_next().await.is_some() {}
    }
}

fn respond(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    r
}

fn error(status: StatusCode, message: &str) -> Response<Full<Bytes>> {
    let body =
        serde_json::json!({"error": {"message": message, "type": "soak", "code": status.as_u16()}});
    respond(status, body.to_string())
}

async fn handle(
    shared: Arc<Shared>,
    req: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let mode = shared.mode();
    let sick = mode != HttpMode::Serve;
    let r = match (req.method(), req.uri().path()) {
        (&Method::GET, "/health") if sick => error(StatusCode::INTERNAL_SERVER_ERROR, "sick"),
        (&Method::GET, "/health") => respond(StatusCode::OK, "{}".into()),
        (&Method::GET, "/metrics") => {
            let load = shared.lock().engine.load();
            let page = format!(
                "vllm:num_requests_waiting{{engine=\"0\"}} {}\n\
                 vllm:kv_cache_usage_perc{{engine=\"0\"}} {}\n",
                load.num_requests_waiting, load.kv_usage
            );
            respond(StatusCode::OK, page)
        }
        (&Method::POST, "/v1/completions") if sick => {
            shared.counters.failed.fetch_add(1, Relaxed);
            error(StatusCode::INTERNAL_SERVER_ERROR, "injected failure")
        }
        (&Method::POST, "/v1/completions") => completion(&shared, req).await,
        _ => error(StatusCode::NOT_FOUND, "not found"),
    };
    Ok(r)
}

async fn completion(shared: &Shared, req: Request<Incoming>) -> Response<Full<Bytes>> {
    let body = match req.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => return error(StatusCode::BAD_REQUEST, &e.to_string()),
    };
    let parsed = match parse(Api::Completions, &body, &Prompter::Fallback) {
        Ok(p) => p,
        Err(e) => return error(StatusCode::BAD_REQUEST, &e.message),
    };
    let (tx, rx) = oneshot::channel();
    let id = {
        let mut st = shared.lock();
        let id = RequestId(st.next_id);
        st.next_id += 1;
        if let Err(e) = st
            .engine
            .add_request(NewRequest::new(id, parsed.prompt, parsed.max_tokens))
        {
            return error(StatusCode::BAD_REQUEST, &e.to_string());
        }
        st.pending.insert(
            id,
            Pending {
                tx,
                prompt_tokens: 0,
                cached_tokens: 0,
            },
        );
        id
    };
    shared.wake.notify_one();
    match rx.await {
        Ok(usage) => {
            shared.counters.completions.fetch_add(1, Relaxed);
            let envelope = Envelope {
                api: Api::Completions,
                id: format!("cmpl-{}", id.0),
                created: wall_ts().map_or(0, |t| t as u64),
                model: "kvengine-sim".into(),
            };
            let text = "x ".repeat(usage.completion_tokens as usize);
            respond(StatusCode::OK, envelope.answer(text, &usage).to_string())
        }
        Err(_) => error(StatusCode::INTERNAL_SERVER_ERROR, "the worker restarted"),
    }
}
