//! Valid jobs and tokens per class over the last hour, in one-minute buckets: what `/status`
//! shows beside the counters (a job that fails halfway is not throughput).

use std::{
    collections::{BTreeMap, VecDeque},
    sync::Mutex,
    time::{Duration, Instant},
};

const BUCKET: Duration = Duration::from_secs(60);
const BUCKETS: u64 = 60;

/// One class's work over the last hour.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Hourly {
    pub valid_jobs: u64,
    pub invalid_jobs: u64,
    pub prompt_tokens: u64,
    pub generated_tokens: u64,
}

impl Hourly {
    fn add(&mut self, other: &Self) {
        self.valid_jobs += other.valid_jobs;
        self.invalid_jobs += other.invalid_jobs;
        self.prompt_tokens += other.prompt_tokens;
        self.generated_tokens += other.generated_tokens;
    }
}

/// The buckets of every class.
#[derive(Debug)]
pub struct Throughput {
    started: Instant,
    classes: Mutex<BTreeMap<String, VecDeque<(u64, Hourly)>>>,
}

impl Default for Throughput {
    fn default() -> Self {
        Self {
            started: Instant::now(),
            classes: Mutex::default(),
        }
    }
}

impl Throughput {
    /// Counts one finished job of `class`.
    pub fn record(&self, class: &str, job: Hourly) {
        self.record_at(class, job, Instant::now());
    }

    fn record_at(&self, class: &str, job: Hourly, now: Instant) {
        let minute = self.minute(now);
        let mut classes = self
            .classes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let buckets = classes.entry(class.to_owned()).or_default();
        match buckets.back_mut() {
            Some((at, counts)) if *at == minute => counts.add(&job),
            _ => buckets.push_back((minute, job)),
        }
        while buckets
            .front()
            .is_some_and(|(at, _)| at + BUCKETS <= minute)
        {
            buckets.pop_front();
        }
    }

    /// Per class, the jobs and tokens of the last hour.
    pub fn last_hour(&self) -> BTreeMap<String, Hourly> {
        self.last_hour_at(Instant::now())
    }

    fn last_hour_at(&self, now: Instant) -> BTreeMap<String, Hourly> {
        let minute = self.minute(now);
        let classes = self
            .classes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        classes
            .iter()
            .map(|(class, buckets)| {
                let mut sum = Hourly::default();
                for (_, counts) in buckets.iter().filter(|(at, _)| at + BUCKETS > minute) {
                    sum.add(counts);
                }
                (class.clone(), sum)
            })
            .collect()
    }

    fn minute(&self, now: Instant) -> u64 {
        now.saturating_duration_since(self.started).as_secs() / BUCKET.as_secs()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_hour_forgets_older_work() {
        let throughput = Throughput::default();
        let t0 = throughput.started;
        let job = Hourly {
            valid_jobs: 1,
            generated_tokens: 10,
            ..Hourly::default()
        };
        throughput.record_at("batch", job, t0);
        throughput.record_at("batch", job, t0 + Duration::from_secs(30 * 60));
        let hour = throughput.last_hour_at(t0 + Duration::from_secs(59 * 60));
        assert_eq!(
            (hour["batch"].valid_jobs, hour["batch"].generated_tokens),
            (2, 20)
        );
        let later = throughput.last_hour_at(t0 + Duration::from_secs(61 * 60));
        assert_eq!(
            later["batch"].valid_jobs, 1,
            "the first job is over an hour old"
        );
    }
}
