//! An SVG comparing modes, written by hand: three panels of bars, one bar per mode: TTFT
//! p50, TTFT p99 (simulated ms) and the cache hit rate (%), the last with the workload's
//! infinite-cache bound as a dashed line.
//!
//! When any report is of a disaggregated run (`--disagg`), six panels in two rows instead,
//! one bar per run side by side: TTFT p50 and p99, inter-token latency p50 and p99
//! (simulated ms), output tokens per simulated second and the cache hit rate.
//!
//! # Invariants
//! 1. The output is well-formed XML for any input: text is escaped, every number finite.

use super::report::ModeReport;
use anyhow::{Context, Result};
use std::fmt::Write as _;
use std::path::Path;

const PANEL_W: f64 = 260.0;
const PANEL_H: f64 = 220.0;
const MARGIN_TOP: f64 = 56.0;
const MARGIN_BOTTOM: f64 = 70.0;
const MARGIN_LEFT: f64 = 56.0;
const GAP: f64 = 40.0;
const COLORS: [&str; 6] = [
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
];

/// `s` with XML's special characters escaped.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            c if c.is_control() => {}
            c => out.push(c),
        }
    }
    out
}

/// `x` if finite and positive, else 0 (every coordinate written goes through this).
pub(crate) fn finite(x: f64) -> f64 {
    if x.is_finite() { x.max(0.0) } else { 0.0 }
}

/// A "nice" axis maximum at or above `x` (1, 2 or 5 times a power of ten).
pub(crate) fn nice_max(x: f64) -> f64 {
    let x = finite(x);
    if x <= 0.0 {
        return 1.0;
    }
    let p = 10f64.powf(x.log10().floor());
    for m in [1.0, 2.0, 5.0, 10.0] {
        if m * p >= x {
            return m * p;
        }
    }
    10.0 * p
}

struct Panel<'a> {
    title: &'a str,
    unit: &'a str,
    values: Vec<f64>,
    /// A dashed reference line (value).
    reference: Option<(f64, &'a str)>,
}

/// Draws `p` with its plot area's left edge at `x0`, `y0` below the top of a row.
fn panel(svg: &mut String, x0: f64, y0: f64, labels: &[String], p: &Panel<'_>) {
    let top = y0 + MARGIN_TOP;
    let bottom = top + PANEL_H;
    let max = nice_max(
        p.values
            .iter()
            .copied()
            .chain(p.reference.map(|r| r.0))
            .fold(0.0, f64::max),
    );
    let y = |v: f64| bottom - PANEL_H * (finite(v) / max).min(1.0);
    let _ = writeln!(
        svg,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle" font-size="14" font-weight="bold">{}</text>"#,
        x0 + PANEL_W / 2.0,
        top - 20.0,
        escape(p.title)
    );
    // Axes and gridlines.
    for i in 0..=4 {
        let v = max * f64::from(i) / 4.0;
        let yy = y(v);
        let _ = writeln!(
            svg,
            r##"<line x1="{x0:.1}" y1="{yy:.1}" x2="{:.1}" y2="{yy:.1}" stroke="#ddd"/>"##,
            x0 + PANEL_W
        );
        let _ = writeln!(
            svg,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="end" font-size="10">{}</text>"#,
            x0 - 4.0,
            yy + 3.0,
            escape(&format_value(v))
        );
    }
    let _ = writeln!(
        svg,
        r##"<line x1="{x0:.1}" y1="{top:.1}" x2="{x0:.1}" y2="{bottom:.1}" stroke="#333"/>"##
    );
    let _ = writeln!(
        svg,
        r##"<line x1="{x0:.1}" y1="{bottom:.1}" x2="{:.1}" y2="{bottom:.1}" stroke="#333"/>"##,
        x0 + PANEL_W
    );
    let _ = writeln!(
        svg,
        r#"<text x="{:.1}" y="{:.1}" font-size="10">{}</text>"#,
        x0 - MARGIN_LEFT + 4.0,
        top - 6.0,
        escape(p.unit)
    );
    let n = p.values.len().max(1) as f64;
    let slot = PANEL_W / n;
    let bar = slot * 0.6;
    for (i, v) in p.values.iter().enumerate() {
        let cx = x0 + slot * (i as f64 + 0.5);
        let yy = y(*v);
        let color = COLORS.get(i % COLORS.len()).copied().unwrap_or("#888");
        let _ = writeln!(
            svg,
            r#"<rect x="{:.1}" y="{yy:.1}" width="{bar:.1}" height="{:.1}" fill="{color}"/>"#,
            cx - bar / 2.0,
            (bottom - yy).max(0.0)
        );
        let _ = writeln!(
            svg,
            r#"<text x="{cx:.1}" y="{:.1}" text-anchor="middle" font-size="10">{}</text>"#,
            yy - 4.0,
            escape(&format_value(*v))
        );
        let label = labels.get(i).map_or("", String::as_str);
        let _ = writeln!(
            svg,
            r#"<text x="{cx:.1}" y="{:.1}" text-anchor="end" font-size="11" transform="rotate(-30 {cx:.1} {:.1})">{}</text>"#,
            bottom + 16.0,
            bottom + 16.0,
            escape(label)
        );
    }
    if let Some((v, label)) = p.reference {
        let yy = y(v);
        let _ = writeln!(
            svg,
            r##"<line x1="{x0:.1}" y1="{yy:.1}" x2="{:.1}" y2="{yy:.1}" stroke="#000" stroke-dasharray="5,4"/>"##,
            x0 + PANEL_W
        );
        let _ = writeln!(
            svg,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="end" font-size="10">{}</text>"#,
            x0 + PANEL_W,
            yy - 4.0,
            escape(label)
        );
    }
}

