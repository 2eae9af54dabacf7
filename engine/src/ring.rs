//! A bounded single-producer single-consumer ring: how threads talk to shards.
//!
//! One thread owns the [`Producer`], one owns the [`Consumer`]; neither handle is `Clone`
//! and every method takes `&mut self`, so the single-producer/single-consumer contract is
//! enforced by the type system.
//!
//! # Invariants
//! 1. `head <= tail <= head + capacity` (indices count up forever and wrap only in `usize`;
//!    a slot is `index & mask`).
//! 2. Slots `head..tail` hold initialised values; all others are uninitialised.
//! 3. Only the producer writes `tail` and the slots outside `head..tail`; only the consumer
//!    writes `head` and moves values out of slots inside `head..tail`.
//! 4. Nothing pushed successfully is lost: after the producer closes (or drops), the
//!    consumer still pops every value before it sees [`PopError::Closed`].
//!
//! # Memory orderings
//! * Producer: writes the value into its slot, then `tail.store(Release)`. The consumer's
//!   `tail.load(Acquire)` therefore sees the value written.
//! * Consumer: moves the value out, then `head.store(Release)`. The producer's
//!   `head.load(Acquire)` therefore never reuses a slot whose value is still being read.
//! * `closed` is set with `Release` after the closer's last `tail`/`head` store and read with
//!   `Acquire`; a consumer that sees `closed` re-reads `tail` before reporting `Closed`, so
//!   a value pushed just before the close is still delivered.
//! * Each side keeps a private copy of the other side's index and re-reads the shared one
//!   only when its copy says full/empty, so the two cache lines are not bounced on every
//!   operation. `head` and `tail` live on separate 128-byte lines (adjacent-line prefetch
//!   pairs 64-byte lines on x86).
//!
//! # Algorithm
//! The classic Lamport ring with cached indices (as in Rigtorp's SPSCQueue and glommio's
//! `spsc_queue`); capacity is a power of two.

use crate::sync::{Arc, AtomicBool, AtomicUsize, Ordering, UnsafeCell};
use std::fmt;
use std::mem::MaybeUninit;

#[repr(align(128))]
struct Padded<T>(T);

struct Shared<T> {
    head: Padded<AtomicUsize>,
    tail: Padded<AtomicUsize>,
    closed: AtomicBool,
    mask: usize,
    slots: Box<[UnsafeCell<MaybeUninit<T>>]>,
}

// SAFETY: the ring moves `T`s from one thread to another (so `T: Send`); slot access is
// partitioned between the two threads by invariants 2 and 3 and ordered by the
// Acquire/Release pairs documented in the module docs.
unsafe impl<T: Send> Sync for Shared<T> {}
// SAFETY: as above; the shared state only holds `T`s that are themselves `Send`.
unsafe impl<T: Send> Send for Shared<T> {}

/// The sending half. Owned by exactly one thread.
pub struct Producer<T> {
    shared: Arc<Shared<T>>,
    tail: usize,
    head_cache: usize,
}

/// The receiving half. Owned by exactly one thread.
pub struct Consumer<T> {
    shared: Arc<Shared<T>>,
    head: usize,
    tail_cache: usize,
}

/// Why a push failed; the value is handed back.
#[derive(PartialEq, Eq)]
pub enum PushError<T> {
    /// The ring is full; try again later.
    Full(T),
    /// The consumer is gone; the value can never be delivered.
    Closed(T),
}

impl<T> fmt::Debug for PushError<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PushError::Full(_) => "Full(..)",
            PushError::Closed(_) => "Closed(..)",
        })
    }
}

/// Why a pop returned nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PopError {
    /// Nothing queued right now.
    Empty,
    /// Nothing queued and the producer is gone: nothing will ever come.
    Closed,
}

