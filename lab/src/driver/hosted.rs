//! [`IndexerUnderTest`] for the runtime with its cores hosted on the benchmark's own threads
//! ([`engine::runtime::start_hosted`]), as kvengine's HTTP edge hosts them: each thread owns
//! one core ([`CoreHost`]), applies its producer streams through it and issues its queries
//! through it, stepping the core between (and while waiting for) everything else.
//!
//! `cores` is the number of threads, one per core and shard, spawned by
//! [`HostedUnderTest::new`] and kept for the driver's life. There are no producer or query
//! threads: producer stream `i` and mixed-phase query list `t` run on core thread `i % cores`
//! and `t % cores`. The harness's thread only sends commands to the core threads and waits
//! for their replies.
//!
//! # Invariants
//! 1. Thread `k` is the only user of core `k`'s host. Whenever it has no command it keeps
//!    stepping the core (spinning, then yielding, then parking as a task that any message
//!    for the core wakes; a command unparks it too), so the other cores' operations,
//!    forwarded queries and syncs are always served.
//! 2. `apply_all`: stream `i` is sent through core `i % cores` (streams of one core one
//!    after the other, each in order), then every core that sent something settles (syncs,
//!    then waits until the trunk promotions the events caused are done, as the threaded
//!    driver's producers do); `apply_all` returns once every core replied, so every event
//!    is applied and visible to the next query (driver invariant 1).
//! 3. `query` and `stats` go through core 0's host: a query for shard 0 is read in place,
//!    any other is forwarded to its core. The harness's timing of `query` includes the hop
//!    from its thread to core 0's thread and back.
//! 4. `mixed`: the streams are cut into batches of `plan.events_per_query` events (each a
//!    shared slice of its own, as a transport's decoder delivers them) before the clock
//!    starts. Each core thread repeats, until every core's streams are applied and settled:
//!    send its streams' next batch (in turn between its streams), issue one query from each
//!    of its query lists (each cyclically; only the `find_matches` call is timed, into the
//!    same latency histograms as the threaded driver), step its core once. Its last batch
//!    sent, it settles, then keeps querying until the other cores have settled too. The
//!    phase's time runs from before the commands are sent until the last core settled.
//! 5. `query_callers`: caller `c` runs on core thread `c` (all callers start together,
//!    stepping their cores while they wait for each other), stepping its core after each
//!    query (untimed: a query read in place does not step, and the other callers' forwarded
//!    queries must be answered); one caller more than there are cores runs on a thread of
//!    its own with the runtime's handle for threads that are not cores (so a one-core run
//!    still serves two callers).
//! 6. Dropping the driver stops the command loops, drops the handles for threads that are
//!    not cores, runs each core to its end on its thread ([`CoreHost::run_to_end`]) and
//!    joins the threads.
//!
//! # Where it differs from the threaded driver
//! * Queries are issued by the core threads, so every caller, even a single one, runs on a
//!   thread other than the harness's (the trait asks for the calling thread when K = 1).
//! * The mixed phase interleaves events and queries on each core thread, one query per
//!   list after every batch of `plan.events_per_query` events (which threaded drivers
//!   otherwise ignore), concurrently across cores: `mixed_mode` says `concurrent` with two
//!   cores or more and `interleaved` with one.

use super::callers::{CallerRun, one_caller, outcome};
use super::{
    CallersOutcome, IndexerStats, IndexerUnderTest, MixedMode, MixedOutcome, MixedPlan,
    latency_histogram,
};
use crate::workload::{EventStream, Query};
use anyhow::{Context, Result, anyhow, bail};
use engine::runtime::{
    CoreHost, CoreSummary, IngestHandle, QueryHandle, RuntimeConfig, start_hosted,
};
use engine::sharding::ShardPolicy;
use engine::sharding::choice::Sharding;
use engine::{Matches, SeqHash};
use hdrhistogram::Histogram;
use std::hint::black_box;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, Sender, TryRecvError, channel};
use std::task::Wake;
use std::thread::{JoinHandle, Thread};
use std::time::{Duration, Instant};

