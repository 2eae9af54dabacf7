//! The process's file-descriptor limit: every HTTP connection, worker subscription and
//! replica link holds one, and `--max-connections-per-core` (8,192 a core by default) is
//! only reachable if the soft limit allows it. Distributions often start services with a
//! soft limit of 1,024 under a far larger hard limit; like most servers, the router raises
//! its soft limit to the hard one at start (an unprivileged process may).

/// Raises the soft `RLIMIT_NOFILE` to the hard limit; returns the soft limit now in force.
#[cfg(unix)]
pub fn raise_limit() -> Option<u64> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one `rlimit` through a valid pointer to a local.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return None;
    }
    if lim.rlim_cur < lim.rlim_max {
        let raised = libc::rlimit {
            rlim_cur: lim.rlim_max,
            rlim_max: lim.rlim_max,
        };
        // SAFETY: setrlimit reads one `rlimit` through a valid pointer to a local; raising
        // the soft limit up to the hard one needs no privilege.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            lim = raised;
        }
    }
    Some(lim.rlim_cur)
}

/// Nothing to raise off Unix.
#[cfg(not(unix))]
pub fn raise_limit() -> Option<u64> {
    None
}

#[cfg(all(test, unix))]
mod tests {
    #[test]
    fn the_soft_limit_ends_at_the_hard_one() {
        let soft = super::raise_limit().unwrap();
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: as in `raise_limit`.
        assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) }, 0);
        assert_eq!(soft, lim.rlim_cur);
        assert_eq!(lim.rlim_cur, lim.rlim_max);
    }
}
