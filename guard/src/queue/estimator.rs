//! An online estimate of service time (dispatch to last byte) per class and model, learned from
//! completed requests only, and from it a prediction of when a new request would start.
//!
//! A generation's time grows with the tokens it is asked for, so where a request names its
//! output limit (`max_tokens`, `n_predict`, `num_predict`) the estimate is a line fitted to
//! (tokens asked, time taken); otherwise it is a moving average of the times seen.

use std::{
    cmp::Reverse,
    collections::{BinaryHeap, HashMap},
    time::Duration,
};

/// Weight of the newest sample: about the last ten requests count.
const SMOOTHING: f64 = 0.2;
/// No estimate is longer than this: it keeps every sum far from overflow.
pub const MAX_ESTIMATE: Duration = Duration::from_secs(7 * 24 * 3_600);

/// A duration from seconds, clamped to `0..=MAX_ESTIMATE` (NaN is zero).
pub fn clamp_secs(secs: f64) -> Duration {
    if secs.is_nan() || secs <= 0.0 {
        return Duration::ZERO;
    }
    Duration::try_from_secs_f64(secs)
        .unwrap_or(MAX_ESTIMATE)
        .min(MAX_ESTIMATE)
}

/// Exponentially weighted sums over (tokens asked, seconds taken): a least-squares line.
#[derive(Debug, Default, Clone)]
struct Fit {
    weight: f64,
    n: f64,
    t: f64,
    nn: f64,
    nt: f64,
}

impl Fit {
    fn add(&mut self, tokens: f64, secs: f64) {
        let keep = 1.0 - SMOOTHING;
        self.weight = self.weight * keep + 1.0;
        self.n = self.n * keep + tokens;
        self.t = self.t * keep + secs;
        self.nn = self.nn * keep + tokens * tokens;
        self.nt = self.nt * keep + tokens * secs;
    }

    /// Seconds for a request asking `tokens`, where there are samples.
    fn predict(&self, tokens: f64) -> Option<f64> {
        if self.weight <= 0.0 {
            return None;
        }
        let (mean_n, mean_t) = (self.n / self.weight, self.t / self.weight);
        let variance = self.nn / self.weight - mean_n * mean_n;
        // Spread in the tokens asked: a line (overhead + time per token).
        if variance > 1.0 {
            let slope = ((self.nt / self.weight - mean_n * mean_t) / variance).max(0.0);
            let overhead = (mean_t - slope * mean_n).max(0.0);
            return Some(overhead + slope * tokens);
        }
        // All samples asked about the same: scale their mean.
        if mean_n >= 1.0 {
            return Some(mean_t * tokens / mean_n);
        }
        Some(mean_t)
    }
}

/// What one key (class and model, class, or everything) has learned.
#[derive(Debug, Default, Clone)]
struct Learned {
    mean: Option<f64>,
    fit: Fit,
}

impl Learned {
    fn record(&mut self, tokens: Option<u64>, secs: f64) {
        self.mean = Some(match self.mean {
            Some(old) => old * (1.0 - SMOOTHING) + secs * SMOOTHING,
            None => secs,
        });
        if let Some(tokens) = tokens {
            self.fit.add(tokens as f64, secs);
        }
    }

    fn estimate(&self, tokens: Option<u64>) -> Option<f64> {
        tokens
            .and_then(|n| self.fit.predict(n as f64))
            .or(self.mean)
    }
}

/// Service-time estimates, most specific first: (class, model), class, all.
#[derive(Debug)]
pub struct Estimator {
    prior: Duration,
    by_class_model: HashMap<(String, String), Learned>,
    by_class: HashMap<String, Learned>,
    overall: Learned,
}

impl Estimator {
    /// `prior` (from config) stands in until the first request completes.
    pub fn new(prior: Duration) -> Self {
        Self {
            prior,
            by_class_model: HashMap::new(),
            by_class: HashMap::new(),
            overall: Learned::default(),
        }
    }

    pub fn set_prior(&mut self, prior: Duration) {
        self.prior = prior;
    }

    /// Folds in one completed request: its class, model, tokens asked and service time.
    pub fn record(
        &mut self,
        class: &str,
        model: Option<&str>,
        tokens: Option<u64>,
        took: Duration,
    ) {
        let secs = took.min(MAX_ESTIMATE).as_secs_f64();
        if let Some(model) = model {
            self.by_class_model
                .entry((class.to_owned(), model.to_owned()))
                .or_default()
                .record(tokens, secs);
        }
        self.by_class
            .entry(class.to_owned())
            .or_default()
            .record(tokens, secs);
        self.overall.record(tokens, secs);
    }

    /// The expected service time of a request of `class` for `model` asking `tokens`.
    pub fn service_time(&self, class: &str, model: Option<&str>, tokens: Option<u64>) -> Duration {
        let specific =
            model.and_then(|m| self.by_class_model.get(&(class.to_owned(), m.to_owned())));
        [specific, self.by_class.get(class), Some(&self.overall)]
            .into_iter()
            .flatten()
            .find_map(|learned| learned.estimate(tokens))
            .map_or(self.prior.min(MAX_ESTIMATE), clamp_secs)
    }
}

