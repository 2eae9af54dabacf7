//! Disaggregated replays (`kvengine bench replay --disagg P:D`): what a run is, and the
//! `P:D` split of the simulated GPUs between prefill and decode workers.
//!
//! With a [`DisaggSpec`], each requested mode runs on `P` prefill plus `D` decode workers
//! (the router splitting every request between a prefill and a decode worker, the mode
//! choosing in both pools), and one aggregated `kv` run on `P + D` aggregated workers is
//! added for comparison: the same GPU count. Reports label the disaggregated runs
//! `disagg-<mode>` ([`Run::label`]).
//!
//! # Invariants
//! 1. A parsed spec has `P >= 1`, `D >= 1` and `P + D <= 256` ([`MAX_WORKERS`]).
//! 2. [`plan`] without a spec is the requested modes, in order, all aggregated.

use super::spec::RunMode;
use engine::sched::SplitConfig;
use std::fmt;
use transport::openai::disagg::{DisaggConfig, Protocol};

/// The most workers a replay starts.
pub const MAX_WORKERS: usize = 256;

/// How a disaggregated replay splits its workers and its requests.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DisaggSpec {
    /// Prefill workers (`P`, at least 1).
    pub prefill: usize,
    /// Decode workers (`D`, at least 1).
    pub decode: usize,
    /// The front door's hand-off protocol and conditional disaggregation.
    pub config: DisaggConfig,
}

impl DisaggSpec {
    /// `P:D` with `protocol` and the front door's default split but for
    /// `min_prefill_tokens`.
    pub fn new(
        (prefill, decode): (usize, usize),
        protocol: Protocol,
        min_prefill_tokens: u64,
    ) -> Result<Self, String> {
        check_split(prefill, decode)?;
        Ok(Self {
            prefill,
            decode,
            config: DisaggConfig {
                protocol,
                split: SplitConfig {
                    min_prefill_tokens,
                    ..SplitConfig::default()
                },
            },
        })
    }

    /// Workers in all: `P + D`.
    pub fn workers(&self) -> usize {
        self.prefill + self.decode
    }

    /// Rejects counts outside invariant 1.
    pub fn validate(&self) -> Result<(), String> {
        check_split(self.prefill, self.decode)
    }
}

impl fmt::Display for DisaggSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.prefill, self.decode)
    }
}

fn check_split(prefill: usize, decode: usize) -> Result<(), String> {
    if prefill == 0 {
        return Err("at least one prefill worker is needed (P >= 1)".into());
    }
    if decode == 0 {
        return Err("at least one decode worker is needed (D >= 1)".into());
    }
    if prefill.saturating_add(decode) > MAX_WORKERS {
        return Err(format!(
            "P + D must be at most {MAX_WORKERS}, not {}",
            prefill.saturating_add(decode)
        ));
    }
    Ok(())
}

/// Parses `P:D` (prefill workers, decode workers), e.g. `2:2`.
pub fn parse_split(s: &str) -> Result<(usize, usize), String> {
    let Some((p, d)) = s.trim().split_once(':') else {
        return Err(format!(
            "{s:?} is not P:D (prefill workers, a colon, decode workers; e.g. 2:2)"
        ));
    };
    let count = |part: &str, what: &str| -> Result<usize, String> {
        let part = part.trim();
        if part.is_empty() || !part.bytes().all(|b| b.is_ascii_digit()) {
            return Err(format!(
                "{s:?}: the {what} count {part:?} is not a whole number (expected P:D, e.g. 2:2)"
            ));
        }
        part.parse::<usize>()
            .map_err(|_| format!("{s:?}: the {what} count {part:?} is too large"))
    };
    let (p, d) = (count(p, "prefill")?, count(d, "decode")?);
    check_split(p, d).map_err(|e| format!("{s:?}: {e}"))?;
    Ok((p, d))
}

/// One replay on a fresh cluster: a routing mode, aggregated or disaggregated.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Run {
    /// How both pools (or the one aggregated pool) are chosen from.
    pub mode: RunMode,
    /// Prefill and decode workers (the replay's [`DisaggSpec`]) rather than aggregated ones.
    pub disagg: bool,
}

