//! What guard tells the engines above it about this box: HAProxy's agent check (`agent`) and
//! the model-server metrics the llm-d router scrapes (`model_server`). guard never schedules
//! across boxes; it says how full this one is, and the balancers route.

pub mod agent;
pub mod model_server;

use serde::{Deserialize, Serialize};

use crate::queue::ClassSnapshot;

/// What the view is made of, read from each owner at the moment it is asked.
#[derive(Debug)]
pub struct Inputs<'a> {
    pub classes: &'a [ClassSnapshot],
    /// `upstream.max_concurrency`.
    pub capacity: u32,
    /// The classes the balancer's frontend serves (`cluster.agent_classes`); None: all.
    pub served: Option<&'a [String]>,
    /// The risk detector sees a protected class at risk.
    pub at_risk: bool,
    /// Classes with a priority value at or below this are protected (`risk.protect_priority`).
    pub protect_priority: i32,
    pub shutting_down: bool,
    /// The watcher's last word on the upstream; None before its first.
    pub upstream_up: Option<bool>,
    /// Requests waiting in the upstream's own queue (llama-server's `requests_deferred`).
    pub upstream_waiting: Option<f64>,
    /// The upstream's own KV-cache usage, 0..1, where it reports it.
    pub upstream_kv_usage: Option<f64>,
}

/// What the balancers are told, as `/status` shows it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ClusterView {
    /// The line HAProxy's agent check reads.
    pub agent: String,
    /// `vllm:num_requests_waiting`: guard's waiting requests and the upstream's own.
    pub waiting: u64,
    /// `vllm:num_requests_running`.
    pub running: u64,
    /// `vllm:kv_cache_usage_perc` (0..1): the upstream's, else guard's saturation.
    pub usage: f64,
}

impl Inputs<'_> {
    fn served(&self) -> impl Iterator<Item = &ClassSnapshot> {
        self.classes
            .iter()
            .filter(|c| !c.retired)
            .filter(|c| self.served.is_none_or(|names| names.contains(&c.name)))
    }

    /// HAProxy's agent protocol: `maint` while guard stops, `down #reason` while the upstream
    /// cannot be reached, `drain` while a protected class is at risk or a served protected
    /// class's queue is full, else `up ready weight:N%` with N the least free room of a served
    /// class (free slots and queue places, as a share of its slots and places; at least 1). A
    /// full batch queue only lowers the weight: the box still has room for urgent work.
    pub fn agent_line(&self) -> String {
        if self.shutting_down {
            return "maint".to_owned();
        }
        if self.upstream_up == Some(false) {
            return "down #upstream unreachable".to_owned();
        }
        let full = self
            .served()
            .any(|c| c.priority <= self.protect_priority && c.queued >= c.max_queue);
        if self.at_risk || full {
            return "drain".to_owned();
        }
        // Each served class's free room (free slots and free places in its queue) as a share
        // of all its room; the weight is the least of them: HAProxy cannot tell the classes
        // apart, so a box with one class nearly full gets little of any.
        let capacity = u64::from(self.capacity);
        let running: u64 = self.classes.iter().map(|c| c.running as u64).sum();
        let free_slots = capacity.saturating_sub(running);
        let percent = self
            .served()
            .map(|c| {
                let places = c.max_queue as u64;
                let free = free_slots + places.saturating_sub(c.queued as u64);
                (free * 100).checked_div(capacity + places).unwrap_or(0)
            })
            .min()
            .unwrap_or(100)
            .clamp(1, 100);
        format!("up ready weight:{percent}%")
    }

    pub fn view(&self) -> ClusterView {
        let queued: u64 = self.classes.iter().map(|c| c.queued as u64).sum();
        let running: u64 = self.classes.iter().map(|c| c.running as u64).sum();
        let waiting = queued + self.upstream_waiting.unwrap_or(0.0).max(0.0) as u64;
        let saturation = (running + waiting) as f64 / f64::from(self.capacity.max(1));
        ClusterView {
            agent: self.agent_line(),
            waiting,
            running,
            usage: self.upstream_kv_usage.unwrap_or(saturation).clamp(0.0, 1.0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn class(name: &str, max_queue: usize, queued: usize, running: usize) -> ClassSnapshot {
        ClassSnapshot {
            name: name.to_owned(),
            priority: if name == "batch" { 10 } else { 0 },
            max_queue,
            deadline_ms: None,
            queued,
            running,
            paused: 0,
            held: false,
            retired: false,
            predicted_wait_ms: 0,
        }
    }

    fn inputs(classes: &[ClassSnapshot]) -> Inputs<'_> {
        Inputs {
            classes,
            capacity: 2,
            served: None,
            at_risk: false,
            protect_priority: 0,
            shutting_down: false,
            upstream_up: Some(true),
            upstream_waiting: None,
            upstream_kv_usage: None,
        }
    }

    #[test]
    fn the_agent_says_how_much_room_is_left_and_when_to_stay_away() {
        let idle = [class("interactive", 8, 0, 0), class("batch", 10, 0, 0)];
        assert_eq!(inputs(&idle).agent_line(), "up ready weight:100%");
        // Two slots busy; interactive 6 of 10 free, batch 7 of 12: the least.
        let busy = [class("interactive", 8, 2, 1), class("batch", 10, 3, 1)];
        assert_eq!(inputs(&busy).agent_line(), "up ready weight:58%");
        let full = [class("interactive", 8, 8, 1), class("batch", 10, 0, 1)];
        assert_eq!(inputs(&full).agent_line(), "drain");
        // A full class the frontend does not serve does not drain the box.
        let served = ["batch".to_owned()];
        let only_batch = Inputs {
            served: Some(&served),
            ..inputs(&full)
        };
        assert_eq!(only_batch.agent_line(), "up ready weight:83%");
        assert_eq!(
            Inputs {
                at_risk: true,
                ..inputs(&idle)
            }
            .agent_line(),
            "drain"
        );
        let down = Inputs {
            upstream_up: Some(false),
            ..inputs(&idle)
        };
        assert_eq!(down.agent_line(), "down #upstream unreachable");
        let stopping = Inputs {
            shutting_down: true,
            ..down
        };
        assert_eq!(stopping.agent_line(), "maint");
    }

    #[test]
    fn the_router_sees_waiting_running_and_a_usage() {
        let busy = [class("interactive", 8, 2, 1), class("batch", 10, 3, 1)];
        let view = Inputs {
            upstream_waiting: Some(1.0),
            ..inputs(&busy)
        }
        .view();
        assert_eq!((view.waiting, view.running, view.usage), (6, 2, 1.0));
        let light = [class("interactive", 8, 0, 1)];
        assert_eq!(inputs(&light).view().usage, 0.5);
        let reported = Inputs {
            upstream_kv_usage: Some(0.25),
            ..inputs(&light)
        };
        assert_eq!(reported.view().usage, 0.25);
    }
}
