//! What a simulated run measured, the table that compares routing modes, and its verdict.
//!
//! # Invariants
//! 1. Every ratio is finite: an empty run reports 0, never NaN.
//! 2. `hit_rate` is the workers' real hit (tokens they served from cache), never the
//!    index's prediction; `prediction_agreement` compares the two per request.

use std::fmt::Write as _;

use engine::sched::RouteMode;
use serde::Serialize;

use super::Cluster;

/// One routing mode's results.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ModeReport {
    /// The routing mode (`kv`, `round-robin`, `random`).
    pub mode: String,
    /// Requests routed.
    pub requests: u64,
    /// Prompt tokens over those requests.
    pub prompt_tokens: u64,
    /// Prompt tokens the workers served from their caches.
    pub hit_tokens: u64,
    /// `hit_tokens / prompt_tokens`.
    pub hit_rate: f64,
    /// Prompt tokens the index predicted the chosen workers held.
    pub predicted_hit_tokens: u64,
    /// Fraction of requests whose predicted overlap equals the real hit.
    pub prediction_agreement: f64,
    /// Requests per worker key, in key order.
    pub requests_per_worker: Vec<u64>,
    /// Busiest worker key's requests over the mean (1.0 is perfectly even).
    pub load_balance: f64,
    /// Wall time spent deciding (hash, match, route), in seconds.
    pub routing_seconds: f64,
    /// Routing decisions per second of that time.
    pub decisions_per_second: f64,
    /// KV events the index accepted.
    pub events_applied: u64,
    /// KV events the index refused in whole or in part (always 0 unless there is a bug).
    pub events_rejected: u64,
    /// Refusals counted by the index itself, over all reasons.
    pub index_rejects: u64,
    /// Blocks the workers stored.
    pub blocks_stored: u64,
    /// Blocks the workers evicted.
    pub blocks_evicted: u64,
    /// Full blocks computed but not cached (no free block).
    pub blocks_uncached: u64,
    /// Distinct blocks in the index at the end.
    pub index_blocks: usize,
    /// `(block, worker key)` entries in the index at the end.
    pub index_entries: u64,
    /// Heap bytes of the index and its directories at the end.
    pub index_bytes: usize,
    /// `index_bytes / index_entries`.
    pub bytes_per_entry: f64,
}

fn ratio(num: f64, den: f64) -> f64 {
    if den > 0.0 { num / den } else { 0.0 }
}

impl ModeReport {
    pub(super) fn new(c: &Cluster) -> Self {
        let t = &c.tally;
        let stats = c.index.stats();
        let max = t.per_key.iter().copied().max().unwrap_or(0);
        let mean = ratio(t.requests as f64, t.per_key.len() as f64);
        let secs = t.routing.as_secs_f64();
        Self {
            mode: c.config.mode.as_str().to_owned(),
            requests: t.requests,
            prompt_tokens: t.prompt_tokens,
            hit_tokens: t.hit_tokens,
            hit_rate: ratio(t.hit_tokens as f64, t.prompt_tokens as f64),
            predicted_hit_tokens: t.predicted_hit_tokens,
            prediction_agreement: ratio(t.agreed as f64, t.requests as f64),
            requests_per_worker: t.per_key.clone(),
            load_balance: ratio(max as f64, mean),
            routing_seconds: secs,
            decisions_per_second: ratio(t.requests as f64, secs),
            events_applied: t.events_applied,
            events_rejected: t.events_rejected,
            index_rejects: c.index.rejects().total(),
            blocks_stored: t.stored_blocks,
            blocks_evicted: t.evicted_blocks,
            blocks_uncached: t.uncached_blocks,
            index_blocks: stats.index.blocks,
            index_entries: stats.index.entries,
            index_bytes: stats.bytes,
            bytes_per_entry: ratio(stats.bytes as f64, stats.index.entries as f64),
        }
    }

    /// Whether any event was refused (a bug in a closed loop).
    pub fn has_rejects(&self) -> bool {
        self.events_rejected > 0 || self.index_rejects > 0
    }
}

/// `1234567` as `1.23M`, `45678` as `45.7k`.
fn human(x: f64) -> String {
    match x {
        x if x >= 1e9 => format!("{:.2}G", x / 1e9),
        x if x >= 1e6 => format!("{:.2}M", x / 1e6),
        x if x >= 1e4 => format!("{:.1}k", x / 1e3),
        x => format!("{x:.0}"),
    }
}

