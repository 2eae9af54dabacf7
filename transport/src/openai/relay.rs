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
//! 4. Nothing else is buffered: each chunk of the worker's answer is passed on as it
//!    arrives.
//! 5. With a [`MissTap`], the tap sees every byte of the answer as the worker sent it, and
//!    is told of the end of a whole answer; otherwise it is dropped (counted as failed).

use super::attribution::{MissProbe, MissTap};
use super::openai_error::OpenAiError;
use super::usage::UsagePatch;
use crate::hub::Hub;
use crate::outbound::body::{BodyKind, Overrun};
use axum::http::StatusCode;
use bytes::Bytes;
use engine::router::Ticket;
use hyper::body::{Frame, Incoming};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::task::{Context, Poll};
use std::time::Instant;

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
        }
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
            if self.done {
                return Poll::Ready(None);
            }
            match Pin::new(&mut self.inner).poll_frame(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Ok(frame))) => {
                    if let (Some(tap), Some(data)) = (self.tap.as_mut(), frame.data_ref()) {
                        tap.feed(data);
                    }
                    let frame = match (frame.into_data(), self.patch.as_mut()) {
                        (Ok(data), Some(patch)) => {
                            let out = patch.feed(data);
                            if patch.gave_up() {
                                self.active.hub.metrics().worker_answers.refused(
                                    BodyKind::Usage,
                                    Overrun::TooLarge,
                                    &"an answer held back to patch its usage outgrew the \
                                      cap; relayed unpatched",
                                );
                            }
                            if out.is_empty() {
                                // Held back until its event (or the whole answer) is complete.
                                continue;
                            }
                            Frame::data(out)
                        }
                        (Ok(data), None) => Frame::data(data),
                        (Err(other), _) => return Poll::Ready(Some(Ok(other))),
                    };
                    self.active.prefilled();
                    self.chunk_out();
                    return Poll::Ready(Some(Ok(frame)));
                }
                Poll::Ready(None) => {
                    self.done = true;
                    self.active.finish();
                    self.ended();
                    if let Some(tap) = self.tap.take() {
                        tap.finish();
                    }
                    let tail = self.patch.as_mut().map(UsagePatch::finish);
                    return match tail {
                        Some(t) if !t.is_empty() => Poll::Ready(Some(Ok(Frame::data(t)))),
                        _ => Poll::Ready(None),
                    };
                }
                Poll::Ready(Some(Err(e))) => {
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
                    return Poll::Ready(Some(Ok(Frame::data(Bytes::from(out)))));
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
