//! How long moving a prompt's KV from a prefill worker to a decode worker takes: the
//! router's own model ([`engine::sched::TransferModel`]), waited in simulated time (a worker
//! waits it divided by its speedup), so the router's estimate and the simulated truth share
//! one formula.

pub use engine::sched::TransferModel;
