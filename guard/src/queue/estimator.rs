//! An online estimate of service time (dispatch to last byte) per class and model, learned from
//! completed requests only, and from it a prediction of when a new request would start.
//!
//! A generation's time is its prompt read at the model's prefill rate plus the tokens it
//! generates at the model's decode rate. Both rates are learned per model from completed
//! requests that said how many tokens they generated (the server's own count, and its decode
//! rate where it gives one); the tokens a request will generate are what it asks for
//! (`max_tokens`, `n_predict`, `num_predict`), else what its class and model generated
//! lately. Until a model's rates are known the estimate is a line fitted to (tokens asked,
//! time taken), or a moving average of the times seen.

use std::{
    cmp::Reverse,
    collections::{BinaryHeap, HashMap},
    time::Duration,
};

/// Weight of the newest sample: about the last ten requests count.
const SMOOTHING: f64 = 0.2;
/// Models (and class-model pairs) the estimator learns apart; names past this learn nothing of
/// their own (a client can name any model).
const MAX_MODELS: usize = 1024;
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

/// A completed request, as the estimator learns from it.
#[derive(Clone, Copy, Debug, Default)]
pub struct Observation<'a> {
    pub class: &'a str,
    pub model: Option<&'a str>,
    /// Output tokens asked for, where the request said.
    pub tokens: Option<u64>,
    /// The prompt's size in tokens, roughly.
    pub prompt: u64,
    /// Tokens generated, by the server's count.
    pub generated: Option<u64>,
    /// The server's own decode rate, tokens a second.
    pub decode_per_second: Option<f64>,
    /// Dispatch to last byte.
    pub took: Duration,
}

/// A model's speeds: seconds a prompt token takes to read (with the fixed cost of a request
/// spread over them) and a generated token to produce.
#[derive(Debug, Default, Clone, Copy)]
struct Rates {
    prefill: Option<f64>,
    decode: Option<f64>,
}

fn smooth(old: Option<f64>, new: f64) -> f64 {
    old.map_or(new, |old| old * (1.0 - SMOOTHING) + new * SMOOTHING)
}

impl Rates {
    fn learn(&mut self, seen: &Observation<'_>) {
        let (Some(generated), secs) = (seen.generated, seen.took.as_secs_f64()) else {
            return;
        };
        // Only the server's own decode rate splits the time into reading and generating;
        // without it (a server that does not say, a preempted answer's segments) the fits
        // below learn instead.
        let per_token = match seen.decode_per_second {
            Some(rate) if rate > 0.0 => 1.0 / rate,
            _ => return,
        };
        self.decode = Some(smooth(self.decode, per_token));
        let fixed = (secs - per_token * generated as f64).max(0.0);
        self.prefill = Some(smooth(self.prefill, fixed / seen.prompt.max(1) as f64));
    }

    fn predict(&self, prompt: u64, generated: f64) -> Option<f64> {
        Some(self.prefill? * prompt.max(1) as f64 + self.decode? * generated)
    }
}

/// What one key (class and model, class, or everything) has learned.
#[derive(Debug, Default, Clone)]
struct Learned {
    mean: Option<f64>,
    fit: Fit,
    /// Tokens its answers generated, lately.
    generated: Option<f64>,
}

impl Learned {
    fn record(&mut self, tokens: Option<u64>, generated: Option<u64>, secs: f64) {
        self.mean = Some(smooth(self.mean, secs));
        if let Some(tokens) = tokens {
            self.fit.add(tokens as f64, secs);
        }
        if let Some(generated) = generated {
            self.generated = Some(smooth(self.generated, generated as f64));
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
    /// Per model (or "" for requests that name none).
    rates: HashMap<String, Rates>,
    /// Per class, then per model (looked up by `&str`: no key is built per request).
    by_class_model: HashMap<String, HashMap<String, Learned>>,
    by_class: HashMap<String, Learned>,
    overall: Learned,
}

impl Estimator {
    /// `prior` (from config) stands in until the first request completes.
    pub fn new(prior: Duration) -> Self {
        Self {
            prior,
            rates: HashMap::new(),
            by_class_model: HashMap::new(),
            by_class: HashMap::new(),
            overall: Learned::default(),
        }
    }

    pub fn set_prior(&mut self, prior: Duration) {
        self.prior = prior;
    }

    /// Folds in one completed request: its class, model, tokens asked and service time.
    pub fn record(&mut self, seen: &Observation<'_>) {
        let (class, model, tokens) = (seen.class, seen.model, seen.tokens);
        let secs = seen.took.min(MAX_ESTIMATE).as_secs_f64();
        // Too many distinct models is a client making names up: only the first few learn.
        if let Some(rates) = entry(&mut self.rates, model.unwrap_or_default(), MAX_MODELS) {
            rates.learn(seen);
        }
        // Classes are the config's, as many as it names.
        if let Some(model) = model
            && let Some(models) = entry(&mut self.by_class_model, class, usize::MAX)
            && let Some(learned) = entry(models, model, MAX_MODELS)
        {
            learned.record(tokens, seen.generated, secs);
        }
        if let Some(learned) = entry(&mut self.by_class, class, usize::MAX) {
            learned.record(tokens, seen.generated, secs);
        }
        self.overall.record(tokens, seen.generated, secs);
    }

    /// The expected service time of a request of `class` for `model` asking `tokens`, its
    /// prompt `prompt` tokens long.
    pub fn service_time(
        &self,
        class: &str,
        model: Option<&str>,
        tokens: Option<u64>,
        prompt: u64,
    ) -> Duration {
        let specific = model.and_then(|m| self.by_class_model.get(class)?.get(m));
        let learned = [specific, self.by_class.get(class), Some(&self.overall)];
        let generated = tokens
            .map(|t| t as f64)
            .or_else(|| learned.iter().flatten().find_map(|l| l.generated));
        let by_rates = self
            .rates
            .get(model.unwrap_or_default())
            .zip(generated)
            .and_then(|(rates, generated)| rates.predict(prompt, generated));
        by_rates
            .or_else(|| {
                learned
                    .into_iter()
                    .flatten()
                    .find_map(|learned| learned.estimate(tokens))
            })
            .map_or(self.prior.min(MAX_ESTIMATE), clamp_secs)
    }
}

/// `map`'s value for `key`, made if the map holds fewer than `cap`; the key is copied only then.
fn entry<'m, V: Default>(
    map: &'m mut HashMap<String, V>,
    key: &str,
    cap: usize,
) -> Option<&'m mut V> {
    if !map.contains_key(key) {
        if map.len() >= cap {
            return None;
        }
        map.insert(key.to_owned(), V::default());
    }
    map.get_mut(key)
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

