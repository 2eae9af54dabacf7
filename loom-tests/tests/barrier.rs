//! loom model of the runtime's sync barrier, end to end: the real `engine::ring` rings and
//! the real `SyncBarrier` (`engine/src/runtime/barrier.rs`), two cores and one client.
//!
//! The client (the model's main thread) sends core A an operation that belongs to core B's
//! shard (as an event homed on A whose operation B owns), then `Sync` (tag 1) to A and to B.
//! A forwards the operation to B on its peer ring and, on the `Sync`, sends its `Fence`
//! behind it on that same ring; B sends its `Fence` to A. Each core applies the operations
//! that reach it, feeds its own `Sync` and the peer's fence into its barrier, and replies
//! `Synced` (carrying the operations it had applied by then) when the barrier completes.
//! The client waits for both replies. Checked in every interleaving of the two cores and
//! the client's waits:
//! * B's `Synced` comes after B applied the operation: a barrier that completes on the own
//!   sync alone, or a fence that overtakes the operation, fails here;
//! * each core replies `Synced` exactly once, its barrier is empty when it exits, and the
//!   operation is applied once, by B.
//!
//! To keep the state space small (loom is exponential in it): the client queues its three
//! messages and closes its request rings before the cores start (the cores still handle
//! everything queued before a close); rings hold 2 messages, the most any carries here, so
//! no push waits; and an idle thread waits on its bell (a loom `Notify`, rung by whoever
//! pushes to or closes one of its rings, like the runtime's `Waker`, modelled in
//! `runtime/waker.rs`) instead of spinning, since three threads spinning with `yield_now`
//! make the exploration unbounded. At most 2 preemptions unless `LOOM_MAX_PREEMPTIONS` is
//! set (about a minute in release).
//!
//! Run with `RUSTFLAGS="--cfg kvengine_loom" cargo test -p kvengine-loom-tests --release
//! --test barrier`.
#![cfg(kvengine_loom)]

use engine::ring::{Consumer, PopError, Producer, ring};
use engine::runtime::SyncBarrier;
use loom::sync::{Arc, Notify};
use loom::thread;

/// The only client.
const CLIENT: usize = 0;
const TAG: u64 = 1;

/// Client -> core.
#[derive(Debug)]
enum ToCore {
    /// An event whose operation belongs to the other core's shard.
    OpForPeer,
    Sync(u64),
}

/// Core -> core.
#[derive(Debug)]
enum PeerMsg {
    Op,
    Fence { client: usize, tag: u64 },
}

/// Wakes one waiting thread.
type Bell = Arc<Notify>;

/// Pushes `msg` (the model's rings never fill) and wakes the reader.
fn send<T: std::fmt::Debug>(ring: &mut Producer<T>, msg: T, reader: &Bell) {
    ring.try_push(msg).expect("a model ring filled up");
    reader.notify();
}

/// One core's ends of the rings. Replies carry the tag of the `Sync` they answer.
struct Core {
    client_in: Consumer<ToCore>,
    peer_in: Consumer<PeerMsg>,
    peer_out: Option<Producer<PeerMsg>>,
    /// `Synced` replies: (tag, operations applied to this core's shard when it replied).
    reply: Producer<(u64, usize)>,
    bell: Bell,
    peer_bell: Bell,
    client_bell: Bell,
}

impl Core {
    /// The shard loop, cut down: peer messages, then client messages; closes its peer ring
    /// once the client is gone, and exits once the peer's ring to it is closed too.
    fn run(mut self) -> usize {
        let mut barrier = SyncBarrier::new(1);
        let mut applied = 0;
        let mut client_open = true;
        let mut peer_open = true;
        while client_open || peer_open {
            let mut progressed = false;
            if peer_open {
                match self.peer_in.try_pop() {
                    Ok(PeerMsg::Op) => {
                        progressed = true;
                        applied += 1;
                    }
                    Ok(PeerMsg::Fence { client, tag }) => {
                        progressed = true;
                        if barrier.peer_fence(client, tag) {
                            send(&mut self.reply, (tag, applied), &self.client_bell);
                        }
                    }
                    Err(PopError::Empty) => {}
                    Err(PopError::Closed) => peer_open = false,
                }
            }
            if client_open {
                match self.client_in.try_pop() {
                    Ok(ToCore::OpForPeer) => {
                        progressed = true;
                        self.send_peer(PeerMsg::Op);
                    }
                    Ok(ToCore::Sync(tag)) => {
                        progressed = true;
                        self.send_peer(PeerMsg::Fence {
                            client: CLIENT,
                            tag,
                        });
                        if barrier.own_sync(CLIENT, tag) {
                            send(&mut self.reply, (tag, applied), &self.client_bell);
                        }
                    }
                    Err(PopError::Empty) => {}
                    Err(PopError::Closed) => {
                        client_open = false;
                        // Everything this core produced is on the ring: close it.
                        self.peer_out = None;
                        self.peer_bell.notify();
                    }
                }
            }
            if !progressed && (client_open || peer_open) {
                self.bell.wait();
            }
        }
        assert_eq!(barrier.outstanding(), 0, "a sync was left incomplete");
        applied
    }

