//! What part of a request a simulated worker serves in a disaggregated deployment: the
//! router's own [`engine::sched::WorkerRole`], so a worker and its registration cannot
//! disagree on the names.
//!
//! The role matters only where a request's body does not say which side it is: SGLang's
//! prefill and decode requests carry the same bootstrap fields, so a worker answers them as
//! its role says. vLLM's `kv_transfer_params` and TensorRT-LLM's `disaggregated_params`
//! name their side, and every role serves both sides and plain (aggregated) requests: a
//! router may fall back to prefilling on a decode worker.

/// A simulated worker's role.
pub type SimRole = engine::sched::WorkerRole;