/// Empty polls of a core thread with no command before it yields (as a core thread does).
const SPIN_ROUNDS: u32 = 64;
/// Empty polls before an idle core thread parks. Measured here (2-CPU EPYC, 2 cores, the
/// harness's thread beside them, `--size 131072`): single-query p99 20-30 us at 1,064
/// rounds against 165-250 us at the 80 a runtime core uses when it shares its CPU, because
/// a core that parks between two forwarded queries is woken for each.
const YIELD_ROUNDS: u32 = 1_064;
/// Longest park of an idle core thread (commands and messages for the core wake it).
const PARK: Duration = Duration::from_millis(20);
/// Longest wait of a query caller for the others to start.
const READY_WAIT: Duration = Duration::from_secs(60);

/// What the harness asks of a core thread.
enum Cmd {
    /// Send these streams (in turn, each in order) through the core, then settle.
    Apply(Vec<EventStream>),
    /// One query.
    Query(Box<[SeqHash]>),
    /// Every core's figures.
    Stats,
    /// Run `list` as one caller once `ready` (a countdown shared by every caller) is 0.
    Caller {
        list: Vec<Query>,
        keep: bool,
        ready: Arc<AtomicUsize>,
    },
    /// A mixed-phase share (invariant 4): `batches[s]` is one stream cut into batches.
    Mixed {
        batches: Vec<Vec<EventStream>>,
        lists: Vec<Vec<Query>>,
        producing: Arc<AtomicUsize>,
    },
}

/// A core thread's answer to a [`Cmd`].
enum Reply {
    Done,
    Matches(Matches),
    Stats(Vec<CoreSummary>),
    Caller(CallerRun),
    Mixed {
        hist: Histogram<u64>,
        settled: Option<Instant>,
    },
}

/// The harness's side of one core thread.
struct CoreThread {
    cmds: Sender<Cmd>,
    replies: Receiver<Result<Reply>>,
    thread: Thread,
    join: JoinHandle<CoreSummary>,
}

impl CoreThread {
    /// Sends `cmd` and wakes the thread if it is parked.
    fn send(&self, cmd: Cmd) -> Result<()> {
        self.cmds
            .send(cmd)
            .map_err(|_| anyhow!("core thread {} is gone", self.name()))?;
        self.thread.unpark();
        Ok(())
    }

    /// The reply to the last command. The harness's thread blocks at once: polling for the
    /// reply takes a CPU from a core thread (measured: a single query's p50 went from 16 us
    /// to 75 us with 2,048 polls first, and to milliseconds with more).
    fn recv(&self) -> Result<Reply> {
        self.replies
            .recv()
            .map_err(|_| anyhow!("core thread {} is gone", self.name()))?
    }

    fn name(&self) -> &str {
        self.thread.name().unwrap_or("?")
    }
}

/// Unparks a core thread: the task waker it parks as ([`CoreHost::sleep_as`]).
struct Unpark(Thread);

impl Wake for Unpark {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.0.unpark();
    }
}

/// The hosted runtime: one thread per core.
pub struct HostedUnderTest {
    threads: Vec<CoreThread>,
    ingest: Option<IngestHandle>,
    query: Option<QueryHandle<Sharding>>,
    shards: usize,
    sharding: String,
    producers: usize,
    query_threads: usize,
}

impl std::fmt::Debug for HostedUnderTest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostedUnderTest")
            .field("shards", &self.shards)
            .field("sharding", &self.sharding)
            .finish_non_exhaustive()
    }
}

impl HostedUnderTest {
    /// One thread per shard of `sharding`, each hosting its core (pinned to the core's CPU
    /// if `pin`); `producers` and `query_threads` are the workload's streams and mixed query
    /// lists, named in the report (they run on the core threads).
    pub fn new(
        sharding: Sharding,
        producers: usize,
        query_threads: usize,
        pin: bool,
    ) -> Result<Self> {
        let shards = sharding.shards();
        let described = sharding.describe();
        let config = RuntimeConfig {
            ring_capacity: 256,
            pin_cores: pin,
            ..RuntimeConfig::default()
        };
        let hosted = start_hosted(sharding, config).context("starting the hosted runtime")?;
        let mut threads = Vec::with_capacity(shards);
        for (k, host) in hosted.cores.into_iter().enumerate() {
            let (cmd_tx, cmd_rx) = channel();
            let (reply_tx, reply_rx) = channel();
            let join = std::thread::Builder::new()
                .name(format!("kvengine-hosted-{k}"))
                .spawn(move || {
                    if pin {
                        host.pin_current_thread();
                    }
                    core_thread(host, &cmd_rx, &reply_tx)
                })
                .context("spawning a core thread")?;
            threads.push(CoreThread {
                cmds: cmd_tx,
                replies: reply_rx,
                thread: join.thread().clone(),
                join,
            });
        }
        Ok(Self {
            threads,
            ingest: Some(hosted.ingest),
            query: Some(hosted.query),
            shards,
            sharding: described,
            producers,
            query_threads,
        })
    }

