//! An online estimate of service time (dispatch to last byte) per class and model, and from it
//! a prediction of when a new request would start.

use std::{
    cmp::Reverse,
    collections::{BinaryHeap, HashMap},
    time::Duration,
};

/// Weight of the newest sample in the moving average: about the last ten requests count.
const SMOOTHING: f64 = 0.2;

/// Exponentially weighted mean service times, most specific first: (class, model), class, all.
#[derive(Debug)]
pub struct Estimator {
    prior: Duration,
    by_class_model: HashMap<(String, String), Duration>,
    by_class: HashMap<String, Duration>,
    overall: Option<Duration>,
}

impl Estimator {
    /// `prior` stands in until the first request completes.
    pub fn new(prior: Duration) -> Self {
        Self {
            prior,
            by_class_model: HashMap::new(),
            by_class: HashMap::new(),
            overall: None,
        }
    }

    pub fn set_prior(&mut self, prior: Duration) {
        self.prior = prior;
    }

    /// Folds in one observed service time.
    pub fn record(&mut self, class: &str, model: Option<&str>, took: Duration) {
        let blend = |old: Option<&Duration>| match old {
            Some(old) => old.mul_f64(1.0 - SMOOTHING) + took.mul_f64(SMOOTHING),
            None => took,
        };
        if let Some(model) = model {
            let key = (class.to_owned(), model.to_owned());
            let next = blend(self.by_class_model.get(&key));
            self.by_class_model.insert(key, next);
        }
        let next = blend(self.by_class.get(class));
        self.by_class.insert(class.to_owned(), next);
        self.overall = Some(blend(self.overall.as_ref()));
    }

    /// The expected service time of a request of `class` for `model`.
    pub fn service_time(&self, class: &str, model: Option<&str>) -> Duration {
        model
            .and_then(|m| self.by_class_model.get(&(class.to_owned(), m.to_owned())))
            .or_else(|| self.by_class.get(class))
            .copied()
            .or(self.overall)
            .unwrap_or(self.prior)
    }
}

/// When the next job would start on `slots` servers that free up after `running` (remaining
/// times) and then serve `ahead` (service times, in dispatch order).
pub fn predict_start(
    slots: usize,
    running: impl IntoIterator<Item = Duration>,
    ahead: impl IntoIterator<Item = Duration>,
) -> Duration {
    let slots = slots.max(1);
    let mut free_at: BinaryHeap<Reverse<Duration>> = running.into_iter().map(Reverse).collect();
    while free_at.len() < slots {
        free_at.push(Reverse(Duration::ZERO));
    }
    // More running than slots happens only right after a reload lowered the limit.
    while free_at.len() > slots {
        let Some(Reverse(first)) = free_at.pop() else {
            break;
        };
        let Some(Reverse(second)) = free_at.pop() else {
            break;
        };
        free_at.push(Reverse(first + second));
    }
    for service in ahead {
        let Reverse(start) = free_at.pop().unwrap_or(Reverse(Duration::ZERO));
        free_at.push(Reverse(start + service));
    }
    free_at
        .peek()
        .map_or(Duration::ZERO, |Reverse(start)| *start)
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn the_most_specific_estimate_wins() {
        let mut estimator = Estimator::new(S * 2);
        assert_eq!(
            estimator.service_time("batch", Some("m")),
            S * 2,
            "prior first"
        );
        estimator.record("batch", Some("m"), S * 4);
        estimator.record("batch", Some("other"), S);
        assert_eq!(estimator.service_time("batch", Some("m")), S * 4);
        assert_eq!(estimator.service_time("batch", Some("other")), S);
        // The class falls back to its blended mean; another class to the overall one.
        let class_mean = estimator.service_time("batch", None);
        assert!(class_mean > S && class_mean < S * 4, "{class_mean:?}");
        assert_eq!(estimator.service_time("interactive", None), class_mean);
    }

    #[test]
    fn the_average_follows_new_samples() {
        let mut estimator = Estimator::new(S);
        estimator.record("c", None, S * 10);
        for _ in 0..30 {
            estimator.record("c", None, S);
        }
        let now = estimator.service_time("c", None);
        assert!(now < S + Duration::from_millis(50), "{now:?}");
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
    }
}