    fn seen<'a>(
        class: &'a str,
        model: Option<&'a str>,
        tokens: Option<u64>,
        took: Duration,
    ) -> Observation<'a> {
        Observation {
            class,
            model,
            tokens,
            took,
            ..Observation::default()
        }
    }

    #[test]
    fn prompt_size_and_tokens_scale_by_the_rates_learned_per_model() {
        let mut estimator = Estimator::new(S);
        // The server reports 100 tokens a second; reading takes 1 ms a prompt token.
        for (prompt, generated) in [(100, 50), (1_000, 20), (300, 200)] {
            let took = Duration::from_millis(prompt + generated * 10);
            estimator.record(&Observation {
                class: "batch",
                model: Some("m"),
                tokens: None,
                prompt,
                generated: Some(generated),
                decode_per_second: Some(100.0),
                took,
            });
        }
        let chat = estimator.service_time("interactive", Some("m"), Some(16), 50);
        assert!(near(chat, Duration::from_millis(210)), "{chat:?}");
        let extraction = estimator.service_time("batch", Some("m"), Some(400), 2_000);
        assert!(
            near(extraction, Duration::from_millis(6_000)),
            "{extraction:?}"
        );
        // Without a budget: what the class and model generated lately, at the same rates.
        let unknown = estimator.service_time("batch", Some("m"), None, 100);
        assert!(unknown > Duration::from_millis(500), "{unknown:?}");
    }

    fn near(actual: Duration, expected: Duration) -> bool {
        actual.abs_diff(expected) < Duration::from_millis(20)
    }

    #[test]
    fn the_most_specific_estimate_wins() {
        let mut estimator = Estimator::new(S * 2);
        assert_eq!(
            estimator.service_time("batch", Some("m"), None, 0),
            S * 2,
            "prior first"
        );
        estimator.record(&seen("batch", Some("m"), None, S * 4));
        estimator.record(&seen("batch", Some("other"), None, S));
        assert_eq!(estimator.service_time("batch", Some("m"), None, 0), S * 4);
        assert_eq!(estimator.service_time("batch", Some("other"), None, 0), S);
        // The class falls back to its blended mean; another class to the overall one.
        let class_mean = estimator.service_time("batch", None, None, 0);
        assert!(class_mean > S && class_mean < S * 4, "{class_mean:?}");
        assert_eq!(
            estimator.service_time("interactive", None, None, 0),
            class_mean
        );
    }

    #[test]
    fn the_average_follows_new_samples() {
        let mut estimator = Estimator::new(S);
        estimator.record(&seen("c", None, None, S * 10));
        for _ in 0..30 {
            estimator.record(&seen("c", None, None, S));
        }
        let now = estimator.service_time("c", None, None, 0);
        assert!(now < S + Duration::from_millis(50), "{now:?}");
    }

    #[test]
    fn tokens_asked_scale_the_estimate() {
        let mut estimator = Estimator::new(S);
        // 50 ms to start, 10 ms a token.
        for tokens in [8, 300, 8, 100, 300, 50] {
            let took = Duration::from_millis(50 + 10 * tokens);
            estimator.record(&seen("c", Some("m"), Some(tokens), took));
        }
        let long = estimator.service_time("c", Some("m"), Some(400), 0);
        assert!(near(long, Duration::from_millis(4_050)), "{long:?}");
        let short = estimator.service_time("c", Some("m"), Some(4), 0);
        assert!(near(short, Duration::from_millis(90)), "{short:?}");
        // Without a token count: the mean of what was seen.
        let unknown = estimator.service_time("c", Some("m"), None, 0);
        assert!(unknown > short && unknown < long, "{unknown:?}");
    }

    #[test]
    fn one_token_count_seen_scales_in_proportion() {
        let mut estimator = Estimator::new(S);
        estimator.record(&seen("c", None, Some(100), S));
        assert!(near(estimator.service_time("c", None, Some(300), 0), S * 3));
    }

    #[test]
    fn estimates_never_overflow() {
        let mut estimator = Estimator::new(Duration::MAX);
        assert_eq!(
            estimator.service_time("c", None, Some(u64::MAX), 0),
            MAX_ESTIMATE
        );
        estimator.record(&seen("c", None, Some(u64::MAX), Duration::MAX));
        estimator.record(&seen("c", None, Some(1), Duration::MAX));
        assert!(estimator.service_time("c", None, Some(u64::MAX), 0) <= MAX_ESTIMATE);
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
