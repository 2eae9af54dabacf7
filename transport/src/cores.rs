//! The edge on the cores: each core thread runs one single-threaded async runtime that serves
//! its share of HTTP connections, its home workers' event streams, and its engine core
//! ([`CoreHost`]), stepped by [`drive`] between the other tasks.
//!
//! The host lives in a thread-local ([`install`]); the [`crate::hub::Hub`] reaches it through
//! [`with_core`] from any task on that thread, so a query for this core's shard is answered
//! in place and one for another shard waits (stepping this core) for that core's reply. On a
//! thread that is not a core (a blocking pool thread, a test), [`with_core`] answers `None`
//! and the hub falls back to its shared handles.
//!
//! # Invariants
//! 1. Only the thread that installed a host touches it; it is borrowed for one engine call
//!    or one step at a time, never across an `.await`.
//! 2. A task on a core thread never blocks the thread on a lock held across an engine call
//!    (the hub takes none), so a core waiting for another is never waiting for itself.
//! 3. [`drive`] ends when the core has ended; [`finish`] runs what is left of the core on
//!    the thread once its runtime is gone, and returns the core's figures.
//! 4. After [`request_memory_release`], every core thread runs the release function
//!    ([`set_memory_release`]) once, the next time it is idle: allocators such as mimalloc
//!    keep freed pages with the thread that freed them, and a core frees its own shard's
//!    memory, so only the core's thread can hand those pages back.

use engine::runtime::{CoreHost, CoreSummary, Lookup};
use engine::sharding::choice::Sharding;
use engine::{EngineError, Matches, SeqHash, WorkerId};
use std::cell::RefCell;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;

/// Idle rounds (each a yield to the runtime, which polls its sockets: one `epoll_wait`)
/// before the core parks: long enough to catch the next message of a busy peer core without
/// a wake-up, short enough that an idle core leaves its CPU to others. Measured on the
/// Mooncake replay through the proxy (docs/benchmarks.md, "Issue 31"): 64 spent 0.5-0.7 s
/// more router CPU per 1,000 requests than 8 with no better latency; 1 spent 60% more (every
/// message then needs a cross-thread wake-up).
pub const DEFAULT_IDLE_POLLS: u32 = 8;
/// [`DEFAULT_IDLE_POLLS`] unless [`set_idle_polls`] said otherwise.
static IDLE_POLLS: AtomicU32 = AtomicU32::new(DEFAULT_IDLE_POLLS);
/// Longest park: bounds the cost of a missed wake-up (none is expected).
const PARK: Duration = Duration::from_millis(20);

/// Returns the calling thread's free memory to the OS (the binary's allocator's collect).
static MEMORY_RELEASE: OnceLock<fn()> = OnceLock::new();
/// Bumped by [`request_memory_release`]; each core thread releases once per bump.
static RELEASE_EPOCH: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// The last [`RELEASE_EPOCH`] this thread released for.
    static RELEASED: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    static HOST: RefCell<Option<CoreHost<Sharding>>> = const { RefCell::new(None) };
    /// Tasks waiting for another core's reply: woken by [`drive`] when replies arrive.
    static REPLY_WAITERS: RefCell<Vec<std::task::Waker>> = const { RefCell::new(Vec::new()) };
}

/// The runtimes of the engine's cores, by core: where a worker's tasks (its ZMQ
/// subscription, a QUIC publisher's batches) run, on its home core
/// (`engine::runtime::home_core`), so its events reach its directory without a hop between
/// cores. One runtime in the layout whose cores have threads of their own.
#[derive(Clone, Debug)]
pub struct Homes(Arc<[tokio::runtime::Handle]>);

impl Homes {
    /// `handles[k]` is core `k`'s runtime; at least one.
    pub fn new(handles: Vec<tokio::runtime::Handle>) -> Option<Self> {
        (!handles.is_empty()).then(|| Self(handles.into()))
    }

