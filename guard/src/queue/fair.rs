//! Fair order between the flows of one class (`fair_by`): start-time fair queueing. A waiting
//! request's tag is where its flow's previous request ends in the class's virtual time (or
//! that time itself, for a flow with nothing queued), and each request moves its flow on by
//! its estimated service. The class's line is kept in tag order, so flows take turns weighted
//! by the work they ask for: one client with a hundred jobs cannot starve another with one.
//! Without `fair_by` every request is of one flow, and the line is first come, first served.

use std::{collections::HashMap, time::Duration};

/// Flows a class tells apart; requests of any further flow share one.
pub const MAX_FLOWS: usize = 1024;

/// The flow of requests not told apart (no `fair_by`, no key, or too many flows).
pub const SHARED: u64 = 0;

#[derive(Debug, Default)]
struct Flow {
    /// Where its last queued request ends, in virtual time.
    finish: u128,
    waiting: usize,
}

/// One class's flows and virtual time.
#[derive(Debug, Default)]
pub struct Flows {
    /// The start tag of the request dispatched last.
    now: u128,
    flows: HashMap<u64, Flow>,
}

impl Flows {
    /// The flow a request of `key` joins: its own, or the shared one when the class already
    /// tells `MAX_FLOWS` apart.
    pub fn flow_of(&self, key: u64) -> u64 {
        if self.flows.contains_key(&key) || self.flows.len() < MAX_FLOWS {
            key
        } else {
            SHARED
        }
    }

    /// Requests of `flow` waiting now.
    pub fn waiting(&self, flow: u64) -> usize {
        self.flows.get(&flow).map_or(0, |f| f.waiting)
    }

    /// The tag a request of `flow` would get now.
    pub fn peek(&self, flow: u64) -> u128 {
        self.flows.get(&flow).map_or(0, |f| f.finish).max(self.now)
    }

    /// Queues a request of `flow` that costs `cost`; returns its tag (its place in line).
    pub fn join(&mut self, flow: u64, cost: Duration) -> u128 {
        let now = self.now;
        let state = self.flows.entry(flow).or_default();
        let start = state.finish.max(now);
        state.finish = start + cost.as_nanos().max(1);
        state.waiting += 1;
        start
    }

    /// The work waiting ahead of a request of `tag`: each flow's queued work up to that tag
    /// (a flow's requests hold contiguous tags from the present). Costs one step per flow, at
    /// most `MAX_FLOWS`, however many wait.
    pub fn work_before(&self, tag: u128) -> Duration {
        let nanos: u128 = self
            .flows
            .values()
            .filter(|f| f.waiting > 0)
            .map(|f| f.finish.min(tag).saturating_sub(self.now))
            .sum();
        Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX))
    }

    /// A paused request goes back first: its tag is the present.
    pub fn rejoin(&mut self, flow: u64) -> u128 {
        self.flows.entry(flow).or_default().waiting += 1;
        self.now
    }

    /// A request of `flow` left the line: dispatched (virtual time moves on to its tag) or not.
    pub fn leave(&mut self, flow: u64, tag: u128, dispatched: bool) {
        if dispatched {
            self.now = self.now.max(tag);
        }
        let now = self.now;
        if let Some(state) = self.flows.get_mut(&flow) {
            state.waiting = state.waiting.saturating_sub(1);
            // A flow with nothing waiting and no lead over the present is a fresh one again.
            if state.waiting == 0 && state.finish <= now {
                self.flows.remove(&flow);
            }
        }
        if self.flows.len() >= MAX_FLOWS {
            self.flows.retain(|_, f| f.waiting > 0 || f.finish > now);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_small_flow_takes_turns_with_a_large_one() {
        let mut flows = Flows::default();
        let cost = Duration::from_secs(1);
        let mut line: Vec<(u128, char)> = (0..50).map(|_| (flows.join(1, cost), 'a')).collect();
        // The first `a` runs; then five `b` arrive.
        let (tag, _) = line.remove(0);
        flows.leave(1, tag, true);
        for _ in 0..5 {
            let tag = flows.join(2, cost);
            let at = line.partition_point(|(t, _)| *t <= tag);
            line.insert(at, (tag, 'b'));
        }
        let order: String = line.iter().take(10).map(|(_, f)| *f).collect();
        assert_eq!(order, "babababab".to_owned() + "a");
        assert_eq!(flows.waiting(2), 5);
    }

    #[test]
    fn flows_are_bounded_and_one_flow_is_first_come_first_served() {
        let mut flows = Flows::default();
        let tags: Vec<u128> = (0..3)
            .map(|_| flows.join(SHARED, Duration::from_millis(5)))
            .collect();
        assert!(tags.windows(2).all(|w| w[0] < w[1]));
        for key in 1..=MAX_FLOWS as u64 {
            let flow = flows.flow_of(key);
            flows.join(flow, Duration::from_millis(1));
        }
        assert_eq!(
            flows.flow_of(u64::MAX),
            SHARED,
            "past the bound: the shared flow"
        );
    }
}
