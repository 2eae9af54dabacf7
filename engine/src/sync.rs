//! The only place that names `std::sync` atomics or loom.
//!
//! Under `--cfg kvengine_loom` every atomic, `Arc` and `UnsafeCell` the engine uses comes
//! from loom, so the models in `loom-tests/` explore the real code. The cfg is namespaced
//! (`kvengine_loom`, not `loom`) because RUSTFLAGS are global and a plain `loom` cfg would
//! switch tokio into its own loom mode too.

#[cfg(kvengine_loom)]
pub(crate) use loom::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering, fence};
#[cfg(kvengine_loom)]
pub(crate) use loom::sync::{Arc, Mutex};

#[cfg(kvengine_loom)]
pub(crate) use loom::thread::{Thread, current as current_thread};

#[cfg(not(kvengine_loom))]
pub(crate) use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering, fence};
#[cfg(not(kvengine_loom))]
pub(crate) use std::sync::{Arc, Mutex};
#[cfg(not(kvengine_loom))]
pub(crate) use std::thread::{Thread, current as current_thread};

/// `UnsafeCell` with loom's closure-shaped API on both builds, so the code loom checks is
/// the code that ships.
#[derive(Debug)]
pub(crate) struct UnsafeCell<T>(Inner<T>);

#[cfg(kvengine_loom)]
type Inner<T> = loom::cell::UnsafeCell<T>;
#[cfg(not(kvengine_loom))]
type Inner<T> = std::cell::UnsafeCell<T>;

impl<T> UnsafeCell<T> {
    pub(crate) fn new(value: T) -> Self {
        Self(Inner::new(value))
    }

    /// Runs `f` with a shared pointer to the value.
    #[inline(always)]
    pub(crate) fn with<R>(&self, f: impl FnOnce(*const T) -> R) -> R {
        #[cfg(kvengine_loom)]
        return self.0.with(f);
        #[cfg(not(kvengine_loom))]
        return f(self.0.get());
    }

    /// Runs `f` with a mutable pointer to the value.
    #[inline(always)]
    pub(crate) fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
        #[cfg(kvengine_loom)]
        return self.0.with_mut(f);
        #[cfg(not(kvengine_loom))]
        return f(self.0.get());
    }
}

/// Parks the current thread for at most `timeout` (std), or until unparked (loom has no
/// timed park: its models must prove that a wake-up is never lost without one).
#[inline]
pub(crate) fn park_timeout(timeout: std::time::Duration) {
    #[cfg(kvengine_loom)]
    {
        let _ = timeout;
        loom::thread::park();
    }
    #[cfg(not(kvengine_loom))]
    std::thread::park_timeout(timeout);
}

/// What a spinning thread does between two polls: a CPU hint normally, a yield under loom
/// (a loom model must yield in every spin loop or it never terminates).
#[inline(always)]
pub(crate) fn spin_hint() {
    #[cfg(kvengine_loom)]
    loom::thread::yield_now();
    #[cfg(not(kvengine_loom))]
    std::hint::spin_loop();
}