    fn core0(&self) -> Result<&CoreThread> {
        self.threads.first().context("no core thread")
    }

    /// `items[i]` for every `i` with `i % cores == k`, per core `k`.
    fn by_core<T: Clone>(&self, items: &[T]) -> Vec<Vec<T>> {
        let n = self.threads.len().max(1);
        let mut out: Vec<Vec<T>> = (0..n).map(|_| Vec::new()).collect();
        for (i, item) in items.iter().enumerate() {
            if let Some(v) = out.get_mut(i % n) {
                v.push(item.clone());
            }
        }
        out
    }
}

/// Sends `cmds[k]` to core thread `k` (where given), then collects every reply; the first
/// error is returned once every thread that got a command has replied.
fn on_cores(threads: &[CoreThread], cmds: Vec<Option<Cmd>>) -> Result<Vec<Option<Reply>>> {
    let mut sent = Vec::with_capacity(cmds.len());
    let mut first_err = None;
    for (t, cmd) in threads.iter().zip(cmds) {
        let ok = match cmd.map(|c| t.send(c)) {
            Some(Ok(())) => true,
            Some(Err(e)) => {
                first_err = first_err.or(Some(e));
                false
            }
            None => false,
        };
        sent.push(ok);
    }
    let mut replies = Vec::with_capacity(sent.len());
    for (t, ok) in threads.iter().zip(sent) {
        if !ok {
            replies.push(None);
            continue;
        }
        match t.recv() {
            Ok(r) => replies.push(Some(r)),
            Err(e) => {
                first_err = first_err.or(Some(e));
                replies.push(None);
            }
        }
    }
    match first_err {
        Some(e) => Err(e),
        None => Ok(replies),
    }
}

/// Counts this caller in and waits, doing `work` meanwhile, until every caller has counted
/// in (so they start together), at most [`READY_WAIT`].
fn start_together(ready: &AtomicUsize, mut work: impl FnMut() -> bool) -> Result<()> {
    ready.fetch_sub(1, Ordering::AcqRel);
    let deadline = Instant::now() + READY_WAIT;
    while ready.load(Ordering::Acquire) > 0 {
        if !work() {
            if Instant::now() > deadline {
                bail!("the other query callers did not start");
            }
            std::thread::yield_now();
        }
    }
    Ok(())
}

/// Thread `k`'s life: commands until the harness is gone, stepping the core in between
/// (invariant 1); then the core runs to its end.
fn core_thread(
    mut host: CoreHost<Sharding>,
    cmds: &Receiver<Cmd>,
    replies: &Sender<Result<Reply>>,
) -> CoreSummary {
    let task = std::task::Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut idle = 0u32;
    loop {
        match cmds.try_recv() {
            Ok(cmd) => {
                idle = 0;
                let reply = run_cmd(&mut host, cmd);
                if replies.send(reply).is_err() {
                    break;
                }
                continue;
            }
            Err(TryRecvError::Disconnected) => break,
            Err(TryRecvError::Empty) => {}
        }
        if host.step() {
            idle = 0;
            continue;
        }
        idle = idle.saturating_add(1);
        if idle < SPIN_ROUNDS {
            std::hint::spin_loop();
        } else if idle < YIELD_ROUNDS {
            std::thread::yield_now();
        } else {
            // Parked as a task: a message for the core wakes it through `task`, a command
            // through `CoreThread::send`'s unpark (a token left before the park counts).
            if host.sleep_as(&task) {
                std::thread::park_timeout(PARK);
            }
            host.awake();
            idle = 0;
        }
    }
    host.run_to_end()
}