    /// The runtime `worker`'s tasks run on (always `Some`: `home_core` is below the count
    /// it is given, and there is at least one runtime).
    pub fn home(&self, worker: WorkerId) -> Option<&tokio::runtime::Handle> {
        self.0
            .get(engine::runtime::home_core(worker, self.0.len()).idx())
    }
}

/// Runs `f` on `worker`'s home core thread, where its event streams (ZMQ subscription,
/// QUIC publisher) run, and waits for it; inline when there is no such thread (`homes`
/// `None`, the caller is already there, or the home runtime is gone). What `f` does is then
/// ordered with those streams' batches: a batch is decoded and handed to the engine in one
/// poll, with no await between the registry check and the send, so `f` runs between two
/// batches, and what it sends goes over the same ring as they do (the engine applies in
/// ring order). A worker's removal runs here, so no batch of its lands after it (issue 12).
/// `None`: the home runtime shut down under the call (the router is stopping).
pub async fn on_home<T: Send + 'static>(
    homes: Option<&Homes>,
    worker: WorkerId,
    f: impl FnOnce() -> T + Send + 'static,
) -> Option<T> {
    let home = homes.and_then(|h| h.home(worker)).cloned();
    let here = tokio::runtime::Handle::try_current().ok().map(|h| h.id());
    match home {
        // `None` only if the home runtime shut down under the call (the router is
        // stopping).
        Some(rt) if Some(rt.id()) != here => rt.spawn(async move { engine_call(f) }).await.ok(),
        _ => Some(engine_call(f)),
    }
}

/// Runs `f`, a synchronous engine call (it may wait briefly for a core), from async code:
/// in place on a core thread (the call steps this thread's core while it waits, so nothing
/// waits for this thread) and on any single-threaded runtime; through `block_in_place` on
/// a multi-threaded one, so its other tasks move to other threads meanwhile. The one
/// boundary between async tasks and the engine's synchronous calls (issue 10).
pub fn engine_call<T>(f: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current() {
        Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(f)
        }
        _ => f(),
    }
}

/// Sets how many idle rounds a core thread polls its sockets before it parks
/// ([`DEFAULT_IDLE_POLLS`]; `--core-idle-polls`). Takes effect at each core's next idle round.
pub fn set_idle_polls(polls: u32) {
    IDLE_POLLS.store(polls, Relaxed);
}

/// Sets the function that has the allocator return the calling thread's free memory to
/// the OS (`kvengine` passes mimalloc's `mi_collect(true)`; the engine and this crate do
/// not depend on an allocator). The first call wins.
///
/// `release` MUST be callable from any thread at any time; it runs between two steps of a
/// core, so it should take at most a few milliseconds.
pub fn set_memory_release(release: fn()) {
    let _ = MEMORY_RELEASE.set(release);
}

/// Asks every core thread to return its free memory to the OS once, when next idle (the
/// index shrank a lot, see [`crate::bounds`]; or a snapshot was taken, whose buffers are
/// freed across threads); the calling thread does so at once. Nothing
/// happens without [`set_memory_release`].
pub fn request_memory_release() {
    if let Some(release) = MEMORY_RELEASE.get() {
        let epoch = RELEASE_EPOCH.fetch_add(1, Relaxed) + 1;
        RELEASED.with(|r| r.set(epoch));
        release();
    }
}

/// Runs the release function if a release was asked for since this thread last ran it.
fn release_if_asked() {
    let epoch = RELEASE_EPOCH.load(Relaxed);
    if RELEASED.with(|r| r.replace(epoch)) != epoch
        && let Some(release) = MEMORY_RELEASE.get()
    {
        release();
    }
}

/// Makes `host` this thread's core.
pub fn install(host: CoreHost<Sharding>) {
    HOST.with(|h| *h.borrow_mut() = Some(host));
}

/// Runs `f` on this thread's core, if this thread is a core and the core is not already in
/// use further up this thread's stack.
pub fn with_core<R>(f: impl FnOnce(&mut CoreHost<Sharding>) -> R) -> Option<R> {
    HOST.with(|h| {
        let mut h = h.try_borrow_mut().ok()?;
        h.as_mut().map(f)
    })
}

