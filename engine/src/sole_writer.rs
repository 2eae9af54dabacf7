//! A value that one thread writes and other threads read in place: a core's shard, which
//! only its core mutates and which the hosts of the other cores read for their queries
//! (`runtime::hosted` invariant 3) instead of asking that core over a ring.
//!
//! One [`SoleWriter`] (not `Clone`) and any number of [`Reader`]s share the value.
//!
//! # Invariants
//! 1. Only the writer mutates the value, and only inside [`SoleWriter::write`].
//! 2. The writer's own reads ([`SoleWriter::read`]) take no lock and touch no shared word:
//!    nobody else writes, and its writes need `&mut self`, so its reads never overlap them.
//! 3. A write runs only with the `WRITING` bit set and no reader counted; a reader's read
//!    runs only with its count taken while `WRITING` was clear. So a write never overlaps
//!    a reader's read.
//! 4. The writer is preferred: once it sets `WRITING`, new readers back off until it is
//!    done, so a write waits at most for the reads already begun (one query each). Both
//!    sides spin, neither sleeps (no futex on either path): the callers keep their write
//!    sections short (a shard's core writes at most one chunk of blocks per section),
//!    and a reader that has spun long yields its thread, in case the writer's was
//!    preempted mid-section.
//!
//! # Memory orderings
//! * The writer ends a section with a Release clear of `WRITING`; a reader takes its count
//!   with an Acquire RMW that sees the bit clear, so it sees every write before it.
//! * A reader ends its read with a Release decrement; the writer waits for the count with
//!   Acquire loads, so the reader's loads happen before the writer's next stores.
//! * Both RMWs are on one word, so a reader's increment and the writer's `WRITING` set are
//!   ordered: either the writer's wait sees the count, or the reader's RMW sees the bit.
//!
//! The word sits on a 128-byte line of its own: readers write it on every read.

use crate::sync::{Arc, AtomicUsize, Ordering, UnsafeCell, spin_hint};

/// The writer is in a section (or waiting for the readers to leave, to start one).
const WRITING: usize = 1;
/// One reader, counted above the `WRITING` bit.
const READER: usize = 2;
/// Spins of a waiting reader before it yields its thread at every further poll.
const SPINS_BEFORE_YIELD: u32 = 1 << 12;

#[repr(align(128))]
struct Padded<T>(T);

struct Shared<T> {
    state: Padded<AtomicUsize>,
    value: UnsafeCell<T>,
}

// SAFETY: readers on several threads get `&T` (so `T: Sync`), and the writer's thread,
// which may differ from the thread that made it, gets `&mut T` (so `T: Send`); a write
// never overlaps a read by invariants 2 and 3, ordered as in the module docs.
unsafe impl<T: Send + Sync> Sync for Shared<T> {}
// SAFETY: as above; the last handle dropped, on any thread, drops the `T`.
unsafe impl<T: Send + Sync> Send for Shared<T> {}

/// The one handle that may write the value. See the module docs.
pub(crate) struct SoleWriter<T> {
    shared: Arc<Shared<T>>,
}

/// A handle that reads the value from any thread, waiting out the writer's sections.
pub(crate) struct Reader<T> {
    shared: Arc<Shared<T>>,
}

impl<T> Clone for Reader<T> {
    fn clone(&self) -> Self {
        Self {
            shared: self.shared.clone(),
        }
    }
}

impl<T> std::fmt::Debug for Reader<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Reader")
    }
}

impl<T> SoleWriter<T> {
    /// Shares `value`: this handle writes it, [`SoleWriter::reader`]s read it.
    pub(crate) fn new(value: T) -> Self {
        Self {
            shared: Arc::new(Shared {
                state: Padded(AtomicUsize::new(0)),
                value: UnsafeCell::new(value),
            }),
        }
    }

    /// A handle for another thread to read the value with.
    pub(crate) fn reader(&self) -> Reader<T> {
        Reader {
            shared: self.shared.clone(),
        }
    }

    /// Reads the value, without a lock (invariant 2).
    #[inline]
    pub(crate) fn read<R>(&self, f: impl FnOnce(&T) -> R) -> R {
        // SAFETY: only this handle writes (invariant 1), and `write` needs `&mut self`, so
        // no write runs while this shared borrow lives; readers only read.
        self.shared.value.with(|p| f(unsafe { &*p }))
    }

    /// Writes the value once the reads in progress are done; readers wait meanwhile, so
    /// keep `f` short (invariant 4).
    #[inline]
    pub(crate) fn write<R>(&mut self, f: impl FnOnce(&mut T) -> R) -> R {
        let state = &self.shared.state.0;
        state.fetch_or(WRITING, Ordering::Acquire);
        while state.load(Ordering::Acquire) != WRITING {
            spin_hint();
        }
        // Clears the bit however `f` ends (a panic in a core aborts the process anyway).
        struct Done<'a>(&'a AtomicUsize);
        impl Drop for Done<'_> {
            fn drop(&mut self) {
                self.0.fetch_and(!WRITING, Ordering::Release);
            }
        }
        let _done = Done(state);
        // SAFETY: `WRITING` is set and no reader is counted, so no reader reads until it is
        // cleared (invariant 3); `&mut self` excludes this handle's own reads.
        self.shared.value.with_mut(|p| f(unsafe { &mut *p }))
    }
}

