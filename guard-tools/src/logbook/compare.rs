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

/// The comparison as text.
pub fn compare(a: &Entry, b: &Entry) -> String {
    let mut out = heading(a, b);
    out.push_str(&format!(
        "{:<24} {:>14} {:>14} {:>9}  {}\n",
        "figure", "A", "B", "change", "verdict"
    ));
    let (mut gains, mut costs) = (Vec::new(), Vec::new());
    for row in rows(a, b) {
        out.push_str(&row.line(&mut gains, &mut costs));
    }
    let list = |names: Vec<&str>| match names.is_empty() {
        true => "none".to_owned(),
        false => names.join(", "),
    };
    out.push_str(&format!("gains: {}\ncosts: {}\n", list(gains), list(costs)));
    out
}

/// The two entries, and what differs in how they were run.
fn heading(a: &Entry, b: &Entry) -> String {
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
    out
}

/// Every figure compared, in the order printed.
fn rows(a: &Entry, b: &Entry) -> [Row; 14] {
    use Better::{Higher, Lower};
    let spread = |name, figure: fn(&Entry) -> &Spread, better, use_p95| Row {
        name,
        better,
        ..Row::of_spread(figure(a), figure(b), use_p95)
    };
    let maybe = |name, figure: fn(&Entry) -> &Maybe| Row {
        name,
        a: figure(a).value(),
        b: figure(b).value(),
        better: Lower,
        spreads: None,
    };
    let plain = |name, figure: fn(&Entry) -> f64| Row {
        name,
        a: Some(figure(a)),
        b: Some(figure(b)),
        better: Lower,
        spreads: None,
    };
    [
        maybe("cold start ms", |e| &e.cold_start_ms),
        plain("warm start ms", |e| e.warm_start_ms),
        spread("TTFT p50 ms", |e| &e.ttft_ms, Lower, false),
        spread("TTFT p95 ms", |e| &e.ttft_ms, Lower, true),
        spread("completion p50 ms", |e| &e.completion_ms, Lower, false),
        spread("completion p95 ms", |e| &e.completion_ms, Lower, true),
        spread(
            "decode tokens/s p50",
            |e| &e.decode_tokens_per_second,
            Higher,
            false,
        ),
        spread("queue delay p50 ms", |e| &e.queue_delay_ms, Lower, false),
        maybe("peak server RSS bytes", |e| &e.peak_server_rss_bytes),
        maybe("peak GPU memory bytes", |e| &e.peak_gpu_memory_bytes),
        maybe("energy J", |e| &e.energy_joules),
        maybe("mean power W", |e| &e.mean_power_watts),
        plain("quality failures", |e| e.quality_failures as f64),
        plain("abstentions", |e| e.abstentions as f64),
    ]
}

impl Row {
    /// A p50 (with the per-run p50 ranges) or p95 row; its name and direction still to set.
    fn of_spread(a: &Spread, b: &Spread, use_p95: bool) -> Self {
        let (av, bv) = match use_p95 {
            true => (a.p95, b.p95),
            false => (a.p50, b.p50),
        };
        Self {
            name: "",
            a: Some(av),
            b: Some(bv),
            better: Better::Lower,
            spreads: (!use_p95).then_some((
                (a.run_p50_min, a.run_p50_max),
                (b.run_p50_min, b.run_p50_max),
            )),
        }
    }

    /// The row's line; its name goes to the gains or the costs where it is one.
    fn line(&self, gains: &mut Vec<&'static str>, costs: &mut Vec<&'static str>) -> String {
        let (Some(x), Some(y)) = (self.a, self.b) else {
            let show = |v: Option<f64>| v.map_or("unavailable".to_owned(), |v| format!("{v:.1}"));
            return format!(
                "{:<24} {:>14} {:>14} {:>9}  -\n",
                self.name,
                show(self.a),
                show(self.b),
                ""
            );
        };
        let change = if x == 0.0 {
            if y == 0.0 { 0.0 } else { f64::INFINITY }
        } else {
            (y - x) / x * 100.0
        };
        let improved = match self.better {
            Better::Lower => y < x,
            Better::Higher => y > x,
        };
        let noise = self
            .spreads
            .is_some_and(|((a_lo, a_hi), (b_lo, b_hi))| b_lo <= a_hi && a_lo <= b_hi);
        let verdict = if x == y {
            "same"
        } else if noise {
            "inside the runs' spread"
        } else if improved {
            gains.push(self.name);
            "gain"
        } else {
            costs.push(self.name);
            "COST"
        };
        format!(
            "{:<24} {:>14.1} {:>14.1} {:>8.1}%  {verdict}\n",
            self.name, x, y, change
        )
    }
}
