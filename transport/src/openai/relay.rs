//! A worker's answer on its way to the client, and the load-tracker entry it keeps alive.
//!
//! # Invariants
//! 1. An [`Active`] frees its request exactly once: explicitly, or when dropped (the client
//!    went away with the body unread).
//! 2. A [`Relay`] marks its request prefilled at the first data frame and frees it at the
//!    end of the body, on an upstream error, or when dropped.
//! 3. With a [`UsagePatch`], every byte of the answer reaches the client, in order, with
//!    only the `usage.prompt_tokens_details.cached_tokens` value replaced (unless the
//!    answer outgrew what the patch may hold: then it goes out unpatched, counted).
//! 4. Nothing else is buffered, and nothing waits for a chunk that has not arrived: the
//!    chunks of the worker's answer that reached the router together go out together, in
//!    one write, as soon as the upstream connection has handed over what it read (at most
//!    [`MAX_HELD`] bytes at a time). hyper hands an answer's body over one chunk per turn
//!    of the upstream connection's task, so relaying each at once cost one `writev` and
//!    one TCP segment per token, although one read from the worker often brings a dozen.
//!    With the client connection's [`ConnTurns`], the relay holds what it has, wakes itself
//!    and waits for its connection's next turn: the upstream connection's task, woken when
//!    the relay took its chunk, runs first and passes on the next one if it has it.
//!    Without [`ConnTurns`] every chunk goes out at once.
//! 5. With a [`MissTap`], the tap sees every byte of the answer as the worker sent it, and
//!    is told of the end of a whole answer; otherwise it is dropped (counted as failed).

use super::attribution::{MissProbe, MissTap};
use super::openai_error::OpenAiError;
use super::usage::UsagePatch;
use crate::http::turns::ConnTurns;
use crate::hub::Hub;
use crate::outbound::body::{BodyKind, Overrun};
use axum::http::StatusCode;
use bytes::{Bytes, BytesMut};
use engine::router::Ticket;
use hyper::body::{Frame, Incoming};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::task::{Context, Poll};
use std::time::Instant;

/// The most a [`Relay`] holds before it writes without waiting for more (invariant 4).
pub(crate) const MAX_HELD: usize = 32 * 1024;

/// Frees a routed request when dropped, unless already freed. It holds the request's
/// [`Ticket`] (its namespace and id) from route to prefilled to finish, so neither looks
/// for the request.
#[derive(Debug)]
pub(crate) struct Active {
    hub: Arc<Hub>,
    ticket: Option<Ticket>,
    prefilled: bool,
    /// What the router predicted, for the answer's miss attribution.
    probe: Option<MissProbe>,
}

impl Active {
    /// Tracks the routed request of `ticket`.
    pub(crate) fn new(hub: Arc<Hub>, ticket: Ticket) -> Self {
        Self {
            hub,
            ticket: Some(ticket),
            prefilled: false,
            probe: None,
        }
    }

    /// Attributes the request's cache misses by its answer ([`MissTap`]).
    pub(crate) fn probing(mut self, probe: MissProbe) -> Self {
        self.probe = Some(probe);
        self
    }

    /// The miss tap of the answer (once), if the request is probed.
    pub(crate) fn tap(&mut self) -> Option<MissTap> {
        let probe = self.probe.take()?;
        Some(MissTap::new(self.hub.clone(), probe))
    }

    /// The request id, until freed.
    pub(crate) fn id(&self) -> Option<&str> {
        self.ticket.as_ref().map(|t| t.request_id.as_str())
    }

    /// Marks the request prefilled (once).
    pub(crate) fn prefilled(&mut self) {
        if !self.prefilled {
            self.prefilled = true;
            if let Some(t) = &self.ticket {
                let _ = self.hub.prefilled_ticket(t);
            }
        }
    }

    /// Frees the request (once).
    pub(crate) fn finish(&mut self) {
        if let Some(t) = self.ticket.take() {
            let _ = self.hub.finish_ticket(&t);
        }
    }
}

impl Drop for Active {
    fn drop(&mut self) {
        self.finish();
    }
}

/// The worker's answer on its way to the client: marks the request prefilled at the first
/// chunk, frees it at the end (or when dropped: the client went away), and turns a
/// mid-stream failure into an SSE error event.
pub(crate) struct Relay {
    inner: Incoming,
    active: Active,
    sse: bool,
    done: bool,
    patch: Option<UsagePatch>,
    tap: Option<MissTap>,
    /// When the client's request arrived, and when the last chunk went out (latencies).
    received: Instant,
    last_chunk: Option<Instant>,
    /// Chunks that arrived and wait to go out together (invariant 4).
    held: BytesMut,
    /// The client connection's turns (`None`: every chunk goes out at once).
    turns: Option<ConnTurns>,
    /// The turn in which the relay last waited for the upstream connection with chunks
    /// held; `None` since the last chunk arrived.
    waited_in: Option<u64>,
    /// What ended the answer after chunks that still had to go out first.
    deferred: Option<Deferred>,
}

/// The end of an answer, kept until the chunks before it went out.
enum Deferred {
    /// A frame that is not data (trailers).
    Frame(Frame<Bytes>),
    /// The worker failed mid-answer.
    Failed(hyper::Error),
}

impl Relay {
    /// Relays `inner` (an SSE stream if `sse`), patching usage with `patch`, showing it to
    /// `tap`.
    pub(crate) fn new(
        inner: Incoming,
        active: Active,
        sse: bool,
        (patch, tap): (Option<UsagePatch>, Option<MissTap>),
        received: Instant,
    ) -> Self {
        Self {
            inner,
            active,
            sse,
            done: false,
            patch,
            tap,
            received,
            last_chunk: None,
            held: BytesMut::new(),
            turns: None,
            waited_in: None,
            deferred: None,
        }
    }

