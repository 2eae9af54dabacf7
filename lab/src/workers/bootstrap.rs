//! SGLang's prefill/decode rendezvous, simulated: a prefill worker's registry of bootstrap
//! rooms, the long-poll endpoint that serves it, and the decode side's client.
//!
//! A real SGLang decode worker learns through the prefill worker's bootstrap server where to
//! receive a request's KV, then waits for the transfer. Here the prefill worker serves
//! `GET /sim/bootstrap/{room}` on its own HTTP port (so a router sets `bootstrap_port` to it):
//! the call waits until the prefill of `room` is complete and answers
//! `200 {"room": R, "prompt_tokens": N}`, or `404` if the room's prefill failed, never came
//! within the worker's bootstrap timeout, or this worker is not a prefill worker.
//!
//! # Invariants
//! 1. A room moves `Pending -> Done | Failed`; a new prefill request with the same room
//!    starts it over. A prefill request marks its room `Failed` if it ends (refused, client
//!    gone, worker stopping) before its first token.
//! 2. The registry is bounded: a room is forgotten [`ROOM_RETENTION`] after it was created,
//!    or when more than [`MAX_ROOMS`] exist (oldest first); its waiters then get 404.
//! 3. [`poll`] never panics and ends within its timeout.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Json, Response};
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use serde_json::{Value, json};
use tokio::sync::watch;

use super::disagg::Bootstrap;
use super::openai::OpenAiError;

/// How long a room is remembered after it was created.
pub const ROOM_RETENTION: Duration = Duration::from_secs(600);
/// Most rooms remembered at once.
pub const MAX_ROOMS: usize = 1 << 16;
/// Largest bootstrap answer the decode side reads.
const MAX_ANSWER_BYTES: usize = 64 << 10;

/// The state of one room.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Room {
    /// Its prefill has not completed.
    Pending,
    /// Its prefill completed.
    Done {
        /// Tokens of the prefilled prompt.
        prompt_tokens: u32,
    },
    /// Its prefill ended without completing.
    Failed,
}

#[derive(Debug, Default)]
struct Inner {
    rooms: HashMap<u64, (Instant, watch::Sender<Room>)>,
    /// Rooms in creation order, for expiry.
    order: VecDeque<(Instant, u64)>,
}

impl Inner {
    fn sweep(&mut self, now: Instant) {
        while let Some(&(created, room)) = self.order.front() {
            let expired = now.saturating_duration_since(created) > ROOM_RETENTION;
            if !expired && self.order.len() <= MAX_ROOMS {
                break;
            }
            self.order.pop_front();
            if self.rooms.get(&room).is_some_and(|(c, _)| *c == created) {
                self.rooms.remove(&room);
            }
        }
    }

    fn sender(&mut self, room: u64) -> watch::Sender<Room> {
        let now = Instant::now();
        self.sweep(now);
        if let Some((_, tx)) = self.rooms.get(&room) {
            return tx.clone();
        }
        let (tx, _) = watch::channel(Room::Pending);
        self.rooms.insert(room, (now, tx.clone()));
        self.order.push_back((now, room));
        tx
    }
}

/// A prefill worker's rooms.
#[derive(Debug)]
pub(super) struct Rooms {
    inner: Mutex<Inner>,
    /// How long `GET /sim/bootstrap/{room}` waits for a room.
    timeout: Duration,
}

impl Rooms {
    pub(super) fn new(timeout: Duration) -> Self {
        Self {
            inner: Mutex::new(Inner::default()),
            timeout,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // The registry stays consistent whatever a panicking holder left: recover it.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn set(&self, room: u64, state: Room) {
        self.lock().sender(room).send_replace(state);
    }

    /// Waits (at most the timeout) until `room` is no longer pending.
    pub(super) async fn wait(&self, room: u64) -> Room {
        let mut rx = self.lock().sender(room).subscribe();
        let done = tokio::time::timeout(self.timeout, rx.wait_for(|r| *r != Room::Pending)).await;
        match done {
            Ok(Ok(r)) => *r,
            // Timed out, or forgotten (invariant 2).
            _ => Room::Pending,
        }
    }
}

/// A prefill request's hold on its room: marks it done at the first token, failed if
/// dropped before.
#[derive(Debug)]
pub(super) struct RoomGuard {
    rooms: Arc<Rooms>,
    room: u64,
    armed: bool,
}

impl RoomGuard {
    /// Starts (or restarts) `room`: pending.
    pub(super) fn new(rooms: Arc<Rooms>, room: u64) -> Self {
        rooms.set(room, Room::Pending);
        Self {
            rooms,
            room,
            armed: true,
        }
    }

