//! Disaggregated serving at the front door: one client request, two workers.
//!
//! When both prefill and decode workers are registered ([`applies`]), a chat or completion
//! request is split: a decode worker is chosen by load, a prefill worker by the KV cost
//! function, conditional disaggregation ([`engine::sched::SplitConfig`]) decides whether the
//! prefill is worth sending away, and the engine's own hand-off protocol ([`Protocol`], one
//! file each: [`vllm`], [`sglang`], [`trtllm`]) carries the KV blocks from one to the other.
//! The client sees one ordinary OpenAI answer: the decode worker's, with the prefill
//! worker's `cached_tokens`. [`flow`] runs the two phases; docs/protocol.md records the wire
//! details of each engine.
//!
//! # Invariants
//! 1. Both routed requests are freed in the load tracker whatever happens: the prefill one
//!    when its answer arrived or failed, the decode one when the client's answer ends.
//! 2. A failure before the first token never reaches the client while another worker can
//!    serve: a failed prefill retries on the next-best prefill worker, then prefills on the
//!    decode worker; a failed decode worker hands the whole request to the next-best one.

pub mod flow;
pub mod handoff;
pub mod sglang;
pub mod trtllm;
pub mod vllm;

pub(crate) use flow::forward;

pub use crate::openai::config::{DisaggConfig, Protocol};

use crate::hub::Hub;
use handoff::Handoff;

/// SGLang's default `--disaggregation-bootstrap-port`.
pub const SGLANG_BOOTSTRAP_PORT: u16 = 8998;

// Here rather than with `Protocol` (in `openai::config`, which the proxy's configuration
// holds and which depends on nothing of the front door): the hand-offs are this module's.
impl Protocol {
    /// The protocol's request rewriting.
    pub(crate) fn handoff(self) -> &'static dyn Handoff {
        match self {
            Self::Vllm => &vllm::Vllm,
            Self::Sglang => &sglang::Sglang,
            Self::Trtllm => &trtllm::Trtllm,
        }
    }
}

/// Whether `model`'s requests are disaggregated now: it has healthy prefill and decode
/// workers.
pub fn applies(hub: &Hub, model: &str) -> bool {
    hub.routing().disaggregating(model)
}
