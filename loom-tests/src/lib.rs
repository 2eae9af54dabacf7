//! loom models of every lock-free structure in kvengine.
//!
//! Models live in `tests/`, one file per structure; they compile only under
//! `--cfg kvengine_loom`, which also switches the engine's `sync` shim to loom:
//!
//! ```sh
//! RUSTFLAGS="--cfg kvengine_loom" LOOM_MAX_PREEMPTIONS=2 CARGO_TARGET_DIR=target-loom \
//!     cargo test -p kvengine-loom-tests --release
//! ```
//!
//! * `tests/ring.rs`: the SPSC ring (`engine::ring`): order across wrap-around and full,
//!   close without loss, backpressure, drop accounting.
//! * `tests/barrier.rs`: the sync barrier (`engine::runtime::barrier::SyncBarrier` over real
//!   rings between two cores and a client): a core answers `Synced` only after the
//!   operations a peer produced from the client's earlier events are applied, once.
//! * The shard sleep/wake protocol (`engine::runtime::waker`, crate-private) is modelled
//!   next to it, in `engine/src/runtime/waker.rs` (`cargo test -p kvengine-engine --lib
//!   loom` under the same cfg).
