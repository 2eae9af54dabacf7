//! What the machine gives a benchmark: random-access memory latency, and the process's
//! resident memory.
//!
//! # Algorithm
//! Latency is a dependent pointer chase (lmbench's `lat_mem_rd`, McVoy and Staelin, 1996):
//! a buffer holds one word per 64-byte cache line, linked into a single random cycle
//! (Sattolo's shuffle), and each load's address is the previous load's value, so loads
//! cannot overlap. Nanoseconds per load over a 1 MB buffer is roughly cache latency; over
//! 128 MB it is DRAM latency plus TLB misses. 4 MB and 16 MB fall in the band of a shared
//! last-level cache, where an index's per-block tables live: on a machine shared with other
//! tenants, that band is the one that moves from minute to minute while the two ends do
//! not, so it is the one that explains a slow run.
//!
//! # Invariants
//! 1. [`mem_latency`] takes well under 2 s: each chase stops after its time budget, and
//!    building the 128 MB cycle touches each line a few times.
//! 2. The buffers come from the system allocator, not the global one, and are freed before
//!    [`mem_latency`] returns, so their pages leave the process (glibc unmaps large blocks)
//!    instead of staying cached in the global allocator, where the indexer measured next
//!    would reuse them and hide its own resident memory.
//! 3. [`rss_bytes`] reads `VmRSS` from `/proc/self/status`; where there is none (not
//!    Linux) it returns `None`.

use crate::workload::Rng;
use serde::Serialize;
use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::ptr::NonNull;
use std::time::{Duration, Instant};

/// Bytes between two chased words: one cache line.
const LINE: usize = 64;
/// Loads between two clock reads.
const CHUNK: u64 = 1 << 14;

/// Random-access memory latency, nanoseconds per dependent load.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct MemLatency {
    /// Over a 1 MB buffer.
    #[serde(rename = "1MB")]
    pub mb_1: f64,
    /// Over a 4 MB buffer.
    #[serde(rename = "4MB")]
    pub mb_4: f64,
    /// Over a 16 MB buffer.
    #[serde(rename = "16MB")]
    pub mb_16: f64,
    /// Over a 128 MB buffer.
    #[serde(rename = "128MB")]
    pub mb_128: f64,
}

/// Measures [`MemLatency`] (invariant 1).
pub fn mem_latency() -> MemLatency {
    MemLatency {
        mb_1: chase_ns(1 << 20, Duration::from_millis(100)),
        mb_4: chase_ns(4 << 20, Duration::from_millis(100)),
        mb_16: chase_ns(16 << 20, Duration::from_millis(150)),
        mb_128: chase_ns(128 << 20, Duration::from_millis(300)),
    }
}

/// Zeroed `u64`s from the system allocator (invariant 2).
struct SystemBuf {
    ptr: NonNull<u64>,
    len: usize,
}

impl SystemBuf {
    /// `len` zeroed words (`None` if `len` is 0 or the allocation fails).
    fn zeroed(len: usize) -> Option<Self> {
        let layout = Layout::array::<u64>(len).ok()?;
        if layout.size() == 0 {
            return None;
        }
        // SAFETY: `layout` has a non-zero size (checked above).
        let ptr = unsafe { System.alloc_zeroed(layout) };
        Some(Self {
            ptr: NonNull::new(ptr.cast::<u64>())?,
            len,
        })
    }

    fn words(&mut self) -> &mut [u64] {
        // SAFETY: `ptr` points to `len` zeroed (so initialised) `u64`s allocated by `zeroed`
        // and owned by `self`, which `&mut self` borrows uniquely.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for SystemBuf {
    fn drop(&mut self) {
        if let Ok(layout) = Layout::array::<u64>(self.len) {
            // SAFETY: `ptr` was allocated by `System` with this very layout in `zeroed`.
            unsafe { System.dealloc(self.ptr.as_ptr().cast::<u8>(), layout) };
        }
    }
}

/// Nanoseconds per load of a dependent chase over `bytes`, measured for about `budget`
/// after one warm-up chunk; 0 if the buffer cannot be allocated.
pub fn chase_ns(bytes: usize, budget: Duration) -> f64 {
    let words = LINE / std::mem::size_of::<u64>();
    let lines = (bytes / LINE).max(2);
    let Some(mut mem) = SystemBuf::zeroed(lines * words) else {
        return 0.0;
    };
    let buf = mem.words();
    link_cycle(buf, words, &mut Rng::new(0x006C_6174_5F6D_656D));
    let mut p = 0usize;
    let mut chase = |n: u64| {
        for _ in 0..n {
            p = buf.get(p).map_or(0, |&v| v as usize);
        }
    };
    chase(CHUNK);
    let start = Instant::now();
    let mut loads = 0u64;
    while loads == 0 || start.elapsed() < budget {
        chase(CHUNK);
        loads += CHUNK;
    }
    let ns = start.elapsed().as_nanos() as f64 / loads as f64;
    black_box(p);
    ns
}

/// Links the first word of every `stride`-word line of `buf` into one random cycle
/// (Sattolo's shuffle, in place): following `p -> buf[p]` from 0 visits every line's first
/// word before returning to 0.
pub fn link_cycle(buf: &mut [u64], stride: usize, rng: &mut Rng) {
    let stride = stride.max(1);
    let lines = buf.len() / stride;
    for line in 0..lines {
        if let Some(w) = buf.get_mut(line * stride) {
            *w = line as u64;
        }
    }
    for i in (1..lines).rev() {
        buf.swap(i * stride, rng.below(i) * stride);
    }
    for line in 0..lines {
        if let Some(w) = buf.get_mut(line * stride) {
            *w *= stride as u64;
        }
    }
}

/// The process's resident set size now, in bytes (invariant 3).
pub fn rss_bytes() -> Option<u64> {
    parse_vm_rss(&std::fs::read_to_string("/proc/self/status").ok()?)
}

/// `VmRSS` of a `/proc/<pid>/status` text, in bytes.
pub fn parse_vm_rss(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let mut parts = line.split_whitespace().skip(1);
    let kb: u64 = parts.next()?.parse().ok()?;
    match parts.next() {
        Some("kB") => kb.checked_mul(1024),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vm_rss_is_read_in_bytes() {
        let status = "Name:\tx\nVmPeak:\t  10 kB\nVmRSS:\t    2048 kB\nThreads: 1\n";
        assert_eq!(parse_vm_rss(status), Some(2048 * 1024));
        assert_eq!(parse_vm_rss("VmRSS: lots\n"), None);
        assert_eq!(parse_vm_rss("Name: x\n"), None);
        if cfg!(target_os = "linux") {
            assert!(rss_bytes().is_some_and(|b| b > 0));
        }
    }

    #[test]
    fn sattolo_makes_one_cycle_through_every_line() {
        for (lines, stride) in [(2usize, 1usize), (3, 8), (17, 8), (1000, 3)] {
            let mut buf = vec![0u64; lines * stride];
            link_cycle(&mut buf, stride, &mut Rng::new(lines as u64));
            let mut seen = vec![false; lines];
            let mut p = 0usize;
            for _ in 0..lines {
                assert_eq!(p % stride, 0);
                assert!(!seen[p / stride], "{lines} lines: revisited {p} early");
                seen[p / stride] = true;
                p = buf[p] as usize;
            }
            assert_eq!(p, 0);
            assert!(seen.iter().all(|&s| s));
        }
    }

    #[test]
    fn a_chase_is_positive_and_finite() {
        let ns = chase_ns(64 << 10, Duration::from_millis(5));
        assert!(ns.is_finite() && ns > 0.0, "{ns}");
    }
}
