//! One logbook entry: everything needed for a number to keep its meaning months later.

use serde::{Deserialize, Serialize};

/// p50 and p95 over all runs, with the spread of the per-run p50s.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Spread {
    pub p50: f64,
    pub p95: f64,
    /// Lowest and highest per-run p50: a difference inside this range may be noise.
    pub run_p50_min: f64,
    pub run_p50_max: f64,
}

impl Spread {
    /// From per-run sample lists.
    pub fn of(runs: &[Vec<f64>]) -> Self {
        let all: Vec<f64> = runs.iter().flatten().copied().collect();
        let run_p50s: Vec<f64> = runs.iter().map(|r| quantile(r, 0.5)).collect();
        Self {
            p50: quantile(&all, 0.5),
            p95: quantile(&all, 0.95),
            run_p50_min: run_p50s
                .iter()
                .copied()
                .fold(f64::INFINITY, f64::min)
                .min(f64::MAX),
            run_p50_max: run_p50s.iter().copied().fold(0.0, f64::max),
        }
    }
}

/// The value at quantile `q` of `samples` (0 for none).
pub fn quantile(samples: &[f64], q: f64) -> f64 {
    guard::quantile::quantile(samples, q).unwrap_or(0.0)
}

/// A measurement that may be absent on this machine: a number or "unavailable".
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Maybe {
    Value(f64),
    Unavailable(String),
}

impl Maybe {
    pub fn unavailable() -> Self {
        Self::Unavailable("unavailable".to_owned())
    }

    pub fn value(&self) -> Option<f64> {
        match self {
            Self::Value(v) => Some(*v),
            Self::Unavailable(_) => None,
        }
    }
}

/// Every request's figures, one list a repetition: the report's distributions and each run's
/// own value. Empty in entries recorded before the logbook kept them.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Runs {
    pub ttft_ms: Vec<Vec<f64>>,
    pub completion_ms: Vec<Vec<f64>>,
    pub decode_tokens_per_second: Vec<Vec<f64>>,
    pub queue_delay_ms: Vec<Vec<f64>>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct InputSet {
    pub path: String,
    pub sha256: String,
    pub inputs: usize,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Entry {
    pub id: String,
    pub recorded_at: jiff::Timestamp,
    /// The exact command line that produced this entry.
    pub command: String,
    pub model: String,
    pub model_digest: String,
    pub runtime: String,
    pub runtime_version: String,
    pub launch_flags: String,
    pub api: guard::config::Api,
    pub url: String,
    pub workload_class: String,
    pub input_set: InputSet,
    pub repetitions: usize,
    /// TTFT of the first request after the model was unloaded (or the server restarted).
    pub cold_start_ms: Maybe,
    /// TTFT of a request right after another (model loaded).
    pub warm_start_ms: f64,
    pub ttft_ms: Spread,
    pub completion_ms: Spread,
    pub decode_tokens_per_second: Spread,
    pub queue_delay_ms: Spread,
    pub peak_server_rss_bytes: Maybe,
    pub peak_gpu_memory_bytes: Maybe,
    pub energy_joules: Maybe,
    pub mean_power_watts: Maybe,
    pub quality_failures: usize,
    pub abstentions: usize,
    /// Every TTFT sample, for the report's distribution plot.
    pub ttft_samples_ms: Vec<f64>,
    #[serde(default)]
    pub runs: Runs,
    pub decision: String,
    pub owner: String,
    pub retest_date: jiff::civil::Date,
}

impl Entry {
    pub fn is_due(&self, today: jiff::civil::Date) -> bool {
        self.retest_date <= today
    }

    /// The first eight characters of its id, as `guard logbook list` shows it.
    pub fn short_id(&self) -> &str {
        &self.id[..self.id.len().min(8)]
    }
}

/// An entry as the logbook stores it, for tests: TTFT samples only, as before `runs` was kept.
#[cfg(test)]
pub fn fixture(model: &str) -> Entry {
    let line = r#"{"id":"0123456789ab","recorded_at":"2026-12-04T10:00:00Z","command":"c","model":"MODEL","model_digest":"d","runtime":"r","runtime_version":"v","launch_flags":"","api":"openai","url":"u","workload_class":"w","input_set":{"path":"p","sha256":"s","inputs":1},"repetitions":1,"cold_start_ms":"unavailable","warm_start_ms":1.0,"ttft_ms":{"p50":2.0,"p95":3.0,"run_p50_min":2.0,"run_p50_max":2.0},"completion_ms":{"p50":1.0,"p95":2.0,"run_p50_min":1.0,"run_p50_max":1.0},"decode_tokens_per_second":{"p50":1.0,"p95":2.0,"run_p50_min":1.0,"run_p50_max":1.0},"queue_delay_ms":{"p50":0.0,"p95":0.0,"run_p50_min":0.0,"run_p50_max":0.0},"peak_server_rss_bytes":"unavailable","peak_gpu_memory_bytes":"unavailable","energy_joules":"unavailable","mean_power_watts":"unavailable","quality_failures":0,"abstentions":0,"ttft_samples_ms":[1.0,2.0,3.0],"decision":"d","owner":"o","retest_date":"2027-01-03"}"#;
    let line = line.replace("MODEL", &model.replace('"', "\\\""));
    serde_json::from_str(&line).expect("an entry as the logbook stores it")
}
