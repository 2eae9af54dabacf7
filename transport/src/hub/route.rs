//! The facade's routing stage: a request's prompt is hashed at its model's block size,
//! its overlaps come from the index (through this thread's core when it is one, or the
//! model's predictions in approximate mode) less the unverified keys, and the model's
//! scheduler decides under the routing lock ([`Routing`]); prefilled and
//! finish follow the request's id.

use super::Hub;
use super::routing::{Decide, Entry, Leave, Refusal, Routing, Target};
use crate::cores;
use crate::error::Result;
use engine::hash::{lora_seed, seq_hashes, seq_hashes_salted};
use engine::router::{ClientId, DEFAULT_MODEL, RouteCall, Routed, Ticket};
use engine::sched::{Policy, ShadowSpec};
use engine::{Matches, SeqHash, WaiterId};
use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

/// A request's admission ([`Hub::admit_request`]): hold it until the request is routed (or
/// refused), then drop it; a queued request's drop hands the pass to the next waiter. A
/// future dropped while it waits (its client went away) leaves the queue.
#[must_use]
#[derive(Debug)]
pub struct Admission<'a> {
    routing: &'a Routing,
    metrics: &'a crate::metrics::Metrics,
    model: String,
    /// Its place in the queue, if it waited and has not left.
    waiter: Option<WaiterId>,
    /// Whether it was admitted (else, dropped while waiting: its client is gone).
    admitted: bool,
}

impl Drop for Admission<'_> {
    fn drop(&mut self) {
        let Some(id) = self.waiter.take() else { return };
        let how = if self.admitted {
            Leave::Routed
        } else {
            Leave::Gone
        };
        self.routing.leave(&self.model, id, how);
        if !self.admitted {
            // Its client went away while it waited (or just as it was admitted).
            self.metrics.admission.cancelled.fetch_add(1, Relaxed);
        }
    }
}

impl Hub {
    /// The seq hashes of `tokens`' full blocks at the router's block size (the default
    /// namespace's; [`Hub::resolve_model`] gives a model's).
    pub fn hash_prompt(&self, tokens: &[u32], lora_name: Option<&str>) -> Vec<SeqHash> {
        seq_hashes(tokens, self.block_size() as usize, lora_seed(lora_name))
    }

    /// The request's overlaps from the index, or from `model`'s predictions in approximate
    /// mode.
    fn find_matches(&self, model: &str, seqs: &[SeqHash], now: Instant) -> Result<Matches> {
        if self.approximate
            && let Some(m) = self.routing.predicted_matches(model, seqs, now)
        {
            return Ok(m);
        }
        Ok(self.gate.filter(self.engine.find_matches(seqs)?))
    }

    /// Which workers hold how much of the prompt whose full blocks are `seqs`. No state
    /// changes.
    pub fn find_matches_for(&self, seqs: &[SeqHash]) -> Result<Matches> {
        self.find_matches(DEFAULT_MODEL, seqs, Instant::now())
    }

    /// Which of `model`'s workers hold how much of the prompt: the model's block size, the
    /// prompt's full blocks and the overlaps. No state changes.
    pub fn overlap(
        &self,
        model: Option<&str>,
        tokens: &[u32],
        lora_name: Option<&str>,
    ) -> Result<(u32, usize, Matches)> {
        self.overlap_salted(model, tokens, lora_name, None)
    }

    /// [`Hub::overlap`] for a request with a `cache_salt` (vLLM's per-request cache
    /// namespace, folded into block 0's hash; `None` or `""` is no salt): only blocks stored
    /// under the same salt (and adapter) match.
    pub fn overlap_salted(
        &self,
        model: Option<&str>,
        tokens: &[u32],
        lora_name: Option<&str>,
        cache_salt: Option<&str>,
    ) -> Result<(u32, usize, Matches)> {
        let (model, block_size) = self.resolve_model(model)?;
        let seqs = seq_hashes_salted(
            tokens,
            block_size as usize,
            lora_seed(lora_name),
            cache_salt,
        );
        let mut matches = self.find_matches(&model, &seqs, Instant::now())?;
        self.routing.retain_model(&model, &mut matches);
        Ok((block_size, seqs.len(), matches))
    }

