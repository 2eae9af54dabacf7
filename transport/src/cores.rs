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
//! 5. [`drive`] gives the runtime a turn in every idle round, whatever
//!    [`set_idle_polls`] says: a core that found something it cannot do yet (a reply
//!    waiting for a task of this thread to collect it) yields instead of trying to park
//!    again at once, which would spin without ever running that task.
//! 6. A park is bounded by one timer per core that lives as long as [`drive`] and is armed
//!    again only once it has fired, so at most one timer registration per `PARK` (20 ms) per
//!    core. Registering a timer earlier than the time driver's next wake-up makes tokio
//!    write the runtime's eventfd (`time::Handle::reregister` unparks the driver, even from
//!    the runtime's own thread): a fresh timeout per park cost every park a system call and
//!    an `epoll_wait` that returned at once (measured on the Mooncake replay,
//!    docs/benchmarks.md, issue 31).
//! 7. An idle round puts [`drive`] at the back of its runtime's run queue (`Requeued`):
//!    the thread's other ready tasks run, but the sockets are not polled for it (the
//!    runtime polls them every few dozen tasks and whenever the core parks). A
//!    `yield_now` per idle round made each one an `epoll_wait` system call; the rounds are
//!    there to catch a busy peer core's next message on the rings, which needs no system
//!    call. After a round that did work, [`drive`] still yields with a poll of the sockets.

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

/// Idle rounds (each lets the thread's other ready tasks run, invariant 7) before the core
/// parks: long enough to catch the next message of a busy peer core without a wake-up,
/// short enough that an idle core leaves its CPU to others. Measured on the Mooncake replay
/// through the proxy (docs/benchmarks.md, "Issue 31"), when each round was a `yield_now`
/// and so an `epoll_wait`: 64 spent 0.5-0.7 s more router CPU per 1,000 requests than 8
/// with no better latency. (1 spent 80% more, but that was the spin invariant 5 removed.)
pub const DEFAULT_IDLE_POLLS: u32 = 8;
/// [`DEFAULT_IDLE_POLLS`] unless [`set_idle_polls`] said otherwise.
static IDLE_POLLS: AtomicU32 = AtomicU32::new(DEFAULT_IDLE_POLLS);
/// Longest park: bounds the cost of a missed wake-up (none is expected). One timer per
/// core, armed again only once it fired (invariant 6), so a park may end sooner.
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
    // The parks' bound (invariant 6): registered at the first park, re-armed once fired.
    let bound = tokio::time::sleep(PARK);
    tokio::pin!(bound);
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
            // An idle round lets the thread's other ready tasks run, without a poll of the
            // sockets (invariant 7).
            Requeued { polled: false }.await;
            continue;
        }
        release_if_asked();
        if bound.is_elapsed() {
            bound.as_mut().reset(tokio::time::Instant::now() + PARK);
        }
        let slept = Parked {
            polled: false,
            bound: bound.as_mut(),
        }
        .await;
        with_core(|c| c.awake());
        idle = 0;
        if !slept {
            // Something is queued that this round could not take (invariant 5).
            tokio::task::yield_now().await;
        }
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

/// Ready at its second poll: the task wakes itself at its first, which puts it at the back
/// of the current-thread runtime's local run queue (a `yield_now` is deferred until the
/// runtime has polled its I/O driver instead).
struct Requeued {
    polled: bool,
}

impl Future for Requeued {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.polled {
            return Poll::Ready(());
        }
        self.polled = true;
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

/// Pending until a message for the core arrives (its pusher wakes this task) or `bound`
/// fires; `true` if it went to sleep, `false` if something was already queued.
struct Parked<'a> {
    polled: bool,
    bound: Pin<&'a mut tokio::time::Sleep>,
}

