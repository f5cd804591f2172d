//! One class's waiting line, in dispatch order, with what admission reads of it kept as it
//! changes: every operation costs O(log n) or less however long the line is (no scan on
//! arrival, dispatch or departure), and each waiter costs a few hundred bytes.

use std::{
    collections::{BTreeMap, HashMap},
    time::Duration,
};

use super::Waiter;

/// A waiter's place: its fair tag, then the order it joined in. Requests put back first
/// (preempted ones) take orders below zero, each below the last, so they go before every
/// request of their tag.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Place {
    tag: u128,
    order: i64,
}

#[derive(Default)]
pub struct Line {
    waiters: BTreeMap<Place, Waiter>,
    /// Where each waiter is, by id (a ticket that leaves knows only its id).
    places: HashMap<u64, Place>,
    next_order: i64,
    next_front: i64,
    /// The estimated service of everyone waiting.
    service: Duration,
    /// Of the waiting: preempted requests that wait to go on.
    paused: usize,
}

impl Line {
    pub fn len(&self) -> usize {
        self.waiters.len()
    }

    pub fn is_empty(&self) -> bool {
        self.waiters.is_empty()
    }

    /// The estimated service of everyone waiting.
    pub fn service(&self) -> Duration {
        self.service
    }

    pub fn paused(&self) -> usize {
        self.paused
    }

    pub fn front(&self) -> Option<&Waiter> {
        self.waiters.first_key_value().map(|(_, waiter)| waiter)
    }

    /// In dispatch order.
    pub fn iter(&self) -> impl Iterator<Item = &Waiter> {
        self.waiters.values()
    }

    /// Those a request of `tag` joining now would wait behind, in order.
    pub fn ahead_of(&self, tag: u128) -> impl Iterator<Item = &Waiter> {
        let end = Place {
            tag,
            order: self.next_order,
        };
        self.waiters.range(..end).map(|(_, waiter)| waiter)
    }

    /// Joins after everyone of its tag or a lower one.
    pub fn push(&mut self, waiter: Waiter) {
        let place = Place {
            tag: waiter.tag,
            order: self.next_order,
        };
        self.next_order += 1;
        self.insert(place, waiter);
    }

    /// Goes first (a preempted request going on).
    pub fn push_front(&mut self, waiter: Waiter) {
        self.next_front -= 1;
        let place = Place {
            tag: waiter.tag,
            order: self.next_front,
        };
        self.insert(place, waiter);
    }

    fn insert(&mut self, place: Place, waiter: Waiter) {
        self.service = self.service.saturating_add(waiter.service);
        self.paused += usize::from(waiter.paused.is_some());
        self.places.insert(waiter.id, place);
        self.waiters.insert(place, waiter);
    }

    pub fn pop_front(&mut self) -> Option<Waiter> {
        let (_, waiter) = self.waiters.pop_first()?;
        Some(self.forget(waiter))
    }

    /// Takes the waiter `id` out of the line, wherever it is.
    pub fn remove(&mut self, id: u64) -> Option<Waiter> {
        let place = self.places.get(&id)?;
        let waiter = self.waiters.remove(place)?;
        Some(self.forget(waiter))
    }

    /// Empties the line, in order.
    pub fn drain(&mut self) -> impl Iterator<Item = Waiter> {
        let waiters = std::mem::take(&mut self.waiters);
        *self = Self {
            next_order: self.next_order,
            next_front: self.next_front,
            ..Self::default()
        };
        waiters.into_values()
    }

    fn forget(&mut self, waiter: Waiter) -> Waiter {
        self.places.remove(&waiter.id);
        self.service = self.service.saturating_sub(waiter.service);
        self.paused -= usize::from(waiter.paused.is_some());
        if self.waiters.is_empty() {
            // The sums start afresh, so that rounding never drifts.
            self.service = Duration::ZERO;
            self.places.shrink_to(64);
        }
        waiter
    }
}

#[cfg(test)]
mod tests {
    use tokio::{sync::oneshot, time::Instant};

    use super::*;

    fn waiter(id: u64, tag: u128, paused: bool) -> Waiter {
        Waiter {
            id,
            arrived: Instant::now(),
            service: Duration::from_millis(id + 1),
            tokens: None,
            preemptible: false,
            paused: paused.then(Instant::now),
            flow: 0,
            tag,
            grant: oneshot::channel().0,
        }
    }

    #[test]
    fn the_line_keeps_tag_order_first_come_first_served_and_puts_paused_first() {
        let mut line = Line::default();
        for (id, tag) in [(0, 5), (1, 3), (2, 5), (3, 9)] {
            line.push(waiter(id, tag, false));
        }
        line.push_front(waiter(4, 3, true));
        line.push_front(waiter(5, 3, true));
        let ids: Vec<u64> = line.iter().map(|w| w.id).collect();
        assert_eq!(ids, [5, 4, 1, 0, 2, 3]);
        let ahead: Vec<u64> = line.ahead_of(5).map(|w| w.id).collect();
        assert_eq!(ahead, [5, 4, 1, 0, 2]);
        assert_eq!(line.paused(), 2);
        assert_eq!(line.service(), Duration::from_millis(1 + 2 + 3 + 4 + 5 + 6));
        assert_eq!(line.remove(0).map(|w| w.id), Some(0));
        assert!(line.remove(0).is_none(), "gone once");
        assert_eq!(line.pop_front().map(|w| w.id), Some(5));
        assert_eq!((line.len(), line.paused()), (4, 1));
        assert_eq!(line.service(), Duration::from_millis(2 + 3 + 4 + 5));
        let drained: Vec<u64> = line.drain().map(|w| w.id).collect();
        assert_eq!(drained, [4, 1, 2, 3]);
        assert!(line.is_empty() && line.service().is_zero() && line.paused() == 0);
    }
}