impl Run {
    /// An aggregated run in `mode`.
    pub fn aggregated(mode: RunMode) -> Self {
        Self {
            mode,
            disagg: false,
        }
    }

    /// Its name in reports: the mode's, `disagg-` before it when disaggregated.
    pub fn label(&self) -> String {
        if self.disagg {
            format!("disagg-{}", self.mode)
        } else {
            self.mode.as_str().to_owned()
        }
    }
}

impl fmt::Display for Run {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.label())
    }
}

/// The modes a disaggregated replay runs when none is asked for.
pub const DEFAULT_MODES: [RunMode; 2] = [RunMode::Kv, RunMode::RoundRobin];

/// The runs of a replay of `modes`: with `disagg`, each mode disaggregated then one
/// aggregated `kv` run; without, each mode aggregated. `kv-no-events` cannot be
/// disaggregated (the split is decided from the decode workers' reported caches).
pub fn plan(modes: &[RunMode], disagg: Option<&DisaggSpec>) -> Result<Vec<Run>, String> {
    if disagg.is_none() {
        return Ok(modes.iter().copied().map(Run::aggregated).collect());
    }
    let mut runs = Vec::with_capacity(modes.len() + 1);
    for &mode in modes {
        if !mode.kv_events() {
            return Err(format!(
                "mode {mode} cannot be disaggregated: use kv, round-robin or random with --disagg"
            ));
        }
        let run = Run { mode, disagg: true };
        if !runs.contains(&run) {
            runs.push(run);
        }
    }
    if runs.is_empty() {
        return Err("no mode given".into());
    }
    runs.push(Run::aggregated(RunMode::Kv));
    Ok(runs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_p_colon_d() {
        assert_eq!(parse_split("2:2"), Ok((2, 2)));
        assert_eq!(parse_split(" 1 : 3 "), Ok((1, 3)));
        assert_eq!(parse_split("255:1"), Ok((255, 1)));
        assert_eq!(parse_split("128:128"), Ok((128, 128)));
        for (bad, needle) in [
            ("", "not P:D"),
            ("4", "not P:D"),
            ("2-2", "not P:D"),
            (":2", "prefill count"),
            ("2:", "decode count"),
            ("a:2", "prefill count"),
            ("2:b", "decode count"),
            ("-1:2", "prefill count"),
            ("1.5:2", "prefill count"),
            ("2:2:2", "decode count"),
            ("+2:2", "prefill count"),
            ("0:2", "P >= 1"),
            ("2:0", "D >= 1"),
            ("200:57", "at most 256"),
            ("99999999999999999999999:1", "too large"),
        ] {
            let err = parse_split(bad).unwrap_err();
            assert!(err.contains(needle), "{bad:?}: {err}");
        }
    }

    #[test]
    fn spec_keeps_its_settings() {
        let s = DisaggSpec::new((2, 3), Protocol::Sglang, 64).unwrap();
        assert_eq!((s.prefill, s.decode, s.workers()), (2, 3, 5));
        assert_eq!(s.config.protocol, Protocol::Sglang);
        assert_eq!(s.config.split.min_prefill_tokens, 64);
        assert_eq!(s.to_string(), "2:3");
        assert!(DisaggSpec::new((0, 1), Protocol::Vllm, 0).is_err());
        let bad = DisaggSpec { decode: 0, ..s };
        assert!(bad.validate().is_err());
    }

    #[test]
    fn plans_disaggregated_runs_then_aggregated_kv() {
        let spec = DisaggSpec::new((1, 1), Protocol::Vllm, 512).unwrap();
        let runs = plan(&DEFAULT_MODES, Some(&spec)).unwrap();
        let labels: Vec<String> = runs.iter().map(Run::label).collect();
        assert_eq!(labels, ["disagg-kv", "disagg-round-robin", "kv"]);
        assert!(plan(&[RunMode::KvNoEvents], Some(&spec)).is_err());
        assert!(plan(&[], Some(&spec)).is_err());
        let plain = plan(&RunMode::ALL, None).unwrap();
        assert_eq!(
            plain.iter().map(Run::label).collect::<Vec<_>>(),
            RunMode::ALL.map(|m| m.as_str().to_owned())
        );
    }
}
