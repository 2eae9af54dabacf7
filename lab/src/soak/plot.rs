//! The soak's SVG, written by hand like `replay::plot` (whose XML escaping and axis scaling it reuses): two
//! panels over the run's time, the router's resident set (MB) and the route probes' p99
//! (ms) per interval, with fault windows shaded (darker for a router restart), the end of
//! the warm-up and each checkpoint as dashed lines.
//!
//! # Invariants
//! 1. The output is well-formed XML for any report: text is escaped, every number finite.

use super::faults::FaultKind;
use super::report::SoakReport;
use crate::replay::plot::{escape, finite, nice_max};
use anyhow::{Context, Result};
use std::fmt::Write as _;
use std::path::Path;

const W: f64 = 900.0;
const PANEL_H: f64 = 200.0;
const LEFT: f64 = 64.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 60.0;
const GAP: f64 = 70.0;

struct Panel<'a> {
    title: &'a str,
    unit: &'a str,
    color: &'a str,
    points: Vec<(f64, f64)>,
}

fn panel(svg: &mut String, r: &SoakReport, y0: f64, end: f64, p: &Panel<'_>) {
    let plot_w = W - LEFT - RIGHT;
    let bottom = y0 + PANEL_H;
    let x = |t: f64| LEFT + plot_w * (finite(t) / end).min(1.0);
    let max = nice_max(p.points.iter().map(|q| q.1).fold(0.0, f64::max) * 1.1);
    let y = |v: f64| bottom - PANEL_H * (finite(v) / max).min(1.0);
    let _ = writeln!(
        svg,
        r#"<text x="{:.1}" y="{:.1}" font-size="14" font-weight="bold">{}</text>"#,
        LEFT,
        y0 - 10.0,
        escape(p.title)
    );
    for f in &r.faults {
        let fill = if f.kind == FaultKind::RouterRestart {
            "#f4b6b6"
        } else {
            "#fbe3e3"
        };
        let (a, b) = (x(f.start_s), x(f.end_s));
        let _ = writeln!(
            svg,
            r#"<rect x="{a:.1}" y="{y0:.1}" width="{:.1}" height="{PANEL_H:.1}" fill="{fill}"/>"#,
            (b - a).max(1.0)
        );
    }
    for i in 0..=4 {
        let v = max * f64::from(i) / 4.0;
        let yy = y(v);
        let _ = writeln!(
            svg,
            r##"<line x1="{LEFT:.1}" y1="{yy:.1}" x2="{:.1}" y2="{yy:.1}" stroke="#ddd"/>"##,
            W - RIGHT
        );
        let _ = writeln!(
            svg,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="end" font-size="10">{v:.1}</text>"#,
            LEFT - 4.0,
            yy + 3.0
        );
    }
    let marks = std::iter::once(r.warmup_s).chain(r.checkpoints.iter().map(|c| c.t_s));
    for t in marks {
        let xx = x(t);
        let _ = writeln!(
            svg,
            r##"<line x1="{xx:.1}" y1="{y0:.1}" x2="{xx:.1}" y2="{bottom:.1}" stroke="#555" stroke-dasharray="4,3"/>"##
        );
    }
    let path: Vec<String> = p
        .points
        .iter()
        .map(|&(t, v)| format!("{:.1},{:.1}", x(t), y(v)))
        .collect();
    if !path.is_empty() {
        let _ = writeln!(
            svg,
            r#"<polyline points="{}" fill="none" stroke="{}" stroke-width="1.5"/>"#,
            path.join(" "),
            p.color
        );
    }
    let _ = writeln!(
        svg,
        r##"<line x1="{LEFT:.1}" y1="{y0:.1}" x2="{LEFT:.1}" y2="{bottom:.1}" stroke="#333"/><line x1="{LEFT:.1}" y1="{bottom:.1}" x2="{:.1}" y2="{bottom:.1}" stroke="#333"/>"##,
        W - RIGHT
    );
    let _ = writeln!(
        svg,
        r#"<text x="4" y="{:.1}" font-size="10">{}</text>"#,
        y0 + 10.0,
        escape(p.unit)
    );
    for i in 0..=5 {
        let t = end * f64::from(i) / 5.0;
        let _ = writeln!(
            svg,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle" font-size="10">{t:.0} s</text>"#,
            x(t),
            bottom + 14.0
        );
    }
}

/// The SVG of `r`.
pub fn svg(r: &SoakReport) -> String {
    let end = r
        .series
        .last()
        .map_or(r.duration_s, |p| p.t_s)
        .max(r.duration_s)
        .max(1.0);
    let height = TOP + 2.0 * PANEL_H + GAP + 40.0;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W:.0}" height="{height:.0}" viewBox="0 0 {W:.0} {height:.0}" font-family="sans-serif">"#
    );
    let _ = writeln!(
        s,
        r##"<rect x="0" y="0" width="{W:.0}" height="{height:.0}" fill="#fff"/>"##
    );
    let title = format!(
        "kvengine soak: {:.0} s, {} workers, {} faults; lost {} (+{} never received), stale {}; RSS x{:.3}; route p99 {:.2} ms quiet, {:.2} ms in faults",
        finite(r.duration_s),
        r.workers,
        r.faults.len(),
        r.acknowledged_lost,
        r.unacknowledged_lost,
        r.stale_entries,
        finite(r.rss_growth_ratio),
        finite(r.route_p99_ms_quiet),
        finite(r.route_p99_ms_faults)
    );
    let _ = writeln!(
        s,
        r#"<text x="{:.1}" y="20" text-anchor="middle" font-size="13">{}</text>"#,
        W / 2.0,
        escape(&title)
    );
    let _ = writeln!(
        s,
        r#"<text x="{:.1}" y="36" text-anchor="middle" font-size="10">shaded: fault windows (darker: router restart); dashed: end of warm-up, checkpoints</text>"#,
        W / 2.0
    );
    let rss = Panel {
        title: "Router resident set",
        unit: "MB",
        color: "#1f77b4",
        points: r
            .series
            .iter()
            .filter_map(|p| p.rss_mb.map(|v| (p.t_s, v)))
            .collect(),
    };
    let p99 = Panel {
        title: "Route p99 (client side, per interval)",
        unit: "ms",
        color: "#d62728",
        points: r
            .series
            .iter()
            .filter_map(|p| p.route_p99_ms.map(|v| (p.t_s, v)))
            .collect(),
    };
    panel(&mut s, r, TOP + 10.0, end, &rss);
    panel(&mut s, r, TOP + 10.0 + PANEL_H + GAP, end, &p99);
    s.push_str("</svg>\n");
    s
}

/// Writes [`svg`] of `r` to `path`.
pub fn write_svg(r: &SoakReport, path: &Path) -> Result<()> {
    std::fs::write(path, svg(r)).with_context(|| format!("writing {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_and_odd_reports_render() {
        let mut r = SoakReport::default();
        assert!(svg(&r).ends_with("</svg>\n"));
        r.duration_s = f64::NAN;
        r.warmup_s = f64::INFINITY;
        let out = svg(&r);
        assert!(!out.contains("NaN") && !out.contains("inf"));
        assert_eq!(nice_max(3.2), 5.0);
        assert_eq!(nice_max(0.0), 1.0);
    }
}