/// Steps this thread's core between the runtime's other tasks until the core ends. Spawn it
/// on the core's runtime (a `LocalSet` or a current-thread runtime).
pub async fn drive() {
    let mut idle = 0u32;
    loop {
        let Some((progressed, finished)) = with_core(|c| (c.step(), c.finished())) else {
            return;
        };
        if finished {
            return;
        }
        wake_reply_waiters();
        if progressed {
            idle = 0;
            tokio::task::yield_now().await;
            continue;
        }
        idle += 1;
        if idle < IDLE_POLLS.load(Relaxed) {
            tokio::task::yield_now().await;
            continue;
        }
        release_if_asked();
        let _ = tokio::time::timeout(PARK, Parked { polled: false }).await;
        with_core(|c| c.awake());
        idle = 0;
    }
}

/// Wakes the tasks waiting for replies if any reply is waiting to be collected.
fn wake_reply_waiters() {
    let waiting = REPLY_WAITERS.with(|w| !w.borrow().is_empty());
    if waiting && with_core(|c| c.replies_waiting()).unwrap_or(false) {
        let wakers = REPLY_WAITERS.with(|w| std::mem::take(&mut *w.borrow_mut()));
        wakers.into_iter().for_each(std::task::Waker::wake);
    }
}

/// Overlaps of `seqs` from this thread's core without blocking it: answered in place for
/// the core's own shard, otherwise the task waits (the core keeps serving its connections
/// and stepping) for the owning core's reply, at most the engine's call timeout. `None` if
/// this thread is not a core.
pub async fn find_matches(seqs: &[SeqHash]) -> Option<engine::Result<Matches>> {
    let sent = match with_core(|c| c.start_query(seqs))? {
        Lookup::Done(r) => return Some(r),
        Lookup::Sent(sent) => sent,
    };
    let timeout = with_core(|c| c.call_timeout())?;
    let reply = tokio::time::timeout(
        timeout,
        std::future::poll_fn(|cx| match with_core(|c| c.poll_query(&sent)) {
            Some(Some(r)) => Poll::Ready(r),
            Some(None) => {
                REPLY_WAITERS.with(|w| w.borrow_mut().push(cx.waker().clone()));
                Poll::Pending
            }
            None => Poll::Ready(Err(EngineError::RuntimeStopped)),
        }),
    )
    .await;
    Some(match reply {
        Ok(r) => r,
        Err(_) => {
            let core = sent.core();
            with_core(|c| c.forget_query(sent));
            Err(EngineError::Timeout {
                core,
                waited_ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
            })
        }
    })
}

/// Pending until a message for the core arrives (its pusher wakes this task).
struct Parked {
    polled: bool,
}

impl Future for Parked {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.polled {
            return Poll::Ready(());
        }
        self.polled = true;
        match with_core(|c| c.sleep_as(cx.waker())) {
            Some(true) => Poll::Pending,
            _ => Poll::Ready(()),
        }
    }
}

/// Takes this thread's core and runs it to its end (every client and peer gone); `None` if
/// this thread has no core.
pub fn finish() -> Option<CoreSummary> {
    let host = HOST.with(|h| h.borrow_mut().take())?;
    Some(host.run_to_end())
}

#[cfg(test)]
mod tests {
    use super::*;

    static RELEASES: AtomicU64 = AtomicU64::new(0);

    fn count_release() {
        RELEASES.fetch_add(1, Relaxed);
    }

    #[test]
    fn every_thread_releases_once_per_request() {
        set_memory_release(count_release);
        let before = RELEASES.load(Relaxed);
        request_memory_release();
        assert_eq!(RELEASES.load(Relaxed), before + 1, "the caller at once");
        release_if_asked();
        assert_eq!(
            RELEASES.load(Relaxed),
            before + 1,
            "not twice on one thread"
        );
        let other = std::thread::spawn(|| {
            release_if_asked();
            release_if_asked();
        });
        other.join().unwrap();
        assert_eq!(RELEASES.load(Relaxed), before + 2, "once on another thread");
    }
}
