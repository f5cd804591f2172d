//! The figures an entry holds, as `compare` and `report` show them: each with its unit, the way
//! that is better, and the range of its per-run values where it has runs.

use serde::Serialize;

use super::entry::{Entry, Maybe, Spread, quantile};

/// What a figure is counted in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Unit {
    #[serde(rename = "ms")]
    Ms,
    #[serde(rename = "tokens/s")]
    TokensPerSecond,
    #[serde(rename = "MiB")]
    Mib,
    #[serde(rename = "J")]
    Joules,
    #[serde(rename = "W")]
    Watts,
    #[serde(rename = "count")]
    Count,
}

impl Unit {
    pub fn symbol(self) -> &'static str {
        match self {
            Self::Ms => "ms",
            Self::TokensPerSecond => "tokens/s",
            Self::Mib => "MiB",
            Self::Joules => "J",
            Self::Watts => "W",
            Self::Count => "count",
        }
    }

    /// A value as a person reads it: counts whole, the rest to three significant digits or
    /// whole units, whichever is longer.
    pub fn show(self, value: f64) -> String {
        match self {
            Self::Count => format!("{}", value.round() as i64),
            _ => plain(value),
        }
    }
}

/// A number without trailing zeros: whole from 100, one decimal from 10, two below.
pub fn plain(value: f64) -> String {
    let decimals = match value.abs() {
        v if v >= 100.0 => 0,
        v if v >= 10.0 => 1,
        _ => 2,
    };
    let text = format!("{value:.decimals$}");
    match text.contains('.') {
        true => text.trim_end_matches('0').trim_end_matches('.').to_owned(),
        false => text,
    }
}

/// Which way a figure improves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Better {
    Lower,
    Higher,
}

impl Better {
    pub fn word(self) -> &'static str {
        match self {
            Self::Lower => "lower",
            Self::Higher => "higher",
        }
    }
}

/// A figure measured on every request: drawn as a distribution, compared at its quantiles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Distribution {
    Ttft,
    Completion,
    Decode,
    Queue,
}

impl Distribution {
    pub const ALL: [Self; 4] = [Self::Ttft, Self::Completion, Self::Decode, Self::Queue];

    /// The chart's id in the report page (`chart-KEY`) and the start of the figure's key.
    pub fn key(self) -> &'static str {
        match self {
            Self::Ttft => "ttft",
            Self::Completion => "completion",
            Self::Decode => "decode_rate",
            Self::Queue => "queue_delay",
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Ttft => "TTFT",
            Self::Completion => "completion",
            Self::Decode => "decode rate",
            Self::Queue => "queue delay",
        }
    }

    pub fn title(self) -> &'static str {
        match self {
            Self::Ttft => "time to first token",
            Self::Completion => "completion time",
            Self::Decode => "decode rate",
            Self::Queue => "queue delay (guard's x-guard-queue-ms)",
        }
    }

    pub fn unit(self) -> Unit {
        match self {
            Self::Decode => Unit::TokensPerSecond,
            _ => Unit::Ms,
        }
    }

    pub fn better(self) -> Better {
        match self {
            Self::Decode => Better::Higher,
            _ => Better::Lower,
        }
    }

    pub fn spread(self, entry: &Entry) -> &Spread {
        match self {
            Self::Ttft => &entry.ttft_ms,
            Self::Completion => &entry.completion_ms,
            Self::Decode => &entry.decode_tokens_per_second,
            Self::Queue => &entry.queue_delay_ms,
        }
    }

    /// Each repetition's samples (empty in entries recorded before the logbook kept them).
    pub fn runs(self, entry: &Entry) -> &[Vec<f64>] {
        match self {
            Self::Ttft => &entry.runs.ttft_ms,
            Self::Completion => &entry.runs.completion_ms,
            Self::Decode => &entry.runs.decode_tokens_per_second,
            Self::Queue => &entry.runs.queue_delay_ms,
        }
    }

    /// Every request's sample; TTFT also from older entries, which kept only those.
    pub fn samples(self, entry: &Entry) -> Vec<f64> {
        let runs = self.runs(entry);
        match (self, runs.is_empty()) {
            (Self::Ttft, true) => entry.ttft_samples_ms.clone(),
            _ => runs.iter().flatten().copied().collect(),
        }
    }

    /// Each run's own value at quantile `q`.
    pub fn run_values(self, entry: &Entry, q: f64) -> Vec<f64> {
        let runs = self.runs(entry).iter().filter(|run| !run.is_empty());
        runs.map(|run| quantile(run, q)).collect()
    }

    /// The figure at quantile `q`, with the range of the runs' own values.
    fn reading(self, entry: &Entry, q: Quantile) -> Reading {
        let spread = self.spread(entry);
        let per_run = self.run_values(entry, q.share());
        let range = per_run.iter().copied().fold(None, |range, v| match range {
            None => Some((v, v)),
            Some((lo, hi)) => Some((f64::min(lo, v), f64::max(hi, v))),
        });
        // Older entries kept the per-run p50 range only.
        let runs =
            range.or((q == Quantile::P50).then_some((spread.run_p50_min, spread.run_p50_max)));
        Reading {
            value: Some(q.of(spread)),
            runs,
        }
    }
}