fn format_value(v: f64) -> String {
    let v = finite(v);
    if v >= 100.0 || v == 0.0 {
        format!("{v:.0}")
    } else if v >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

/// The SVG comparing `reports` (one bar per report in each panel), titled `title`: the
/// disaggregated layout when any report has disaggregation figures.
pub fn svg(reports: &[ModeReport], title: &str) -> String {
    if reports.iter().any(|r| r.disagg.is_some()) {
        return disagg_svg(reports, title);
    }
    let labels: Vec<String> = reports.iter().map(|r| r.mode.clone()).collect();
    // The line is what the cluster's capacity allows; the infinite cache is named beside.
    let (bound, infinite) = reports.first().map_or((0.0, 0.0), |r| {
        (100.0 * r.capacity_hit_bound, 100.0 * r.hit_rate_bound)
    });
    // ("no eviction", not "infinite": a plot with "inf" in it reads as a broken number.)
    let bound_label = format!("capacity bound {bound:.1}% (no eviction {infinite:.1}%)");
    let panels = [
        Panel {
            title: "TTFT p50",
            unit: "ms",
            values: reports.iter().map(|r| finite(r.ttft_p50_ms)).collect(),
            reference: None,
        },
        Panel {
            title: "TTFT p90",
            unit: "ms",
            values: reports.iter().map(|r| finite(r.ttft_p90_ms)).collect(),
            reference: None,
        },
        Panel {
            title: "TTFT p99",
            unit: "ms",
            values: reports.iter().map(|r| finite(r.ttft_p99_ms)).collect(),
            reference: None,
        },
        Panel {
            title: "Cache hit rate",
            unit: "%",
            values: reports
                .iter()
                .map(|r| finite(100.0 * r.cache_hit_rate))
                .collect(),
            reference: Some((bound, bound_label.as_str())),
        },
    ];
    layout(&labels, &panels, panels.len(), title)
}

/// The six-panel SVG of a disaggregated comparison (see the module's documentation).
pub fn disagg_svg(reports: &[ModeReport], title: &str) -> String {
    let labels: Vec<String> = reports.iter().map(|r| r.mode.clone()).collect();
    let bound = reports.first().map_or(0.0, |r| 100.0 * r.hit_rate_bound);
    let bound_label = format!("bound {bound:.1}%");
    let of = |f: fn(&ModeReport) -> f64| reports.iter().map(|r| finite(f(r))).collect();
    let panels = [
        Panel {
            title: "TTFT p50",
            unit: "ms",
            values: of(|r| r.ttft_p50_ms),
            reference: None,
        },
        Panel {
            title: "TTFT p99",
            unit: "ms",
            values: of(|r| r.ttft_p99_ms),
            reference: None,
        },
        Panel {
            title: "Output throughput",
            unit: "tok/s",
            values: of(|r| r.output_tok_per_s),
            reference: None,
        },
        Panel {
            title: "Inter-token latency p50",
            unit: "ms",
            values: of(|r| r.itl_p50_ms),
            reference: None,
        },
        Panel {
            title: "Inter-token latency p99",
            unit: "ms",
            values: of(|r| r.itl_p99_ms),
            reference: None,
        },
        Panel {
            title: "Cache hit rate",
            unit: "%",
            values: of(|r| 100.0 * r.cache_hit_rate),
            reference: Some((bound, bound_label.as_str())),
        },
    ];
    layout(&labels, &panels, 3, title)
}

/// `panels` in rows of `columns`, under `title`.
fn layout(labels: &[String], panels: &[Panel<'_>], columns: usize, title: &str) -> String {
    let columns = columns.clamp(1, panels.len().max(1));
    let rows = panels.len().div_ceil(columns).max(1);
    let row_h = MARGIN_TOP + PANEL_H + MARGIN_BOTTOM;
    let width = MARGIN_LEFT + columns as f64 * (PANEL_W + GAP + MARGIN_LEFT) - GAP;
    let height = rows as f64 * row_h;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0}" height="{height:.0}" viewBox="0 0 {width:.0} {height:.0}" font-family="sans-serif">"#
    );
    let _ = writeln!(
        s,
        r##"<rect x="0" y="0" width="{width:.0}" height="{height:.0}" fill="#fff"/>"##
    );
    let _ = writeln!(
        s,
        r#"<text x="{:.1}" y="18" text-anchor="middle" font-size="13">{}</text>"#,
        width / 2.0,
        escape(title)
    );
    for (i, p) in panels.iter().enumerate() {
        let (row, col) = (i / columns, i % columns);
        let x0 = MARGIN_LEFT + col as f64 * (PANEL_W + GAP + MARGIN_LEFT);
        panel(&mut s, x0, row as f64 * row_h, labels, p);
    }
    s.push_str("</svg>\n");
    s
}

/// Writes [`svg`] of `reports` to `path`.
pub fn write_svg(reports: &[ModeReport], title: &str, path: &Path) -> Result<()> {
    std::fs::write(path, svg(reports, title)).with_context(|| format!("writing {}", path.display()))
}