/// When the next job would start on `slots` servers that free up after `running` (remaining
/// times) and then serve `ahead` (service times, in dispatch order).
pub fn predict_start(
    slots: usize,
    running: impl IntoIterator<Item = Duration>,
    ahead: impl IntoIterator<Item = Duration>,
) -> Duration {
    let running: Vec<Duration> = running.into_iter().collect();
    let ahead: Vec<Duration> = ahead.into_iter().collect();
    // Slots beyond the jobs in sight start free: one more than those jobs is as good as any
    // number, and a huge max_concurrency must not mean a huge heap.
    let slots = slots.clamp(1, running.len() + ahead.len() + 1);
    let mut free_at: BinaryHeap<Reverse<Duration>> = running.into_iter().map(Reverse).collect();
    while free_at.len() < slots {
        free_at.push(Reverse(Duration::ZERO));
    }
    // More running than slots happens only right after a reload lowered the limit: the
    // earliest to free hand their slot on to the next.
    while free_at.len() > slots {
        let (Some(Reverse(first)), Some(Reverse(second))) = (free_at.pop(), free_at.pop()) else {
            break;
        };
        free_at.push(Reverse(first.saturating_add(second)));
    }
    for service in ahead {
        let Reverse(start) = free_at.pop().unwrap_or(Reverse(Duration::ZERO));
        free_at.push(Reverse(start.saturating_add(service)));
    }
    free_at
        .peek()
        .map_or(Duration::ZERO, |Reverse(start)| *start)
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    fn near(actual: Duration, expected: Duration) -> bool {
        actual.abs_diff(expected) < Duration::from_millis(20)
    }

    #[test]
    fn the_most_specific_estimate_wins() {
        let mut estimator = Estimator::new(S * 2);
        assert_eq!(
            estimator.service_time("batch", Some("m"), None),
            S * 2,
            "prior first"
        );
        estimator.record("batch", Some("m"), None, S * 4);
        estimator.record("batch", Some("other"), None, S);
        assert_eq!(estimator.service_time("batch", Some("m"), None), S * 4);
        assert_eq!(estimator.service_time("batch", Some("other"), None), S);
        // The class falls back to its blended mean; another class to the overall one.
        let class_mean = estimator.service_time("batch", None, None);
        assert!(class_mean > S && class_mean < S * 4, "{class_mean:?}");
        assert_eq!(
            estimator.service_time("interactive", None, None),
            class_mean
        );
    }

    #[test]
    fn the_average_follows_new_samples() {
        let mut estimator = Estimator::new(S);
        estimator.record("c", None, None, S * 10);
        for _ in 0..30 {
            estimator.record("c", None, None, S);
        }
        let now = estimator.service_time("c", None, None);
        assert!(now < S + Duration::from_millis(50), "{now:?}");
    }

    #[test]
    fn tokens_asked_scale_the_estimate() {
        let mut estimator = Estimator::new(S);
        // 50 ms to start, 10 ms a token.
        for tokens in [8, 300, 8, 100, 300, 50] {
            let took = Duration::from_millis(50 + 10 * tokens);
            estimator.record("c", Some("m"), Some(tokens), took);
        }
        let long = estimator.service_time("c", Some("m"), Some(400));
        assert!(near(long, Duration::from_millis(4_050)), "{long:?}");
        let short = estimator.service_time("c", Some("m"), Some(4));
        assert!(near(short, Duration::from_millis(90)), "{short:?}");
        // Without a token count: the mean of what was seen.
        let unknown = estimator.service_time("c", Some("m"), None);
        assert!(unknown > short && unknown < long, "{unknown:?}");
    }

    #[test]
    fn one_token_count_seen_scales_in_proportion() {
        let mut estimator = Estimator::new(S);
        estimator.record("c", None, Some(100), S);
        assert!(near(estimator.service_time("c", None, Some(300)), S * 3));
    }

    #[test]
    fn estimates_never_overflow() {
        let mut estimator = Estimator::new(Duration::MAX);
        assert_eq!(
            estimator.service_time("c", None, Some(u64::MAX)),
            MAX_ESTIMATE
        );
        estimator.record("c", None, Some(u64::MAX), Duration::MAX);
        estimator.record("c", None, Some(1), Duration::MAX);
        assert!(estimator.service_time("c", None, Some(u64::MAX)) <= MAX_ESTIMATE);
        assert_eq!(clamp_secs(f64::NAN), Duration::ZERO);
        assert_eq!(clamp_secs(f64::INFINITY), MAX_ESTIMATE);
    }

    #[test]
    fn start_prediction_fills_the_earliest_slot() {
        assert_eq!(predict_start(1, [], []), Duration::ZERO, "idle: starts now");
        assert_eq!(predict_start(1, [S], []), S, "behind one running");
        assert_eq!(predict_start(1, [S], [S, S]), S * 3, "and two queued");
        assert_eq!(predict_start(2, [S], []), Duration::ZERO, "a free slot");
        assert_eq!(predict_start(2, [S, S * 3], [S * 2]), S * 3);
        assert_eq!(
            predict_start(1, [S, S], []),
            S * 2,
            "over the limit after a reload"
        );
        assert_eq!(predict_start(usize::MAX, [S], [S]), Duration::ZERO);
        assert_eq!(
            predict_start(1, [Duration::MAX], [Duration::MAX]),
            Duration::MAX
        );
    }
}