impl Future for Parked<'_> {
    type Output = bool;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<bool> {
        if self.polled {
            return Poll::Ready(true);
        }
        match with_core(|c| c.sleep_as(cx.waker())) {
            Some(true) => {}
            _ => return Poll::Ready(false),
        }
        self.polled = true;
        // Registers the bound (only its waker, once it is registered): woken by either.
        match self.bound.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(true),
            Poll::Pending => Poll::Pending,
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
    /// Held by each test: the core threads of one would run the release the other counts.
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

    fn count_release() {
        RELEASES.fetch_add(1, Relaxed);
    }

    /// Two hosted cores on threads of their own, each stepped by [`drive`] on a
    /// current-thread runtime, with one idle round before a park: a query from core 0 for
    /// core 1's shard is answered. Core 1 starts only once the query waits for its reply,
    /// so the reply always lands while core 0's task waits. Before invariant 5, core 0 then
    /// found the reply queued, could not park, and tried again at once without ever
    /// yielding, so the task waiting for the reply never ran (a livelock whenever nothing
    /// else came in).
    #[test]
    fn a_query_for_the_other_core_is_answered_with_one_idle_round() {
        use engine::runtime::{RuntimeConfig, start_hosted};
        use engine::sharding::{ShardId, ShardPolicy};
        let _alone = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
        set_idle_polls(1);
        let policy = Sharding::adaptive(2).unwrap();
        let seqs: Vec<SeqHash> = (1u64..)
            .map(|h: u64| h.wrapping_mul(0x9e37_79b9_7f4a_7c15))
            .map(|h| vec![SeqHash(h), SeqHash(h.rotate_left(17))])
            .find(|s| policy.query_shard(s) == ShardId(1))
            .unwrap();
        let config = RuntimeConfig {
            pin_cores: false,
            // The path under test is a forwarded query's reply; reads in place would
            // answer at once.
            read_others_in_place: false,
            ..RuntimeConfig::default()
        };
        let hosted = start_hosted(policy, config).unwrap();
        let (answer_tx, answer_rx) = std::sync::mpsc::channel();
        let (waiting_tx, waiting_rx) = std::sync::mpsc::channel::<()>();
        let mut waiting = (Some(waiting_tx), Some(waiting_rx));
        let mut stops = Vec::new();
        let mut threads = Vec::new();
        for (k, host) in hosted.cores.into_iter().enumerate() {
            let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
            stops.push(stop_tx);
            let (answer_tx, seqs) = (answer_tx.clone(), seqs.clone());
            let (tell, wait) = if k == 0 {
                (waiting.0.take(), None)
            } else {
                (None, waiting.1.take())
            };
            threads.push(std::thread::spawn(move || {
                if let Some(wait) = wait {
                    wait.recv().unwrap();
                }
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                install(host);
                rt.block_on(async move {
                    tokio::spawn(drive());
                    if let Some(tell) = tell {
                        let query = find_matches(&seqs);
                        tokio::pin!(query);
                        let first =
                            std::future::poll_fn(|cx| Poll::Ready(query.as_mut().poll(cx))).await;
                        let answer = match first {
                            Poll::Ready(a) => a,
                            Poll::Pending => {
                                tell.send(()).unwrap();
                                query.await
                            }
                        };
                        let _ = answer_tx.send(answer);
                    }
                    let _ = stop_rx.await;
                });
                drop(rt);
                finish()
            }));
        }
        drop((hosted.ingest, hosted.query));
        let answer = answer_rx.recv_timeout(Duration::from_secs(30));
        set_idle_polls(DEFAULT_IDLE_POLLS);
        let matches = answer
            .expect("core 0 never collected core 1's reply")
            .expect("core 0 is a core")
            .expect("core 1 answers");
        assert_eq!(
            matches,
            Matches::default(),
            "an empty index matches nothing"
        );
        drop(stops);
        for t in threads {
            assert!(t.join().unwrap().is_some(), "each thread had its core");
        }
    }

    #[test]
    fn every_thread_releases_once_per_request() {
        let _alone = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
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