    /// Coalesces the chunks that arrive together (invariant 4), on a client connection
    /// counting `turns`.
    pub(crate) fn coalescing(mut self, turns: Option<ConnTurns>) -> Self {
        self.turns = turns;
        self
    }

    /// Whether to wait for another turn before writing what is held: once per chunk that
    /// arrived, until the connection's task has been polled anew (or the hold is full).
    fn wait_for_upstream(&mut self) -> bool {
        let Some(turns) = &self.turns else {
            return false;
        };
        if self.held.len() >= MAX_HELD {
            return false;
        }
        let now = turns.now();
        match self.waited_in {
            None => {
                self.waited_in = Some(now);
                true
            }
            Some(turn) => turn == now,
        }
    }

    /// The chunks held so far, as one frame.
    fn take_held(&mut self) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        self.waited_in = None;
        self.active
            .hub
            .metrics()
            .answer_writes
            .fetch_add(1, Relaxed);
        Poll::Ready(Some(Ok(Frame::data(self.held.split().freeze()))))
    }

    /// The worker failed mid-answer: an SSE error event (after what the patch held back),
    /// or the error for a body that is not a stream.
    fn failed(&mut self, e: hyper::Error) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        self.done = true;
        self.active.finish();
        self.active
            .hub
            .metrics()
            .upstream_errors
            .fetch_add(1, Relaxed);
        tracing::warn!("worker failed mid-answer: {e}");
        if !self.sse {
            return Poll::Ready(Some(Err(std::io::Error::other(e))));
        }
        let error = OpenAiError {
            status: StatusCode::BAD_GATEWAY,
            kind: "upstream_error",
            message: format!("the worker failed mid-stream: {e}"),
            param: None,
            code: None,
        };
        // What the patch held back goes out before the error event.
        let mut out = self
            .patch
            .as_mut()
            .map(|p| p.finish().to_vec())
            .unwrap_or_default();
        out.extend_from_slice(format!("data: {}\n\n", error.body()).as_bytes());
        Poll::Ready(Some(Ok(Frame::data(Bytes::from(out)))))
    }

    /// Records a chunk going out: the first is the time to first token, later ones the
    /// gaps between tokens.
    fn chunk_out(&mut self) {
        let now = Instant::now();
        let m = self.active.hub.metrics();
        match self.last_chunk {
            None => m.ttft.observe((now - self.received).as_secs_f64()),
            Some(last) => m.inter_chunk.observe((now - last).as_secs_f64()),
        }
        self.last_chunk = Some(now);
    }

    /// Records the end of the answer.
    fn ended(&mut self) {
        let secs = self.received.elapsed().as_secs_f64();
        self.active.hub.metrics().end_to_end.observe(secs);
    }
}

impl hyper::body::Body for Relay {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        loop {
            if let Some(d) = self.deferred.take() {
                return match d {
                    Deferred::Frame(f) => Poll::Ready(Some(Ok(f))),
                    Deferred::Failed(e) => self.failed(e),
                };
            }
            if self.done {
                return Poll::Ready(None);
            }
            match Pin::new(&mut self.inner).poll_frame(cx) {
                Poll::Pending if self.held.is_empty() => return Poll::Pending,
                Poll::Pending if self.wait_for_upstream() => {
                    // The upstream connection's task may hold more of what it read: it was
                    // woken when this relay took its chunk, so it runs before the turn this
                    // wake-up asks for.
                    cx.waker().wake_by_ref();
                    return Poll::Pending;
                }
                Poll::Pending => return self.take_held(),
                Poll::Ready(Some(Ok(frame))) => {
                    if let (Some(tap), Some(data)) = (self.tap.as_mut(), frame.data_ref()) {
                        tap.feed(data);
                    }
                    let data = match frame.into_data() {
                        Ok(data) => data,
                        Err(other) if self.held.is_empty() => return Poll::Ready(Some(Ok(other))),
                        Err(other) => {
                            self.deferred = Some(Deferred::Frame(other));
                            return self.take_held();
                        }
                    };
                    let data = match self.patch.as_mut() {
                        Some(patch) => {
                            let out = patch.feed(data);
                            if patch.gave_up() {
                                self.active.hub.metrics().worker_answers.refused(
                                    BodyKind::Usage,
                                    Overrun::TooLarge,
                                    &"an answer held back to patch its usage outgrew the \
                                      cap; relayed unpatched",
                                );
                            }
                            out
                        }
                        None => data,
                    };
                    if data.is_empty() {
                        // Held back by the patch until its event (or the answer) is complete.
                        continue;
                    }
                    self.active.prefilled();
                    self.chunk_out();
                    self.held.extend_from_slice(&data);
                    self.waited_in = None;
                }
                Poll::Ready(None) => {
                    self.done = true;
                    self.active.finish();
                    self.ended();
                    if let Some(tap) = self.tap.take() {
                        tap.finish();
                    }
                    if let Some(tail) = self.patch.as_mut().map(UsagePatch::finish) {
                        self.held.extend_from_slice(&tail);
                    }
                    return if self.held.is_empty() {
                        Poll::Ready(None)
                    } else {
                        self.take_held()
                    };
                }
                Poll::Ready(Some(Err(e))) if self.held.is_empty() => return self.failed(e),
                Poll::Ready(Some(Err(e))) => {
                    self.deferred = Some(Deferred::Failed(e));
                    return self.take_held();
                }
            }
        }
    }
}

impl std::fmt::Debug for Relay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay")
            .field("active", &self.active)
            .field("sse", &self.sse)
            .finish_non_exhaustive()
    }
}
