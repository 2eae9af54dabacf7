//! Which core serves a new HTTP connection: the edge fills cores in order instead of
//! spreading every connection over all of them (issue 31, `--edge-fill`).
//!
//! With one `SO_REUSEPORT` listener per core the kernel spreads connections evenly. At low
//! load that costs CPU for nothing: every core thread blocks in its own `epoll_wait` and
//! wakes for its own few sockets, where one thread would have served the same readiness
//! in one wake-up. Measured on the Mooncake replay through the proxy (docs/benchmarks.md,
//! "Issue 31"): two cores spent 24% more CPU per request than one, nearly all of it in
//! those wake-ups. So a core that accepts a connection hands it to the lowest-numbered core
//! that is below the fill share; the kernel's spread applies again once every lower core
//! is busy.
//!
//! A core's busy share is its thread's awake time over the last window
//! ([`CoreLoads`], written by the runtime's park hooks, [`Placement::parked`] and
//! [`Placement::woke`]). Connections arrive in bursts faster than a window can show their
//! load (a client opening its pool), so each core is also handed at most
//! [`HANDOFF_BUDGET`] connections per window: a burst still spreads.
//!
//! # Invariants
//! 1. Only a lower-numbered core is a target, so a connection moves at most once and core
//!    0 never hands one off.
//! 2. A connection is handed before anything was read from it (before a TLS handshake),
//!    with one of its target's connection permits (`--max-connections-per-core`): a core
//!    at its cap is handed nothing, and a core never serves more than its cap. The core it
//!    lands on serves it exactly as one it accepted itself: its bounds, its graceful
//!    shutdown.
//! 3. A connection whose target no longer takes any (its accept loop ended) is served by the
//!    core that accepted it. Once a core's accept loop ends, connections handed to it and
//!    not yet taken are closed with nothing read, as a listener's backlog is.
//! 4. A target is chosen only while its busy share is below the fill share and it has a
//!    ticket left in the window (`CoreLoads` invariant 4).
//!
//! What this does not do: move a connection after it was placed. A connection accepted at
//! low load stays on its core when the load on it grows; new connections then go to the
//! cores that are not busy.

use engine::runtime::CoreLoads;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The default fill share (`--edge-fill`): a core takes the connections of the cores above
/// it while its thread was awake less than half of the last window.
pub const DEFAULT_FILL_SHARE: f64 = 0.5;
/// The window the busy shares are measured over.
pub const WINDOW: Duration = Duration::from_millis(100);
/// Connections one core may be handed per [`WINDOW`] (invariant 4).
pub const HANDOFF_BUDGET: u32 = 4;

/// An accepted connection on its way to the core that serves it.
#[derive(Debug)]
pub struct Handed {
    /// The socket, taken off the accepting core's reactor.
    pub tcp: std::net::TcpStream,
    /// The client.
    pub peer: SocketAddr,
    /// One of the target's connection permits (invariant 2).
    pub permit: OwnedSemaphorePermit,
}

/// The cores' loads and their inboxes of handed connections. See the module docs.
#[derive(Debug)]
pub struct Placement {
    loads: CoreLoads,
    epoch: Instant,
    fill: f64,
    inboxes: Box<[UnboundedSender<Handed>]>,
    /// Each core's receiving end, until its accept loop takes it.
    outlets: Mutex<Vec<Option<UnboundedReceiver<Handed>>>>,
    /// Each core's connection permits, once its accept loop runs.
    permits: Box<[OnceLock<Arc<Semaphore>>]>,
}

impl Placement {
    /// Placement over `cores` cores, filling each while its busy share is below `fill`
    /// (0 to 1).
    pub fn new(cores: usize, fill: f64) -> Arc<Self> {
        Self::with_window(cores, fill, WINDOW, HANDOFF_BUDGET)
    }

    /// [`Placement::new`] measuring over `window`, each core handed at most `budget`
    /// connections per window.
    pub fn with_window(cores: usize, fill: f64, window: Duration, budget: u32) -> Arc<Self> {
        let loads = CoreLoads::new(cores, window, budget);
        let (inboxes, outlets): (Vec<_>, Vec<_>) = (0..loads.cores())
            .map(|_| {
                let (tx, rx) = unbounded_channel();
                (tx, Some(rx))
            })
            .unzip();
        let permits = (0..loads.cores()).map(|_| OnceLock::new()).collect();
        Arc::new(Self {
            permits,
            loads,
            epoch: Instant::now(),
            fill: if fill.is_finite() {
                fill.clamp(0.0, 1.0)
            } else {
                0.0
            },
            inboxes: inboxes.into(),
            outlets: Mutex::new(outlets),
        })
    }

    fn now(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// Core `core`'s thread is about to block: its runtime's `on_thread_park` hook.
    pub fn parked(&self, core: usize) {
        self.loads.parked(core, self.now());
    }

    /// Core `core`'s thread woke: its runtime's `on_thread_unpark` hook.
    pub fn woke(&self, core: usize) {
        self.loads.woke(core, self.now());
    }

    /// Core `core`'s busy share over its last window (0 to 1).
    pub fn busy(&self, core: usize) -> f64 {
        self.loads.busy(core, self.now())
    }

    /// Number of cores.
    pub fn cores(&self) -> usize {
        self.loads.cores()
    }

    /// Core `core`'s accept loop starts with `permits`: it may be handed connections from
    /// now on, and this is its inbox (`None` for a second call or an unknown core).
    pub(crate) fn seat(
        &self,
        core: usize,
        permits: Arc<Semaphore>,
    ) -> Option<UnboundedReceiver<Handed>> {
        let mut outlets = self.outlets.lock().ok()?;
        let inbox = outlets.get_mut(core)?.take()?;
        self.permits.get(core)?.set(permits).ok()?;
        Some(inbox)
    }

    /// The core that should serve a connection core `me` accepted, with one of its permits,
    /// if not `me` itself (invariants 1, 2 and 4).
    pub(crate) fn target(&self, me: usize) -> Option<(usize, OwnedSemaphorePermit)> {
        let now = self.now();
        (0..me.min(self.cores())).find_map(|to| {
            if self.loads.busy(to, now) >= self.fill {
                return None;
            }
            let permit = self
                .permits
                .get(to)?
                .get()?
                .clone()
                .try_acquire_owned()
                .ok()?;
            self.loads.take_ticket(to, now).then_some((to, permit))
        })
    }

    /// Sends `handed` to core `to`; gives it back if that core takes no more (invariant 3).
    pub(crate) fn hand(&self, to: usize, handed: Handed) -> Result<(), Handed> {
        match self.inboxes.get(to) {
            Some(inbox) => inbox.send(handed).map_err(|e| e.0),
            None => Err(handed),
        }
    }
}