    /// Waits, if `model`'s admission queue says so, until a worker of `model` is below its
    /// busy thresholds ([`engine::router::admission`]; higher `priority` first). Refused
    /// with [`crate::TransportError::QueueFull`] when the queue is full and
    /// [`crate::TransportError::QueueTimeout`] after `--admission-timeout-ms`. Hold the
    /// answer until the request is routed. Without a busy threshold nothing is ever busy:
    /// no lock is taken and the request goes on at once.
    pub async fn admit_request(&self, model: &str, priority: i64) -> Result<Admission<'_>> {
        let begun = Instant::now();
        let counters = &self.metrics.admission;
        let mut admission = Admission {
            routing: &self.routing,
            metrics: &self.metrics,
            model: model.to_owned(),
            waiter: None,
            admitted: false,
        };
        // Nothing is ever busy without a threshold: no queue to consult.
        if !self.config.scheduler.busy.any() {
            return Ok(admission);
        }
        let (id, rx, deadline) = match self.routing.enter(model, priority, begun) {
            Entry::Go => return Ok(admission),
            Entry::Full { capacity } => {
                counters.rejected_full.fetch_add(1, Relaxed);
                return Err(crate::TransportError::QueueFull { capacity });
            }
            Entry::Wait { id, rx, deadline } => (id, rx, deadline),
        };
        counters.queued.fetch_add(1, Relaxed);
        admission.waiter = Some(id);
        let woken = tokio::time::timeout_at(tokio::time::Instant::from_std(deadline), rx).await;
        // Ok(Err(_)): the sender went without a word, which only leaving does; route.
        if woken.is_err() && !self.routing.leave(model, id, Leave::TimedOut) {
            admission.waiter = None;
            counters.rejected_timeout.fetch_add(1, Relaxed);
            let waited_ms = u64::try_from(begun.elapsed().as_millis()).unwrap_or(u64::MAX);
            return Err(crate::TransportError::QueueTimeout { waited_ms });
        }
        admission.admitted = true;
        counters.admitted.fetch_add(1, Relaxed);
        counters.wait.observe(begun.elapsed().as_secs_f64());
        Ok(admission)
    }

    /// Routes a request for `model` (see [`Hub::resolve_model`]) and records it as active
    /// on the chosen worker.
    pub fn route(&self, model: Option<&str>, call: &RouteCall<'_>, now: Instant) -> Result<Routed> {
        let (model, seqs) = self.prepare(model, call)?;
        let matches = self.find_matches(&model, &seqs, now)?;
        let how = Decide {
            shadow: self.shadow_spec(None),
            ..Decide::default()
        };
        self.decide(&model, call, &seqs, &matches, now, how)
    }

    /// [`Hub::route`] with `custom` choosing the worker among the scored candidates (the
    /// Python package's custom policies). It runs under the routing lock, once per call.
    pub fn route_with(
        &self,
        model: Option<&str>,
        call: &RouteCall<'_>,
        now: Instant,
        custom: &mut dyn Policy,
    ) -> Result<Routed> {
        let (model, seqs) = self.prepare(model, call)?;
        let matches = self.find_matches(&model, &seqs, now)?;
        let how = Decide {
            custom: Some(custom),
            client: None,
            shadow: self.shadow_spec(None),
        };
        self.decide(&model, call, &seqs, &matches, now, how)
    }

    /// [`Hub::route`] for async callers: on a hosted core, a query for another core's shard
    /// waits without blocking the thread, which keeps serving meanwhile.
    pub async fn route_async(
        &self,
        model: Option<&str>,
        call: &RouteCall<'_>,
        now: Instant,
    ) -> Result<Routed> {
        self.route_async_as(model, call, now, None).await
    }

    /// [`Hub::route_async`] for a caller of the routing API (`POST /v1/route`): the request
    /// becomes `client`'s reservation ([`engine::router::reservations`]): refused past the
    /// client's cap, active for at most `--reservation-timeout-secs` unless freed, and only
    /// `client` may mark or free it.
    pub async fn reserve_async(
        &self,
        model: Option<&str>,
        call: &RouteCall<'_>,
        now: Instant,
        client: ClientId,
    ) -> Result<Routed> {
        self.route_async_as(model, call, now, Some(client)).await
    }

    /// [`Hub::route_async`] in a namespace the caller resolved already
    /// ([`Hub::resolve_model`]: `model` and its `block_size`), so the model is resolved once
    /// per request (the OpenAI front door).
    pub async fn route_resolved_async(
        &self,
        model: &str,
        block_size: u32,
        call: &RouteCall<'_>,
        now: Instant,
    ) -> Result<Routed> {
        self.route_resolved_beside_async(model, block_size, call, now, None)
            .await
    }

    /// [`Hub::route_resolved_async`] for a request whose `x-kvengine-shadow-worker` header
    /// named `beside` (the worker another router chose: [`super::Shadow::Header`]).
    pub async fn route_resolved_beside_async(
        &self,
        model: &str,
        block_size: u32,
        call: &RouteCall<'_>,
        now: Instant,
        beside: Option<engine::WorkerId>,
    ) -> Result<Routed> {
        let seqs = hash_call(call, block_size);
        let shadow = self.shadow_spec(beside);
        self.route_hashed(model.to_owned(), seqs, call, now, (None, shadow))
            .await
    }

    async fn route_async_as(
        &self,
        model: Option<&str>,
        call: &RouteCall<'_>,
        now: Instant,
        client: Option<ClientId>,
    ) -> Result<Routed> {
        let (model, seqs) = self.prepare(model, call)?;
        let shadow = self.shadow_spec(None);
        self.route_hashed(model, seqs, call, now, (client, shadow))
            .await
    }

    async fn route_hashed(
        &self,
        model: String,
        seqs: Vec<SeqHash>,
        call: &RouteCall<'_>,
        now: Instant,
        (client, shadow): (Option<ClientId>, Option<ShadowSpec>),
    ) -> Result<Routed> {
        let matches = match self.engine.hosted() && !self.approximate {
            true => match cores::find_matches(&seqs).await {
                Some(r) => self.gate.filter(r?),
                None => self.find_matches(&model, &seqs, now)?,
            },
            false => self.find_matches(&model, &seqs, now)?,
        };
        let how = Decide {
            custom: None,
            client,
            shadow,
        };
        self.decide(&model, call, &seqs, &matches, now, how)
    }

    /// The namespace of the call and its prompt's seq hashes at that model's block size.
    fn prepare(&self, model: Option<&str>, call: &RouteCall<'_>) -> Result<(String, Vec<SeqHash>)> {
        let (model, block_size) = self.resolve_model(model)?;
        Ok((model, hash_call(call, block_size)))
    }

    /// The scheduler's decision for a request whose overlaps are known; records and counts
    /// it.
    fn decide(
        &self,
        model: &str,
        call: &RouteCall<'_>,
        seqs: &[SeqHash],
        matches: &Matches,
        now: Instant,
        how: Decide<'_>,
    ) -> Result<Routed> {
        let lifetime = self
            .limits
            .reservation_timeout
            .unwrap_or(engine::router::reservations::DEFAULT_RESERVATION_TIMEOUT);
        let lifetime = (lifetime < self.config.scheduler.request_timeout).then_some(lifetime);
        let m = &self.metrics;
        let shadowing = how.shadow.is_some();
        let routed = self
            .routing
            .decide(model, call, seqs, matches, now, how, &self.limits, lifetime)
            .map_err(|(refusal, e)| {
                use std::sync::atomic::Ordering::Relaxed;
                match refusal {
                    Some(Refusal::TooManyReservations) => {
                        m.too_many_reservations.fetch_add(1, Relaxed)
                    }
                    Some(Refusal::Overloaded) => m.overloaded.fetch_add(1, Relaxed),
                    None => 0,
                };
                e
            })?;
        if let Some(how) = routed.session {
            m.sessions.routed(how);
        }
        let decision = &routed.decision;
        m.decided(decision.mode);
        m.decided_because(crate::metrics::DecisionReason::of(
            decision.overlap_blocks,
            decision.best_available_overlap_blocks,
        ));
        m.chosen_overlap.observe(f64::from(decision.overlap_blocks));
        m.best_overlap
            .observe(f64::from(decision.best_available_overlap_blocks));
        self.count_shadow(&routed, shadowing, call.tokens.len() as u64);
        Ok(routed)
    }

    /// Marks a routed request prefilled: its first token streamed now (the chosen worker's
    /// TTFT model learns from the time since routing).
    pub fn prefilled(&self, request_id: &str) -> Result<()> {
        self.routing
            .prefilled(Target::Id(request_id, None), Instant::now())
    }

    /// [`Hub::prefilled`] for a caller of the routing API: only `client`'s own reservations
    /// are known to it (anything else is [`crate::TransportError::UnknownRequest`]).
    pub fn prefilled_by(&self, request_id: &str, client: ClientId) -> Result<()> {
        self.routing
            .prefilled(Target::Id(request_id, Some(client)), Instant::now())
    }

    /// [`Hub::prefilled`] by the ticket the router's own caller kept ([`Routed::ticket`]).
    pub fn prefilled_ticket(&self, ticket: &Ticket) -> Result<()> {
        self.routing
            .prefilled(Target::Ticket(ticket), Instant::now())
    }

    /// Frees a routed request (finished or cancelled).
    pub fn finish(&self, request_id: &str) -> Result<()> {
        self.routing.finish(Target::Id(request_id, None))
    }

    /// [`Hub::finish`] for a caller of the routing API: only `client`'s own reservations
    /// are known to it (anything else is [`crate::TransportError::UnknownRequest`]).
    pub fn finish_by(&self, request_id: &str, client: ClientId) -> Result<()> {
        self.routing.finish(Target::Id(request_id, Some(client)))
    }

    /// [`Hub::finish`] by the ticket the router's own caller kept ([`Routed::ticket`]).
    pub fn finish_ticket(&self, ticket: &Ticket) -> Result<()> {
        self.routing.finish(Target::Ticket(ticket))
    }
}

/// The seq hashes of the call's prompt at `block_size`.
fn hash_call(call: &RouteCall<'_>, block_size: u32) -> Vec<SeqHash> {
    seq_hashes_salted(
        call.tokens,
        block_size as usize,
        lora_seed(call.lora_name),
        call.cache_salt,
    )
}
