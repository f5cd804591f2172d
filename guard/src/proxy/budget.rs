//! The bytes of request bodies guard holds, being read or waiting in a queue, over all
//! connections: capped by `server.max_body_bytes_in_flight`, so that many clients sending large
//! bodies slowly cannot take the host's memory. A request holds its share (`Held`) until its
//! body has gone to the upstream or the request ends.

use std::sync::{
    Arc,
    atomic::{AtomicU64, Ordering},
};

use prometheus::IntGauge;

pub struct BodyBudget {
    used: AtomicU64,
    cap: AtomicU64,
    gauge: IntGauge,
}

/// Bytes held against the budget; returned on drop.
#[derive(Debug)]
pub struct Held {
    budget: Arc<BodyBudget>,
    bytes: u64,
}

impl std::fmt::Debug for BodyBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BodyBudget")
            .field("used", &self.used.load(Ordering::Relaxed))
            .field("cap", &self.cap.load(Ordering::Relaxed))
            .finish()
    }
}

impl BodyBudget {
    pub fn new(cap: u64, gauge: IntGauge) -> Arc<Self> {
        Arc::new(Self {
            used: AtomicU64::new(0),
            cap: AtomicU64::new(cap),
            gauge,
        })
    }

    /// A reload's new cap; what is held stays held.
    pub fn set_cap(&self, cap: u64) {
        self.cap.store(cap, Ordering::Relaxed);
    }

    /// Holds `bytes` if they fit under the cap.
    pub fn reserve(self: &Arc<Self>, bytes: u64) -> Option<Held> {
        self.take(bytes).then(|| Held {
            budget: Arc::clone(self),
            bytes,
        })
    }

    fn take(&self, bytes: u64) -> bool {
        let cap = self.cap.load(Ordering::Relaxed);
        let taken = self
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(bytes).filter(|total| *total <= cap)
            });
        if let Ok(before) = taken {
            self.gauge.set((before + bytes) as i64);
        }
        taken.is_ok()
    }

    fn give_back(&self, bytes: u64) {
        let before = self.used.fetch_sub(bytes, Ordering::AcqRel);
        self.gauge.set(before.saturating_sub(bytes) as i64);
    }
}

impl Held {
    /// Holds `more` bytes too, if they fit.
    pub fn grow(&mut self, more: u64) -> bool {
        let fits = self.budget.take(more);
        if fits {
            self.bytes += more;
        }
        fits
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.budget.give_back(self.bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(cap: u64) -> Arc<BodyBudget> {
        BodyBudget::new(cap, IntGauge::new("g", "g").expect("gauge"))
    }

    #[test]
    fn bytes_are_held_up_to_the_cap_and_returned_on_drop() {
        let budget = budget(100);
        let mut first = budget.reserve(60).expect("fits");
        assert!(budget.reserve(41).is_none(), "over the cap");
        assert!(first.grow(40), "exactly the cap");
        assert!(!first.grow(1));
        drop(first);
        assert!(budget.reserve(100).is_some(), "all returned");
        assert!(budget.reserve(u64::MAX).is_none(), "no overflow");
    }
}
