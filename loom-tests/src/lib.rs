//! loom models of every lock-free structure in kvengine.
//!
//! The engine's single-shard index (issue 2) has no lock-free structure: one thread owns it.
//! The SPSC rings of the sharded runtime (issue 3) get their models here. Run with
//! `RUSTFLAGS="--cfg kvengine_loom" cargo test -p kvengine-loom-tests --release`.