/// A ring holding at least `capacity` values (rounded up to a power of two, at least 2).
pub fn ring<T>(capacity: usize) -> (Producer<T>, Consumer<T>) {
    let cap = capacity.max(2).next_power_of_two();
    let slots = (0..cap)
        .map(|_| UnsafeCell::new(MaybeUninit::uninit()))
        .collect();
    let shared = Arc::new(Shared {
        head: Padded(AtomicUsize::new(0)),
        tail: Padded(AtomicUsize::new(0)),
        closed: AtomicBool::new(false),
        mask: cap - 1,
        slots,
    });
    (
        Producer {
            shared: shared.clone(),
            tail: 0,
            head_cache: 0,
        },
        Consumer {
            shared,
            head: 0,
            tail_cache: 0,
        },
    )
}

impl<T> Shared<T> {
    fn slot(&self, index: usize) -> &UnsafeCell<MaybeUninit<T>> {
        // `mask` is `len - 1` and `len` is a power of two: always in bounds.
        &self.slots[index & self.mask]
    }

    fn capacity(&self) -> usize {
        self.mask + 1
    }
}

impl<T> Producer<T> {
    /// Queues `value`, or hands it back if the ring is full or the consumer is gone.
    pub fn try_push(&mut self, value: T) -> Result<(), PushError<T>> {
        let s = &*self.shared;
        if s.closed.load(Ordering::Acquire) {
            return Err(PushError::Closed(value));
        }
        if self.tail - self.head_cache == s.capacity() {
            self.head_cache = s.head.0.load(Ordering::Acquire);
            if self.tail - self.head_cache == s.capacity() {
                return Err(PushError::Full(value));
            }
        }
        s.slot(self.tail).with_mut(|p| {
            // SAFETY: `tail - head < capacity`, so slot `tail` is outside `head..tail`:
            // uninitialised and owned by the producer (invariants 2, 3). The Acquire load
            // of `head` ordered the consumer's last read of this slot before this write.
            unsafe { (*p).write(value) };
        });
        self.tail = self.tail.wrapping_add(1);
        s.tail.0.store(self.tail, Ordering::Release);
        Ok(())
    }

    /// Queues `value`, spinning while the ring is full (backpressure: the producer stops,
    /// nothing is dropped). Hands the value back only if the consumer is gone.
    pub fn push(&mut self, mut value: T) -> Result<(), T> {
        loop {
            match self.try_push(value) {
                Ok(()) => return Ok(()),
                Err(PushError::Closed(v)) => return Err(v),
                Err(PushError::Full(v)) => {
                    value = v;
                    crate::sync::spin_hint();
                }
            }
        }
    }

    /// Values queued and not yet popped (a snapshot).
    pub fn len(&self) -> usize {
        self.tail - self.shared.head.0.load(Ordering::Acquire)
    }

    /// Nothing queued (a snapshot).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Slots in the ring.
    pub fn capacity(&self) -> usize {
        self.shared.capacity()
    }

    /// Has the consumer gone?
    pub fn is_closed(&self) -> bool {
        self.shared.closed.load(Ordering::Acquire)
    }
}

impl<T> Consumer<T> {
    /// Takes the oldest value. `Closed` only once the producer is gone and the ring drained.
    pub fn try_pop(&mut self) -> Result<T, PopError> {
        let s = &*self.shared;
        if self.head == self.tail_cache {
            self.tail_cache = s.tail.0.load(Ordering::Acquire);
            if self.head == self.tail_cache {
                if !s.closed.load(Ordering::Acquire) {
                    return Err(PopError::Empty);
                }
                // The producer may have pushed between our tail load and its close.
                self.tail_cache = s.tail.0.load(Ordering::Acquire);
                if self.head == self.tail_cache {
                    return Err(PopError::Closed);
                }
            }
        }
        let value = s.slot(self.head).with_mut(|p| {
            // SAFETY: `head < tail` (Acquire-loaded), so the slot is initialised and owned by
            // the consumer (invariants 2, 3); it is read exactly once, then released below.
            unsafe { (*p).assume_init_read() }
        });
        self.head = self.head.wrapping_add(1);
        s.head.0.store(self.head, Ordering::Release);
        Ok(value)
    }

