//! Recent time-to-first-token samples per class: the risk detector's window, fed by the proxy
//! as first bytes go out.

use std::{
    collections::{HashMap, VecDeque},
    sync::Mutex,
    time::{Duration, Instant},
};

/// At most this many samples a class: the detector needs a p95, not every sample of a busy
/// minute.
const MAX_SAMPLES: usize = 1_000;

#[derive(Default)]
pub struct TtftWindow(Mutex<HashMap<String, VecDeque<(Instant, Duration)>>>);

impl TtftWindow {
    pub fn record(&self, class: &str, ttft: Duration) {
        let mut classes = self.lock();
        let samples = classes.entry(class.to_owned()).or_default();
        samples.push_back((Instant::now(), ttft));
        if samples.len() > MAX_SAMPLES {
            samples.pop_front();
        }
    }

    /// The p95 and sample count of `class`'s TTFTs within `window`.
    pub fn p95(&self, class: &str, window: Duration) -> Option<(Duration, usize)> {
        let mut classes = self.lock();
        let samples = classes.get_mut(class)?;
        while samples.front().is_some_and(|(at, _)| at.elapsed() > window) {
            samples.pop_front();
        }
        let recent: Vec<Duration> = samples.iter().map(|(_, t)| *t).collect();
        let p95 = crate::quantile::quantile(&recent, 0.95)?;
        Some((p95, recent.len()))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, VecDeque<(Instant, Duration)>>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn p95_of_recent_samples() {
        let window = TtftWindow::default();
        assert_eq!(window.p95("c", Duration::from_secs(60)), None);
        for ms in 1..=100 {
            window.record("c", Duration::from_millis(ms));
        }
        assert_eq!(
            window.p95("c", Duration::from_secs(60)),
            Some((Duration::from_millis(95), 100))
        );
    }
}
