//! loom models of `engine::ring`: push/pop, wrap-around, full/empty, close, drop.
//!
//! Run with `RUSTFLAGS="--cfg kvengine_loom" cargo test -p kvengine-loom-tests --release`.
//! Capacities are 2 so that three values already wrap the ring and hit "full".
#![cfg(kvengine_loom)]

use engine::ring::{PopError, PushError, ring};
use loom::sync::Arc;
use loom::sync::atomic::{AtomicUsize, Ordering};
use loom::thread;

/// Pops until `Closed`, yielding on `Empty` (a loom spin loop must yield).
fn drain(c: &mut engine::ring::Consumer<u32>) -> Vec<u32> {
    let mut got = vec![];
    loop {
        match c.try_pop() {
            Ok(v) => got.push(v),
            Err(PopError::Empty) => thread::yield_now(),
            Err(PopError::Closed) => return got,
        }
    }
}

#[test]
fn values_arrive_in_order_across_wrap_and_full() {
    loom::model(|| {
        let (mut p, mut c) = ring::<u32>(2);
        let producer = thread::spawn(move || {
            for i in 0..3 {
                p.push(i).unwrap();
            }
            // Dropping `p` closes the ring.
        });
        let got = drain(&mut c);
        producer.join().unwrap();
        assert_eq!(got, vec![0, 1, 2]);
    });
}

#[test]
fn close_never_loses_a_pushed_value() {
    loom::model(|| {
        let (mut p, mut c) = ring::<u32>(2);
        let producer = thread::spawn(move || {
            p.try_push(7).unwrap();
            drop(p);
        });
        // Whatever the interleaving, `Closed` comes only after the value.
        let got = drain(&mut c);
        producer.join().unwrap();
        assert_eq!(got, vec![7]);
    });
}

#[test]
fn full_ring_refuses_then_accepts_after_a_pop() {
    loom::model(|| {
        let (mut p, mut c) = ring::<u32>(2);
        p.try_push(1).unwrap();
        p.try_push(2).unwrap();
        assert_eq!(p.try_push(3), Err(PushError::Full(3)));
        let consumer = thread::spawn(move || {
            let first = loop {
                match c.try_pop() {
                    Ok(v) => break v,
                    Err(_) => thread::yield_now(),
                }
            };
            (first, c)
        });
        // The producer waits for the slot the consumer frees.
        p.push(3).unwrap();
        let (first, mut c) = consumer.join().unwrap();
        assert_eq!(first, 1);
        drop(p);
        assert_eq!(drain(&mut c), vec![2, 3]);
    });
}

struct Counted(Arc<AtomicUsize>);
impl Drop for Counted {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
}

#[test]
fn consumer_gone_values_are_handed_back_or_dropped_once() {
    loom::model(|| {
        let drops = Arc::new(AtomicUsize::new(0));
        let (mut p, c) = ring::<Counted>(2);
        let d = drops.clone();
        let producer = thread::spawn(move || {
            for _ in 0..2 {
                // A value refused as Closed comes back and is dropped here; a queued one is
                // dropped with the ring. Either way exactly once.
                let _ = p.try_push(Counted(d.clone()));
            }
        });
        drop(c);
        producer.join().unwrap();
        assert_eq!(drops.load(Ordering::Relaxed), 2);
    });
}
