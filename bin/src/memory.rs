//! The process's memory: the global allocator (mimalloc), the hook that has a thread give
//! its free pages back to the OS, and transparent huge pages (THP).
//!
//! # Why THP is off unless asked for
//! mimalloc advises the kernel to back its arenas with 2 MiB huge pages, and Linux's
//! khugepaged later merges any 2 MiB range that still has one page in use back into a huge
//! page (`max_ptes_none` is 511 by default). Memory the allocator returned after a burst
//! then comes back as resident, in 2 MiB steps, at whatever moment khugepaged runs: the
//! router's resident set neither returned to its baseline after every block was removed
//! (`bin/tests/cli_bounds.rs`: +10.9% in CI) nor stayed flat through a soak. With THP off
//! for the process (`PR_SET_THP_DISABLE`, which covers mimalloc's advice and a system set
//! to `always`) the same test ends within 0.1-3.5% of its baseline, and the indexer
//! benchmark keeps its speed (docs/benchmarks.md, "Issue 12").
//! `--transparent-huge-pages` keeps THP for an operator who measured a gain on a large
//! index (fewer TLB misses) and accepts a resident set that moves in 2 MiB steps.
//!
//! # Invariants
//! 1. [`configure`] runs once, at the top of `main`, before any thread is started.

use mimalloc::MiMalloc;
use std::sync::OnceLock;

#[global_allocator]
static GLOBAL: MiMalloc = MiMalloc;

/// Has the global allocator return the calling thread's free memory to the OS (and purge
/// what every thread gave back): for resident-memory readings, and for the router's cores
/// once the index shrank (`transport::cores::set_memory_release`).
pub fn release_allocator_memory() {
    // SAFETY: `mi_collect` only walks mimalloc's own heaps; it may be called at any time from
    // any thread and touches no memory the program owns.
    unsafe { libmimalloc_sys::mi_collect(true) }
}

/// What [`configure`] did about transparent huge pages, for the startup log.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HugePages {
    /// Off for this process (the default).
    Off,
    /// Left to the system's setting (`--transparent-huge-pages`).
    Allowed,
    /// Could not be turned off (not Linux, or the kernel refused): the system's setting
    /// applies.
    Unchanged,
}

impl HugePages {
    /// One line for the startup log.
    pub fn describe(self) -> &'static str {
        match self {
            Self::Off => "transparent huge pages off (--transparent-huge-pages to allow)",
            Self::Allowed => "transparent huge pages as the system allows",
            Self::Unchanged => "transparent huge pages as the system allows (could not turn off)",
        }
    }
}

/// What [`configure`] did, once it ran.
static HUGE_PAGES: OnceLock<HugePages> = OnceLock::new();

/// Registers the release hook with the cores and applies the THP policy.
pub fn configure(allow_huge_pages: bool) -> HugePages {
    transport::cores::set_memory_release(release_allocator_memory);
    let policy = if allow_huge_pages {
        HugePages::Allowed
    } else if disable_huge_pages() {
        HugePages::Off
    } else {
        HugePages::Unchanged
    };
    *HUGE_PAGES.get_or_init(|| policy)
}

/// What [`configure`] did (`Unchanged` before it ran).
pub fn huge_pages() -> HugePages {
    HUGE_PAGES.get().copied().unwrap_or(HugePages::Unchanged)
}

#[cfg(target_os = "linux")]
fn disable_huge_pages() -> bool {
    // SAFETY: PR_SET_THP_DISABLE takes an integer flag and three unused zero arguments; it
    // only sets a flag on this process's memory map (inherited by children).
    unsafe { libc::prctl(libc::PR_SET_THP_DISABLE, 1 as libc::c_ulong, 0, 0, 0) == 0 }
}

#[cfg(not(target_os = "linux"))]
fn disable_huge_pages() -> bool {
    false
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    #[test]
    fn huge_pages_are_off_for_the_process_unless_allowed() {
        // The flag is per process: test it in a child so this test binary is unchanged.
        let status = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "memory::tests::child_turns_huge_pages_off",
                "--ignored",
            ])
            .status()
            .unwrap();
        assert!(status.success());
        assert_eq!(configure(true), HugePages::Allowed);
        assert_eq!(huge_pages(), HugePages::Allowed);
    }

    /// Run by [`huge_pages_are_off_for_the_process_unless_allowed`] in a child process.
    #[test]
    #[ignore = "run in a child process by huge_pages_are_off_for_the_process_unless_allowed"]
    fn child_turns_huge_pages_off() {
        assert_eq!(configure(false), HugePages::Off);
        // SAFETY: PR_GET_THP_DISABLE takes four unused zero arguments and reads a flag.
        let flag = unsafe { libc::prctl(libc::PR_GET_THP_DISABLE, 0, 0, 0, 0) };
        assert_eq!(flag, 1);
    }
}