    /// Pops up to `max` values into `out`; returns how many.
    pub fn pop_batch(&mut self, out: &mut Vec<T>, max: usize) -> usize {
        let mut n = 0;
        while n < max {
            match self.try_pop() {
                Ok(v) => {
                    out.push(v);
                    n += 1;
                }
                Err(_) => break,
            }
        }
        n
    }

    /// Values queued (a snapshot).
    pub fn len(&self) -> usize {
        self.shared.tail.0.load(Ordering::Acquire) - self.head
    }

    /// Nothing queued (a snapshot).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Has the producer gone? (Values may still be queued.)
    pub fn is_closed(&self) -> bool {
        self.shared.closed.load(Ordering::Acquire)
    }
}

impl<T> Drop for Producer<T> {
    fn drop(&mut self) {
        self.shared.closed.store(true, Ordering::Release);
    }
}

impl<T> Drop for Consumer<T> {
    fn drop(&mut self) {
        self.shared.closed.store(true, Ordering::Release);
        // Values still queued are dropped with the ring (see `Shared::drop`).
    }
}

impl<T> Drop for Shared<T> {
    fn drop(&mut self) {
        // Both handles are gone, so this is the only access: drop what is still queued.
        let head = self.head.0.load(Ordering::Acquire);
        let tail = self.tail.0.load(Ordering::Acquire);
        let mut i = head;
        while i != tail {
            self.slot(i).with_mut(|p| {
                // SAFETY: slots `head..tail` are initialised (invariant 2) and no handle is
                // left to read them.
                unsafe { (*p).assume_init_drop() };
            });
            i = i.wrapping_add(1);
        }
    }
}

impl<T> fmt::Debug for Producer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Producer")
            .field("tail", &self.tail)
            .finish_non_exhaustive()
    }
}

impl<T> fmt::Debug for Consumer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Consumer")
            .field("head", &self.head)
            .finish_non_exhaustive()
    }
}

#[cfg(all(test, not(kvengine_loom)))]
mod tests {
    use super::*;

    #[test]
    fn fifo_wraps_and_reports_full() {
        let (mut p, mut c) = ring::<u32>(4);
        for round in 0..10u32 {
            for i in 0..4 {
                p.try_push(round * 10 + i).unwrap();
            }
            assert_eq!(p.try_push(99), Err(PushError::Full(99)));
            for i in 0..4 {
                assert_eq!(c.try_pop(), Ok(round * 10 + i));
            }
            assert_eq!(c.try_pop(), Err(PopError::Empty));
        }
    }

    #[test]
    fn close_delivers_everything_first() {
        let (mut p, mut c) = ring::<String>(8);
        p.try_push("a".into()).unwrap();
        p.try_push("b".into()).unwrap();
        drop(p);
        assert_eq!(c.try_pop().as_deref(), Ok("a"));
        assert_eq!(c.try_pop().as_deref(), Ok("b"));
        assert_eq!(c.try_pop(), Err(PopError::Closed));
    }

    #[test]
    fn consumer_gone_hands_values_back() {
        let (mut p, c) = ring::<u8>(2);
        drop(c);
        assert_eq!(p.try_push(1), Err(PushError::Closed(1)));
        assert_eq!(p.push(2), Err(2));
    }

    #[test]
    fn queued_values_are_dropped_with_the_ring() {
        let item = std::sync::Arc::new(());
        let (mut p, c) = ring(4);
        p.try_push(item.clone()).unwrap();
        p.try_push(item.clone()).unwrap();
        drop(p);
        drop(c);
        assert_eq!(std::sync::Arc::strong_count(&item), 1);
    }

    #[test]
    fn threads_transfer_every_value_in_order() {
        let (mut p, mut c) = ring::<u64>(64);
        let n = 200_000u64;
        let t = std::thread::spawn(move || {
            for i in 0..n {
                p.push(i).unwrap();
            }
        });
        let mut next = 0;
        loop {
            match c.try_pop() {
                Ok(v) => {
                    assert_eq!(v, next);
                    next += 1;
                }
                Err(PopError::Empty) => std::hint::spin_loop(),
                Err(PopError::Closed) => break,
            }
        }
        t.join().unwrap();
        assert_eq!(next, n);
    }
}