/// A figure measured once a run: drawn as a bar an entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Single {
    ColdStart,
    WarmStart,
    ServerRss,
    GpuMemory,
    Energy,
    Power,
    QualityFailures,
    Abstentions,
}

impl Single {
    /// Those drawn as bars in the report, in its order.
    pub const CHARTED: [Self; 6] = [
        Self::ServerRss,
        Self::GpuMemory,
        Self::Energy,
        Self::Power,
        Self::QualityFailures,
        Self::Abstentions,
    ];

    pub fn key(self) -> &'static str {
        match self {
            Self::ColdStart => "cold_start",
            Self::WarmStart => "warm_start",
            Self::ServerRss => "peak_server_rss",
            Self::GpuMemory => "peak_gpu_memory",
            Self::Energy => "energy",
            Self::Power => "mean_power",
            Self::QualityFailures => "quality_failures",
            Self::Abstentions => "abstentions",
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::ColdStart => "cold start",
            Self::WarmStart => "warm start",
            Self::ServerRss => "peak server RSS",
            Self::GpuMemory => "peak GPU memory",
            Self::Energy => "energy",
            Self::Power => "mean power",
            Self::QualityFailures => "quality failures",
            Self::Abstentions => "abstentions",
        }
    }

    pub fn unit(self) -> Unit {
        match self {
            Self::ColdStart | Self::WarmStart => Unit::Ms,
            Self::ServerRss | Self::GpuMemory => Unit::Mib,
            Self::Energy => Unit::Joules,
            Self::Power => Unit::Watts,
            Self::QualityFailures | Self::Abstentions => Unit::Count,
        }
    }

    /// The value in its unit, `None` where this machine could not measure it.
    pub fn value(self, entry: &Entry) -> Option<f64> {
        const MIB: f64 = 1024.0 * 1024.0;
        let mib = |bytes: &Maybe| bytes.value().map(|b| b / MIB);
        match self {
            Self::ColdStart => entry.cold_start_ms.value(),
            Self::WarmStart => Some(entry.warm_start_ms),
            Self::ServerRss => mib(&entry.peak_server_rss_bytes),
            Self::GpuMemory => mib(&entry.peak_gpu_memory_bytes),
            Self::Energy => entry.energy_joules.value(),
            Self::Power => entry.mean_power_watts.value(),
            Self::QualityFailures => Some(entry.quality_failures as f64),
            Self::Abstentions => Some(entry.abstentions as f64),
        }
    }
}

/// One figure's reading of one entry.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Reading {
    pub value: Option<f64>,
    /// The lowest and highest of the runs' own values.
    pub runs: Option<(f64, f64)>,
}

/// A row of the comparison.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Figure {
    At(Distribution, Quantile),
    Once(Single),
}

/// The quantile a distribution is compared at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Quantile {
    P50,
    P95,
}

impl Figure {
    /// Every figure, in the order compared.
    pub const ALL: [Self; 15] = {
        use Distribution::{Completion, Decode, Queue, Ttft};
        use Quantile::{P50, P95};
        [
            Self::Once(Single::ColdStart),
            Self::Once(Single::WarmStart),
            Self::At(Ttft, P50),
            Self::At(Ttft, P95),
            Self::At(Completion, P50),
            Self::At(Completion, P95),
            Self::At(Decode, P50),
            Self::At(Queue, P50),
            Self::At(Queue, P95),
            Self::Once(Single::ServerRss),
            Self::Once(Single::GpuMemory),
            Self::Once(Single::Energy),
            Self::Once(Single::Power),
            Self::Once(Single::QualityFailures),
            Self::Once(Single::Abstentions),
        ]
    };

    /// The figure's key in `compare --format json|csv`: stable, snake case.
    pub fn key(self) -> String {
        match self {
            Self::At(d, q) => format!("{}_{}", d.key(), q.name()),
            Self::Once(s) => s.key().to_owned(),
        }
    }

    pub fn name(self) -> String {
        match self {
            Self::At(d, q) => format!("{} {}", d.name(), q.name()),
            Self::Once(s) => s.name().to_owned(),
        }
    }

    pub fn unit(self) -> Unit {
        match self {
            Self::At(d, _) => d.unit(),
            Self::Once(s) => s.unit(),
        }
    }

    pub fn better(self) -> Better {
        match self {
            Self::At(d, _) => d.better(),
            Self::Once(_) => Better::Lower,
        }
    }

    pub fn reading(self, entry: &Entry) -> Reading {
        match self {
            Self::At(d, q) => d.reading(entry, q),
            Self::Once(s) => Reading {
                value: s.value(entry),
                runs: None,
            },
        }
    }
}

impl Quantile {
    pub fn name(self) -> &'static str {
        match self {
            Self::P50 => "p50",
            Self::P95 => "p95",
        }
    }

    pub fn share(self) -> f64 {
        match self {
            Self::P50 => 0.5,
            Self::P95 => 0.95,
        }
    }

    /// The quantile of all requests, as the entry recorded it.
    pub fn of(self, spread: &Spread) -> f64 {
        match self {
            Self::P50 => spread.p50,
            Self::P95 => spread.p95,
        }
    }
}