    /// The prefill is complete.
    pub(super) fn done(&mut self, prompt_tokens: u32) {
        if self.armed {
            self.armed = false;
            self.rooms.set(self.room, Room::Done { prompt_tokens });
        }
    }
}

impl Drop for RoomGuard {
    fn drop(&mut self) {
        if self.armed {
            self.rooms.set(self.room, Room::Failed);
        }
    }
}

fn not_found(message: String) -> Response {
    let mut e = OpenAiError::invalid(None, message);
    e.status = StatusCode::NOT_FOUND;
    e.kind = "not_found_error";
    e.into_response()
}

/// `GET /sim/bootstrap/{room}` on a worker whose rooms are `rooms` (`None`: not a prefill
/// worker).
pub(super) async fn serve(rooms: Option<&Rooms>, room: &str) -> Response {
    let Some(rooms) = rooms else {
        return not_found("this simulated worker is not a prefill worker".into());
    };
    let Some(id) = room.parse::<u64>().ok().filter(|&r| r < 1 << 63) else {
        return OpenAiError::invalid(None, format!("bad bootstrap room {room:?}")).into_response();
    };
    match rooms.wait(id).await {
        Room::Done { prompt_tokens } => {
            Json(json!({"room": id, "prompt_tokens": prompt_tokens})).into_response()
        }
        Room::Failed => not_found(format!("the prefill of bootstrap room {id} failed")),
        Room::Pending => not_found(format!(
            "no prefill completed for bootstrap room {id} within {:?}",
            rooms.timeout
        )),
    }
}

/// The decode side's HTTP client.
pub(super) type HttpClient = Client<HttpConnector, Empty<Bytes>>;

/// A new client for [`poll`].
pub(super) fn client() -> HttpClient {
    Client::builder(hyper_util::rt::TokioExecutor::new()).build_http()
}

/// Waits (at most `timeout`) until the prefill worker `b` points at has completed room
/// `b.room`; returns its prompt's token count, or why the rendezvous failed.
pub(super) async fn poll(
    client: &HttpClient,
    b: &Bootstrap,
    timeout: Duration,
) -> Result<u32, String> {
    let host = if b.host.contains(':') && !b.host.starts_with('[') {
        format!("[{}]", b.host)
    } else {
        b.host.clone()
    };
    let url = format!("http://{host}:{}/sim/bootstrap/{}", b.port, b.room);
    let uri: hyper::Uri = url
        .parse()
        .map_err(|e| format!("bad bootstrap address {url}: {e}"))?;
    let exchange = async {
        let resp = client
            .get(uri)
            .await
            .map_err(|e| format!("cannot reach the prefill worker at {url}: {e}"))?;
        let status = resp.status();
        let body = Limited::new(resp.into_body(), MAX_ANSWER_BYTES)
            .collect()
            .await
            .map_err(|e| format!("the prefill worker's bootstrap answer broke off: {e}"))?
            .to_bytes();
        if status != StatusCode::OK {
            return Err(format!(
                "the prefill worker's bootstrap answered {status}: {}",
                String::from_utf8_lossy(&body)
            ));
        }
        let v: Value = serde_json::from_slice(&body)
            .map_err(|e| format!("the prefill worker's bootstrap answer is not JSON: {e}"))?;
        let tokens = v["prompt_tokens"]
            .as_u64()
            .and_then(|n| u32::try_from(n).ok());
        match tokens {
            Some(n) if v["room"].as_u64() == Some(b.room) => Ok(n),
            _ => Err(format!("unexpected bootstrap answer {v}")),
        }
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .unwrap_or_else(|_| {
            Err(format!(
                "no answer from the prefill worker's bootstrap at {url} within {timeout:?}"
            ))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn rooms_wait_complete_fail_and_time_out() {
        let rooms = Arc::new(Rooms::new(Duration::from_millis(200)));
        // A waiter that arrives before the prefill.
        let waiter = {
            let rooms = rooms.clone();
            tokio::spawn(async move { rooms.wait(7).await })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        let mut g = RoomGuard::new(rooms.clone(), 7);
        g.done(40);
        assert_eq!(waiter.await.unwrap(), Room::Done { prompt_tokens: 40 });
        // And one after it.
        assert_eq!(rooms.wait(7).await, Room::Done { prompt_tokens: 40 });
        drop(g);
        assert_eq!(rooms.wait(7).await, Room::Done { prompt_tokens: 40 });
        // A prefill that ends early fails its room.
        drop(RoomGuard::new(rooms.clone(), 8));
        assert_eq!(rooms.wait(8).await, Room::Failed);
        // A room nobody prefills times out.
        let start = Instant::now();
        assert_eq!(rooms.wait(9).await, Room::Pending);
        assert!(start.elapsed() >= Duration::from_millis(200));
    }

    #[test]
    fn the_registry_is_bounded() {
        let rooms = Rooms::new(Duration::from_millis(1));
        for r in 0..(MAX_ROOMS as u64 + 10) {
            rooms.set(r, Room::Failed);
        }
        let inner = rooms.lock();
        assert!(inner.rooms.len() <= MAX_ROOMS + 1);
        assert!(
            !inner.rooms.contains_key(&0),
            "the oldest room was forgotten"
        );
    }
}
