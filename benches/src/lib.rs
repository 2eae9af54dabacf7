//! kvengine's end-to-end workload harness.
//!
//! Empty until issue 3 (the sharded runtime) gives it something end to end to drive. The
//! micro-benchmarks of the engine live next to it, in `engine/benches/`.