fn run_cmd(host: &mut CoreHost<Sharding>, cmd: Cmd) -> Result<Reply> {
    match cmd {
        Cmd::Apply(streams) => {
            for s in &streams {
                host.send(s)?;
            }
            if !streams.is_empty() {
                settle(host)?;
            }
            Ok(Reply::Done)
        }
        Cmd::Query(seqs) => Ok(Reply::Matches(host.find_matches(&seqs)?)),
        Cmd::Stats => Ok(Reply::Stats(host.core_stats()?)),
        Cmd::Caller { list, keep, ready } => {
            start_together(&ready, || host.step())?;
            // A query answered in place does not step the core: step it after each, so the
            // queries the other callers forward here are answered.
            one_caller(host, &list, keep, &|h, q| Ok(h.find_matches(q)?), &|h| {
                h.step();
            })
            .map(Reply::Caller)
        }
        Cmd::Mixed {
            batches,
            lists,
            producing,
        } => mixed_share(host, &batches, &lists, &producing),
    }
}

/// Like [`IngestHandle::settle`]: until every core applied what this host sent, and the
/// trunk promotions that caused are done.
fn settle(host: &mut CoreHost<Sharding>) -> Result<()> {
    loop {
        host.sync()?;
        let cores = host.core_stats()?;
        let reported: u64 = cores.iter().map(|c| c.junctions_reported).sum();
        let heard: u64 = cores.iter().map(|c| c.junctions_heard).sum();
        if reported == heard && cores.iter().all(|c| !c.promoting) {
            return Ok(());
        }
        if !host.step() {
            std::thread::yield_now();
        }
    }
}

/// One core's part of the mixed phase (invariant 4).
fn mixed_share(
    host: &mut CoreHost<Sharding>,
    batches: &[Vec<EventStream>],
    lists: &[Vec<Query>],
    producing: &AtomicUsize,
) -> Result<Reply> {
    let mut hist = latency_histogram();
    let lists: Vec<&Vec<Query>> = lists.iter().filter(|l| !l.is_empty()).collect();
    let mut cursors = vec![0usize; lists.len()];
    let mut next = vec![0usize; batches.len()];
    let mut stream = 0usize;
    let mut left: usize = batches.iter().map(Vec::len).sum();
    let producer = left > 0;
    let mut settled = None;
    loop {
        if left > 0 {
            // This core's streams' next batch, in turn between them.
            for _ in 0..batches.len() {
                let s = stream;
                stream = (stream + 1) % batches.len();
                if let (Some(b), Some(n)) = (batches.get(s), next.get_mut(s))
                    && let Some(batch) = b.get(*n)
                {
                    *n += 1;
                    left -= 1;
                    host.send(batch)?;
                    break;
                }
            }
        } else if producer && settled.is_none() {
            settle(host)?;
            settled = Some(Instant::now());
            producing.fetch_sub(1, Ordering::AcqRel);
        }
        if left == 0 && producing.load(Ordering::Acquire) == 0 {
            break;
        }
        for (l, c) in lists.iter().zip(cursors.iter_mut()) {
            let Some(q) = l.get(*c) else { continue };
            *c = (*c + 1) % l.len();
            let t = Instant::now();
            black_box(host.find_matches(black_box(q))?);
            hist.saturating_record(t.elapsed().as_nanos() as u64);
        }
        if !host.step() && left == 0 && lists.is_empty() {
            std::hint::spin_loop();
        }
    }
    Ok(Reply::Mixed { hist, settled })
}

/// `stream` cut into shared slices of `size` events.
fn batches(stream: &EventStream, size: usize) -> Vec<EventStream> {
    stream
        .chunks(size.max(1))
        .map(|c| Arc::from(c.to_vec()))
        .collect()
}

impl IndexerUnderTest for HostedUnderTest {
    fn name(&self) -> String {
        format!(
            "hosted-runtime(cores={}, {}, threads={}, producers={} and query_threads={} on the \
             core threads)",
            self.shards,
            self.sharding,
            self.threads.len(),
            self.producers,
            self.query_threads
        )
    }

    fn cores(&self) -> usize {
        self.shards
    }