    fn send_peer(&mut self, msg: PeerMsg) {
        let ring = self
            .peer_out
            .as_mut()
            .expect("peer ring closed while serving a client");
        send(ring, msg, &self.peer_bell);
    }
}

type Reply = (u64, usize);

/// Waits for the next reply on `ring`.
fn recv(ring: &mut Consumer<Reply>, bell: &Bell) -> Reply {
    loop {
        match ring.try_pop() {
            Ok(reply) => return reply,
            Err(PopError::Empty) => bell.wait(),
            Err(PopError::Closed) => panic!("core exited without replying"),
        }
    }
}

/// Everything left on `ring` after its core exited.
fn drain(ring: &mut Consumer<Reply>) -> Vec<Reply> {
    let mut rest = vec![];
    loop {
        match ring.try_pop() {
            Ok(reply) => rest.push(reply),
            Err(PopError::Empty) => panic!("reply ring still open after its core exited"),
            Err(PopError::Closed) => return rest,
        }
    }
}

/// `loom::model` with at most 2 preemptions unless `LOOM_MAX_PREEMPTIONS` says otherwise.
fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut builder = loom::model::Builder::new();
    if builder.preemption_bound.is_none() {
        builder.preemption_bound = Some(2);
    }
    builder.check(f);
}

#[test]
fn synced_only_after_every_earlier_operation_is_applied() {
    model(|| {
        let (mut to_a, a_in) = ring::<ToCore>(2);
        let (mut to_b, b_in) = ring::<ToCore>(2);
        let (a_to_b, b_from_a) = ring::<PeerMsg>(2);
        let (b_to_a, a_from_b) = ring::<PeerMsg>(2);
        let (a_reply, mut from_a) = ring::<Reply>(2);
        let (b_reply, mut from_b) = ring::<Reply>(2);
        let (bell_a, bell_b, bell_client) = (Bell::default(), Bell::default(), Bell::default());
        // The client's requests: an operation for B through A, then a sync on both cores;
        // it sends nothing more, so it closes its request rings.
        send(&mut to_a, ToCore::OpForPeer, &bell_a);
        send(&mut to_a, ToCore::Sync(TAG), &bell_a);
        send(&mut to_b, ToCore::Sync(TAG), &bell_b);
        drop(to_a);
        drop(to_b);
        let core_a = Core {
            client_in: a_in,
            peer_in: a_from_b,
            peer_out: Some(a_to_b),
            reply: a_reply,
            bell: bell_a.clone(),
            peer_bell: bell_b.clone(),
            client_bell: bell_client.clone(),
        };
        let core_b = Core {
            client_in: b_in,
            peer_in: b_from_a,
            peer_out: Some(b_to_a),
            reply: b_reply,
            bell: bell_b.clone(),
            peer_bell: bell_a.clone(),
            client_bell: bell_client.clone(),
        };
        let a = thread::spawn(move || core_a.run());
        let b = thread::spawn(move || core_b.run());

        assert_eq!(recv(&mut from_a, &bell_client), (TAG, 0));
        assert_eq!(
            recv(&mut from_b, &bell_client),
            (TAG, 1),
            "B replied Synced before applying the operation sent before the Sync"
        );

        // The cores exit once their rings are closed: no second `Synced`, and nothing lost
        // or applied twice.
        assert_eq!(a.join().unwrap(), 0);
        assert_eq!(b.join().unwrap(), 1);
        assert_eq!(drain(&mut from_a), vec![], "A replied twice");
        assert_eq!(drain(&mut from_b), vec![], "B replied twice");
    });
}
