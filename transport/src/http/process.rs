//! Process metrics, under Prometheus's standard names (`process_resident_memory_bytes`,
//! `process_cpu_seconds_total`, `process_open_fds`, `process_threads`,
//! `process_start_time_seconds`), read from `/proc/self` on Linux. Elsewhere, or where a
//! file cannot be read, the metric is left out rather than reported wrong.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

/// Clock ticks per second of `/proc/*/stat` times: USER_HZ, which the kernel ABI fixes at
/// 100 on every architecture kvengine builds for.
const USER_HZ: f64 = 100.0;

/// What `/proc/self` says now.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct ProcessStats {
    pub resident_bytes: Option<u64>,
    pub threads: Option<u64>,
    pub cpu_seconds: Option<f64>,
    pub open_fds: Option<u64>,
    pub start_time_seconds: Option<f64>,
}

/// The value of `key:` in `/proc/self/status` (`VmRSS:   1234 kB` -> 1234).
fn status_field(status: &str, key: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
}

/// `(utime + stime, starttime)` in ticks from a `/proc/self/stat` line. The command name
/// (field 2) may hold spaces and parentheses: fields are counted after its last `)`.
fn stat_ticks(stat: &str) -> Option<(u64, u64)> {
    let rest = stat.get(stat.rfind(')')? + 1..)?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // `rest` starts at field 3 (state): utime is field 14, stime 15, starttime 22.
    let field = |n: usize| fields.get(n - 3)?.parse::<u64>().ok();
    Some((field(14)? + field(15)?, field(22)?))
}

/// Process `pid`'s CPU time (user + system), in seconds, where `/proc` has it (the replay
/// bench reads the NATS server's with it).
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat_ticks(&stat).map(|(cpu, _)| cpu as f64 / USER_HZ)
}

impl ProcessStats {
    /// Reads them (all `None` where `/proc` is absent).
    pub(crate) fn read() -> Self {
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        let ticks = std::fs::read_to_string("/proc/self/stat")
            .ok()
            .and_then(|s| stat_ticks(&s));
        let boot = std::fs::read_to_string("/proc/stat").ok().and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("btime "))
                .and_then(|v| v.trim().parse::<u64>().ok())
        });
        Self {
            resident_bytes: status_field(&status, "VmRSS").map(|kb| kb * 1024),
            threads: status_field(&status, "Threads"),
            cpu_seconds: ticks.map(|(cpu, _)| cpu as f64 / USER_HZ),
            open_fds: std::fs::read_dir("/proc/self/fd")
                .ok()
                .map(|d| d.count() as u64),
            start_time_seconds: ticks
                .zip(boot)
                .map(|((_, start), boot)| boot as f64 + start as f64 / USER_HZ),
        }
    }

    /// Registers what was read.
    pub(crate) fn register(&self, reg: &mut Registry) {
        let gauge = |v: u64| {
            let g = Gauge::<i64>::default();
            g.set(i64::try_from(v).unwrap_or(i64::MAX));
            g
        };
        if let Some(v) = self.resident_bytes {
            reg.register(
                "process_resident_memory_bytes",
                "Resident memory size in bytes",
                gauge(v),
            );
        }
        if let Some(v) = self.threads {
            reg.register("process_threads", "OS threads in the process", gauge(v));
        }
        if let Some(v) = self.open_fds {
            reg.register("process_open_fds", "Open file descriptors", gauge(v));
        }
        if let Some(v) = self.cpu_seconds {
            let c = Counter::<f64, AtomicU64>::default();
            c.inc_by(v);
            reg.register(
                "process_cpu_seconds",
                "User and system CPU time spent, in seconds",
                c,
            );
        }
        if let Some(v) = self.start_time_seconds {
            let g = Gauge::<f64, AtomicU64>::default();
            g.set(v);
            reg.register(
                "process_start_time_seconds",
                "Start time of the process since the Unix epoch, in seconds",
                g,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_files_are_parsed() {
        let status = "Name:\tkvengine\nVmRSS:\t  20480 kB\nThreads:\t7\n";
        assert_eq!(status_field(status, "VmRSS"), Some(20480));
        assert_eq!(status_field(status, "Threads"), Some(7));
        assert_eq!(status_field(status, "VmSwap"), None);
        // A command name with spaces and parentheses, then fields 3..=22.
        let stat = "42 (kv (engine) x) S 1 2 3 4 5 6 7 8 9 10 250 50 0 0 20 0 9 0 12345 99";
        assert_eq!(stat_ticks(stat), Some((300, 12345)));
        assert_eq!(stat_ticks("garbage"), None);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn this_process_is_measured() {
        let s = ProcessStats::read();
        assert!(s.resident_bytes.is_some_and(|b| b > 1 << 20), "{s:?}");
        assert!(s.threads.is_some_and(|t| t >= 1));
        assert!(s.open_fds.is_some_and(|n| n >= 3));
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let start = s.start_time_seconds.unwrap_or(0.0);
        assert!(
            start > now - 86_400.0 && start <= now + 1.0,
            "{start} vs {now}"
        );
    }
}
