//! `guard logbook compare A B`: every figure's change, costs beside gains, and whether a
//! difference is inside the runs' own spread.

use super::entry::{Entry, Maybe, Spread};

/// Which way is better for a figure.
#[derive(Clone, Copy)]
enum Better {
    Lower,
    Higher,
}

struct Row {
    name: &'static str,
    a: Option<f64>,
    b: Option<f64>,
    better: Better,
    /// The per-run p50 ranges, where the figure has them.
    spreads: Option<((f64, f64), (f64, f64))>,
}

fn spread_row(name: &'static str, a: &Spread, b: &Spread, better: Better, use_p95: bool) -> Row {
    let (av, bv) = if use_p95 {
        (a.p95, b.p95)
    } else {
        (a.p50, b.p50)
    };
    Row {
        name,
        a: Some(av),
        b: Some(bv),
        better,
        spreads: (!use_p95).then_some((
            (a.run_p50_min, a.run_p50_max),
            (b.run_p50_min, b.run_p50_max),
        )),
    }
}

fn maybe_row(name: &'static str, a: &Maybe, b: &Maybe, better: Better) -> Row {
    Row {
        name,
        a: a.value(),
        b: b.value(),
        better,
        spreads: None,
    }
}

/// The comparison as text.
pub fn compare(a: &Entry, b: &Entry) -> String {
    let mut out = format!(
        "A {} ({}, {}, {})\nB {} ({}, {}, {})\n",
        a.id, a.recorded_at, a.model, a.runtime, b.id, b.recorded_at, b.model, b.runtime
    );
    if a.input_set.sha256 != b.input_set.sha256 {
        out.push_str(
            "warning: the input sets differ (sha256): these runs measured different work\n",
        );
    }
    for (what, x, y) in [
        ("model digest", &a.model_digest, &b.model_digest),
        ("runtime version", &a.runtime_version, &b.runtime_version),
        ("launch flags", &a.launch_flags, &b.launch_flags),
    ] {
        if x != y {
            out.push_str(&format!("changed: {what}: {x} -> {y}\n"));
        }
    }
    let count = |n: usize| Some(n as f64);
    let rows = [
        maybe_row(
            "cold start ms",
            &a.cold_start_ms,
            &b.cold_start_ms,
            Better::Lower,
        ),
        Row {
            name: "warm start ms",
            a: Some(a.warm_start_ms),
            b: Some(b.warm_start_ms),
            better: Better::Lower,
            spreads: None,
        },
        spread_row("TTFT p50 ms", &a.ttft_ms, &b.ttft_ms, Better::Lower, false),
        spread_row("TTFT p95 ms", &a.ttft_ms, &b.ttft_ms, Better::Lower, true),
        spread_row(
            "completion p50 ms",
            &a.completion_ms,
            &b.completion_ms,
            Better::Lower,
            false,
        ),
        spread_row(
            "completion p95 ms",
            &a.completion_ms,
            &b.completion_ms,
            Better::Lower,
            true,
        ),
        spread_row(
            "decode tokens/s p50",
            &a.decode_tokens_per_second,
            &b.decode_tokens_per_second,
            Better::Higher,
            false,
        ),
        spread_row(
            "queue delay p50 ms",
            &a.queue_delay_ms,
            &b.queue_delay_ms,
            Better::Lower,
            false,
        ),
        maybe_row(
            "peak server RSS bytes",
            &a.peak_server_rss_bytes,
            &b.peak_server_rss_bytes,
            Better::Lower,
        ),
        maybe_row(
            "peak GPU memory bytes",
            &a.peak_gpu_memory_bytes,
            &b.peak_gpu_memory_bytes,
            Better::Lower,
        ),
        maybe_row(
            "energy J",
            &a.energy_joules,
            &b.energy_joules,
            Better::Lower,
        ),
        maybe_row(
            "mean power W",
            &a.mean_power_watts,
            &b.mean_power_watts,
            Better::Lower,
        ),
        Row {
            name: "quality failures",
            a: count(a.quality_failures),
            b: count(b.quality_failures),
            better: Better::Lower,
            spreads: None,
        },
        Row {
            name: "abstentions",
            a: count(a.abstentions),
            b: count(b.abstentions),
            better: Better::Lower,
            spreads: None,
        },
    ];
    out.push_str(&format!(
        "{:<24} {:>14} {:>14} {:>9}  {}\n",
        "figure", "A", "B", "change", "verdict"
    ));
    let (mut gains, mut costs) = (Vec::new(), Vec::new());
    for row in rows {
        let (Some(x), Some(y)) = (row.a, row.b) else {
            let show = |v: Option<f64>| v.map_or("unavailable".to_owned(), |v| format!("{v:.1}"));
            out.push_str(&format!(
                "{:<24} {:>14} {:>14} {:>9}  -\n",
                row.name,
                show(row.a),
                show(row.b),
                ""
            ));
            continue;
        };
        let change = if x == 0.0 {
            if y == 0.0 { 0.0 } else { f64::INFINITY }
        } else {
            (y - x) / x * 100.0
        };
        let improved = match row.better {
            Better::Lower => y < x,
            Better::Higher => y > x,
        };
        let noise = row
            .spreads
            .is_some_and(|((a_lo, a_hi), (b_lo, b_hi))| b_lo <= a_hi && a_lo <= b_hi);
        let verdict = if x == y {
            "same"
        } else if noise {
            "inside the runs' spread"
        } else if improved {
            gains.push(row.name);
            "gain"
        } else {
            costs.push(row.name);
            "COST"
        };
        out.push_str(&format!(
            "{:<24} {:>14.1} {:>14.1} {:>8.1}%  {verdict}\n",
            row.name, x, y, change
        ));
    }
    out.push_str(&format!(
        "gains: {}\ncosts: {}\n",
        if gains.is_empty() {
            "none".to_owned()
        } else {
            gains.join(", ")
        },
        if costs.is_empty() {
            "none".to_owned()
        } else {
            costs.join(", ")
        }
    ));
    out
}