impl<T> Reader<T> {
    /// Reads the value, waiting (spinning) while the writer is in a section.
    #[inline]
    pub(crate) fn read<R>(&self, f: impl FnOnce(&T) -> R) -> R {
        let state = &self.shared.state.0;
        let mut spins = 0u32;
        loop {
            // The writer is in (or entering) a section: wait until it is done.
            while state.load(Ordering::Relaxed) & WRITING != 0 {
                if spins < SPINS_BEFORE_YIELD {
                    spins += 1;
                    spin_hint();
                } else {
                    yield_thread();
                }
            }
            if state.fetch_add(READER, Ordering::Acquire) & WRITING == 0 {
                break;
            }
            // It came in between: back off.
            state.fetch_sub(READER, Ordering::Relaxed);
        }
        struct Done<'a>(&'a AtomicUsize);
        impl Drop for Done<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(READER, Ordering::Release);
            }
        }
        let _done = Done(state);
        // SAFETY: this reader is counted and `WRITING` was clear when it was (the Acquire
        // RMW saw it), so the writer does not write until the count drops (invariant 3).
        self.shared.value.with(|p| f(unsafe { &*p }))
    }
}

#[inline]
fn yield_thread() {
    #[cfg(kvengine_loom)]
    loom::thread::yield_now();
    #[cfg(not(kvengine_loom))]
    std::thread::yield_now();
}

#[cfg(all(test, not(kvengine_loom)))]
mod tests {
    use super::*;

    /// Two fields the writer keeps equal in every section, and a count of sections.
    #[derive(Default)]
    struct Pair {
        a: u64,
        b: u64,
        writes: u64,
    }

    #[test]
    fn readers_on_other_threads_never_see_a_write_half_done() {
        let mut w = SoleWriter::new(Pair::default());
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let readers: Vec<_> = (0..2)
            .map(|_| {
                let r = w.reader();
                let stop = stop.clone();
                std::thread::spawn(move || {
                    let (mut reads, mut last) = (0u64, 0u64);
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        let (a, b, writes) = r.read(|p| (p.a, p.b, p.writes));
                        assert_eq!(a, b, "a read saw half a write");
                        assert!(writes >= last, "writes went back: {writes} after {last}");
                        last = writes;
                        reads += 1;
                    }
                    reads
                })
            })
            .collect();
        for i in 0..200_000u64 {
            w.write(|p| {
                p.a = i;
                // Room for a reader to look between the two stores, were it let in.
                std::hint::black_box(&mut *p);
                p.b = i;
                p.writes += 1;
            });
            assert_eq!(w.read(|p| (p.a, p.b)), (i, i));
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let reads: u64 = readers
            .into_iter()
            .map(|h| h.join().expect("a reader failed"))
            .sum();
        assert!(reads > 0);
        assert_eq!(w.reader().read(|p| p.writes), 200_000);
    }

    #[test]
    fn a_write_after_the_readers_left_sees_the_value_they_read_and_the_last_handle_drops_it() {
        let value = std::sync::Arc::new(());
        let mut w = SoleWriter::new((1u32, value.clone()));
        let r = w.reader();
        assert_eq!(r.read(|v| v.0), 1);
        w.write(|v| v.0 += 1);
        assert_eq!(r.clone().read(|v| v.0), 2);
        drop(w);
        assert_eq!(r.read(|v| v.0), 2, "a reader keeps the value alive");
        assert_eq!(std::sync::Arc::strong_count(&value), 2);
        drop(r);
        assert_eq!(
            std::sync::Arc::strong_count(&value),
            1,
            "dropped with the last handle"
        );
    }
}

/// loom models of invariants 3 and 4.
#[cfg(all(test, kvengine_loom))]
mod loom_tests {
    use super::*;

    /// A reader on another thread sees both fields of a write or neither; loom's cell
    /// tracking fails the model if a read could overlap a write, or an ordering were too
    /// weak for the read to see the section it follows.
    #[test]
    fn a_read_never_overlaps_a_write_and_sees_whole_sections() {
        loom::model(|| {
            let mut w = SoleWriter::new((0u32, 0u32));
            let r = w.reader();
            let reader = loom::thread::spawn(move || {
                let first = r.read(|v| *v);
                let second = r.read(|v| *v);
                (first, second)
            });
            for i in 1..=2 {
                w.write(|v| {
                    v.0 = i;
                    v.1 = i;
                });
            }
            assert_eq!(w.read(|v| *v), (2, 2));
            let (first, second) = reader.join().unwrap_or_default();
            assert_eq!(first.0, first.1);
            assert_eq!(second.0, second.1);
            assert!(second.0 >= first.0, "{first:?} then {second:?}");
        });
    }

    /// Two readers at once share the value, and their counts come back to zero: the
    /// write after them does not wait forever (loom would report the spin). (A model with
    /// the writer spinning beside both readers did not finish within ten minutes.)
    #[test]
    fn two_readers_share_and_leave_no_count_behind() {
        loom::model(|| {
            let mut w = SoleWriter::new(5u32);
            let readers: Vec<_> = (0..2)
                .map(|_| {
                    let r = w.reader();
                    loom::thread::spawn(move || r.read(|v| *v))
                })
                .collect();
            for h in readers {
                assert_eq!(h.join().unwrap_or(0), 5);
            }
            w.write(|v| *v = 7);
            assert_eq!(w.reader().read(|v| *v), 7);
        });
    }
}