/// The comparison table: one row per mode.
pub fn table(reports: &[ModeReport]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<12} {:>8} {:>17} {:>9} {:>8} {:>11} {:>8} {:>9} {:>9} {:>8}",
        "mode",
        "hit rate",
        "hit / prompt tok",
        "pred=real",
        "balance",
        "decisions/s",
        "events",
        "rejected",
        "index ent",
        "B/entry"
    );
    for r in reports {
        let _ = writeln!(
            out,
            "{:<12} {:>7.1}% {:>17} {:>8.1}% {:>8.2} {:>11} {:>8} {:>9} {:>9} {:>8.1}",
            r.mode,
            100.0 * r.hit_rate,
            format!(
                "{} / {}",
                human(r.hit_tokens as f64),
                human(r.prompt_tokens as f64)
            ),
            100.0 * r.prediction_agreement,
            r.load_balance,
            human(r.decisions_per_second),
            human(r.events_applied as f64),
            r.events_rejected,
            human(r.index_entries as f64),
            r.bytes_per_entry,
        );
    }
    out
}

/// One line comparing kv mode's real hit rate with the baselines'.
pub fn verdict(reports: &[ModeReport]) -> String {
    let Some(kv) = reports.iter().find(|r| r.mode == RouteMode::Kv.as_str()) else {
        return "(kv mode not run: nothing to compare)".into();
    };
    let others: Vec<String> = reports
        .iter()
        .filter(|r| r.mode != kv.mode)
        .map(|r| {
            let gain = if r.hit_rate > 0.0 {
                format!("{:.2}x", kv.hit_rate / r.hit_rate)
            } else {
                "n/a".into()
            };
            format!("{} {:.1}% ({gain})", r.mode, 100.0 * r.hit_rate)
        })
        .collect();
    if others.is_empty() {
        return format!(
            "kv: {:.1}% of prompt tokens served from cache",
            100.0 * kv.hit_rate
        );
    }
    let beaten = reports
        .iter()
        .filter(|r| r.mode != kv.mode)
        .all(|r| kv.hit_rate > r.hit_rate);
    format!(
        "kv-aware routing served {:.1}% of prompt tokens from cache vs {}: {}",
        100.0 * kv.hit_rate,
        others.join(", "),
        if beaten {
            "kv wins"
        } else {
            "kv does not win on this configuration"
        }
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn human_units_and_empty_ratios() {
        assert_eq!(human(999.0), "999");
        assert_eq!(human(45_678.0), "45.7k");
        assert_eq!(human(1_234_567.0), "1.23M");
        assert_eq!(ratio(1.0, 0.0), 0.0);
    }

    fn report(mode: &str, hit_rate: f64) -> ModeReport {
        ModeReport {
            mode: mode.into(),
            requests: 0,
            prompt_tokens: 0,
            hit_tokens: 0,
            hit_rate,
            predicted_hit_tokens: 0,
            prediction_agreement: 0.0,
            requests_per_worker: vec![],
            load_balance: 0.0,
            routing_seconds: 0.0,
            decisions_per_second: 0.0,
            events_applied: 0,
            events_rejected: 0,
            index_rejects: 0,
            blocks_stored: 0,
            blocks_evicted: 0,
            blocks_uncached: 0,
            index_blocks: 0,
            index_entries: 0,
            index_bytes: 0,
            bytes_per_entry: 0.0,
        }
    }

    #[test]
    fn verdict_names_the_winner_or_says_it_lost() {
        let v = verdict(&[report("kv", 0.6), report("round-robin", 0.3)]);
        assert!(v.ends_with("kv wins"), "{v}");
        assert!(v.contains("round-robin 30.0% (2.00x)"), "{v}");
        let v = verdict(&[report("random", 0.5), report("kv", 0.5)]);
        assert!(v.ends_with("does not win on this configuration"), "{v}");
        assert!(verdict(&[report("random", 0.5)]).contains("not run"));
        assert!(verdict(&[report("kv", 0.5)]).starts_with("kv: 50.0%"));
        let v = verdict(&[report("kv", 0.5), report("random", 0.0)]);
        assert!(v.contains("random 0.0% (n/a)"), "{v}");
    }
}