    fn apply_all(&mut self, streams: &[EventStream]) -> Result<()> {
        let cmds = self
            .by_core(streams)
            .into_iter()
            .map(|s| Some(Cmd::Apply(s)))
            .collect();
        on_cores(&self.threads, cmds)?;
        Ok(())
    }

    fn query(&mut self, seqs: &[SeqHash]) -> Result<Matches> {
        let t = self.core0()?;
        t.send(Cmd::Query(seqs.into()))?;
        match t.recv()? {
            Reply::Matches(m) => Ok(m),
            _ => bail!("core thread 0 answered a query with something else"),
        }
    }

    fn mixed(
        &mut self,
        streams: &[EventStream],
        queries: &[Vec<Query>],
        plan: &MixedPlan,
    ) -> Result<MixedOutcome> {
        let cut: Vec<Vec<EventStream>> = streams
            .iter()
            .map(|s| batches(s, plan.events_per_query))
            .collect();
        let cut = self.by_core(&cut);
        let lists = self.by_core(queries);
        let producers = cut
            .iter()
            .filter(|b| b.iter().any(|s| !s.is_empty()))
            .count();
        let producing = Arc::new(AtomicUsize::new(producers));
        let cmds = cut
            .into_iter()
            .zip(lists)
            .map(|(batches, lists)| {
                Some(Cmd::Mixed {
                    batches,
                    lists,
                    producing: producing.clone(),
                })
            })
            .collect();
        let start = Instant::now();
        let replies = on_cores(&self.threads, cmds)?;
        let mut last = start;
        let mut hist = latency_histogram();
        for r in replies.into_iter().flatten() {
            let Reply::Mixed { hist: h, settled } = r else {
                bail!("a core thread answered the mixed phase with something else");
            };
            hist.add(&h).context("merging latencies")?;
            last = last.max(settled.unwrap_or(start));
        }
        Ok(MixedOutcome {
            elapsed: last.saturating_duration_since(start),
            latencies_ns: hist,
        })
    }

    fn mixed_mode(&self) -> MixedMode {
        if self.shards > 1 {
            MixedMode::Concurrent
        } else {
            MixedMode::Interleaved
        }
    }

    fn query_callers(&mut self, lists: &[&[Query]], keep: bool) -> Result<CallersOutcome> {
        if lists.len() > self.max_callers() {
            bail!(
                "{} callers but {} query paths",
                lists.len(),
                self.max_callers()
            );
        }
        let core_callers = lists.len().min(self.threads.len());
        let outsider = lists.get(self.threads.len()).copied();
        let ready = Arc::new(AtomicUsize::new(lists.len()));
        let mut cmds: Vec<Option<Cmd>> = lists
            .iter()
            .take(core_callers)
            .map(|l| {
                Some(Cmd::Caller {
                    list: l.to_vec(),
                    keep,
                    ready: ready.clone(),
                })
            })
            .collect();
        cmds.resize_with(self.threads.len(), || None);
        let query = &mut self.query;
        let threads = &self.threads;
        let (core_runs, outsider_run) = std::thread::scope(|s| -> Result<_> {
            let extra = match (outsider, query.as_mut()) {
                (Some(list), Some(h)) => {
                    let ready = ready.clone();
                    Some(s.spawn(move || {
                        start_together(&ready, || false)?;
                        one_caller(h, list, keep, &|h, q| Ok(h.find_matches(q)?), &|_| {})
                    }))
                }
                (Some(_), None) => bail!("the handle for threads that are not cores is gone"),
                _ => None,
            };
            let core_runs = on_cores(threads, cmds);
            let extra = match extra {
                Some(t) => Some(t.join().map_err(|_| anyhow!("a caller panicked"))??),
                None => None,
            };
            Ok((core_runs?, extra))
        })?;
        let mut runs = Vec::with_capacity(lists.len());
        for r in core_runs.into_iter().flatten() {
            let Reply::Caller(run) = r else {
                bail!("a core thread answered a caller with something else");
            };
            runs.push(run);
        }
        runs.extend(outsider_run);
        Ok(outcome(runs))
    }

    fn max_callers(&self) -> usize {
        self.threads.len() + usize::from(self.query.is_some())
    }

