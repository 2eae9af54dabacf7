//! A routing policy runs under the router's lock; a call back into the router or its
//! indexer from inside it would wait for that lock forever. This marks the thread while a
//! policy runs, so such a call raises instead.

use pyo3::PyResult;
use pyo3::exceptions::PyRuntimeError;
use std::cell::Cell;

thread_local! {
    static IN_POLICY: Cell<bool> = const { Cell::new(false) };
}

/// Fails if the current thread is running a routing policy.
pub(crate) fn not_in_policy() -> PyResult<()> {
    match IN_POLICY.with(Cell::get) {
        false => Ok(()),
        true => Err(PyRuntimeError::new_err(
            "a routing policy must not call the KvRouter or KvIndexer it runs for \
             (it runs under the router's lock); use the candidates it is given",
        )),
    }
}

/// Marks the thread as running a policy until dropped.
pub(crate) struct InPolicy(());

impl InPolicy {
    pub(crate) fn enter() -> Self {
        IN_POLICY.with(|c| c.set(true));
        Self(())
    }
}

impl Drop for InPolicy {
    fn drop(&mut self) {
        IN_POLICY.with(|c| c.set(false));
    }
}
