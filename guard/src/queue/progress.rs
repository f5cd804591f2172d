//! How far a running request has got: the tokens its relay has passed on, and when. The
//! scheduler reads it to predict when the request ends.

use std::{
    sync::atomic::{AtomicU64, Ordering},
    time::Duration,
};

use tokio::time::Instant;

/// Written by one relay, read by the scheduler; plain atomics, no lock.
#[derive(Debug)]
pub struct Progress {
    since: Instant,
    /// Cancelled when the scheduler asks this request to stop for a more urgent one.
    preempt: tokio_util::sync::CancellationToken,
    tokens: AtomicU64,
    /// Nanoseconds after `since` of the first and the latest token.
    first_ns: AtomicU64,
    last_ns: AtomicU64,
}

impl Progress {
    pub fn new(since: Instant) -> Self {
        Self {
            since,
            preempt: tokio_util::sync::CancellationToken::new(),
            tokens: AtomicU64::new(0),
            first_ns: AtomicU64::new(0),
            last_ns: AtomicU64::new(0),
        }
    }

    /// `count` more tokens went to the client now.
    pub fn advance(&self, count: u64) {
        if count == 0 {
            return;
        }
        let at = u64::try_from(self.since.elapsed().as_nanos()).unwrap_or(u64::MAX);
        if self.tokens.fetch_add(count, Ordering::Relaxed) == 0 {
            self.first_ns.store(at, Ordering::Relaxed);
        }
        self.last_ns.store(at, Ordering::Relaxed);
    }

    /// Tokens passed on so far.
    pub fn tokens(&self) -> u64 {
        self.tokens.load(Ordering::Relaxed)
    }

    /// Asks the request to stop (it continues later, on a permit of its own).
    pub fn preempt(&self) {
        self.preempt.cancel();
    }

    /// Resolves once the scheduler has asked this request to stop.
    pub async fn preempted(&self) {
        self.preempt.cancelled().await;
    }

    /// Tokens so far and the time each took since the first, once there are enough to tell.
    pub fn pace(&self) -> Option<(u64, Duration)> {
        let tokens = self.tokens.load(Ordering::Relaxed);
        let first = self.first_ns.load(Ordering::Relaxed);
        let last = self.last_ns.load(Ordering::Relaxed);
        // Four tokens: the first ones of a stream often come in one burst.
        if tokens < 4 || last <= first {
            return None;
        }
        let per_token = Duration::from_nanos((last - first) / (tokens - 1));
        Some((tokens, per_token))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn pace_is_the_time_between_tokens() {
        let progress = Progress::new(Instant::now());
        assert_eq!(progress.pace(), None);
        tokio::time::advance(Duration::from_millis(100)).await;
        progress.advance(1);
        for _ in 0..4 {
            tokio::time::advance(Duration::from_millis(10)).await;
            progress.advance(1);
        }
        assert_eq!(progress.pace(), Some((5, Duration::from_millis(10))));
    }
}