    fn stats(&mut self) -> Result<IndexerStats> {
        let t = self.core0()?;
        t.send(Cmd::Stats)?;
        let Reply::Stats(cores) = t.recv()? else {
            bail!("core thread 0 answered stats with something else");
        };
        Ok(IndexerStats {
            live_entries: cores.iter().map(|s| s.directory_entries as u64).sum(),
            bytes: cores
                .iter()
                .map(|s| s.directory_bytes + s.index.bytes)
                .sum(),
            shard_ops: cores.iter().map(|s| s.applied).collect(),
            anomalies: cores
                .iter()
                .map(|s| s.inconsistencies + s.rejects.total())
                .sum::<u64>(),
        })
    }
}

impl Drop for HostedUnderTest {
    fn drop(&mut self) {
        // Closing the command channels ends each thread's command loop (invariant 6).
        let mut joins = Vec::with_capacity(self.threads.len());
        for t in self.threads.drain(..) {
            let CoreThread {
                cmds,
                replies,
                thread,
                join,
            } = t;
            drop((cmds, replies));
            thread.unpark();
            joins.push(join);
        }
        // The cores end once every client is gone: these handles are the last.
        self.ingest = None;
        self.query = None;
        for j in joins {
            let _ = j.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::anchor::{self, AnchorOptions};
    use crate::harness::{RunOptions, run};
    use crate::workload::anchor::{AnchorPlan, AnchorSpec};
    use crate::workload::{Plan, WorkloadKind, WorkloadSpec};

    fn hosted(cores: usize, producers: usize, query_threads: usize) -> HostedUnderTest {
        let sharding = Sharding::adaptive(cores).unwrap();
        HostedUnderTest::new(sharding, producers, query_threads, false).unwrap()
    }

    #[test]
    fn harness_self_checks_pass_and_every_thread_ends() {
        for (cores, producers, query_threads) in [(1, 1, 1), (2, 1, 1), (2, 3, 3), (3, 2, 1)] {
            let spec = WorkloadSpec {
                kind: WorkloadKind::Dynamo,
                size: 4_000,
                depth: 16,
                workers: 6,
                queries: 200,
                producers,
                query_threads,
                ..WorkloadSpec::default()
            };
            let plan = Plan::generate(&spec).unwrap();
            let mut ix = hosted(cores, producers, query_threads);
            let report = run(&mut ix, &plan, &RunOptions::default()).unwrap();
            assert!(
                report.checks.problems().is_empty(),
                "{cores} cores: {:?}",
                report.checks.problems()
            );
            assert_eq!(report.cores, cores);
            if cores == 1 {
                assert_eq!(ix.mixed_mode(), MixedMode::Interleaved);
                // One core with its producer and its query list: a query after every batch.
                assert!(report.phases.mixed.queries > 0);
            }
            drop(ix);
        }
    }

    #[test]
    fn callers_beyond_the_cores_use_the_outsiders_handle() {
        let mut ix = hosted(1, 1, 1);
        assert_eq!(ix.max_callers(), 2);
        let q: Query = Arc::from(vec![SeqHash(7); 3]);
        let lists = vec![q.clone(); 5];
        let out = ix.query_callers(&[&lists, &lists[..2]], true).unwrap();
        assert_eq!(out.answers.iter().map(Vec::len).collect::<Vec<_>>(), [5, 2]);
        assert_eq!(out.queries(), 7);
        assert!(ix.query_callers(&[&lists, &lists, &lists], false).is_err());
    }

    #[test]
    fn anchor_self_checks_pass_on_one_and_two_cores() {
        let spec = AnchorSpec::of(WorkloadKind::DynamoW1).unwrap();
        let spec = AnchorSpec {
            size: spec.depth * spec.workers as usize * 2,
            queries: 200,
            ..spec
        };
        let plan = AnchorPlan::generate(&spec).unwrap();
        for cores in [1, 2] {
            let opts = AnchorOptions {
                warmup: 0,
                repeat: 1,
                progress: false,
                release_memory: None,
            };
            let mut make =
                || -> Result<Box<dyn IndexerUnderTest>> { Ok(Box::new(hosted(cores, 1, 1))) };
            let report = anchor::run(&mut make, &plan, &opts).unwrap();
            assert!(report.checks_passed, "{cores} cores: {:?}", report.problems);
        }
    }
}
