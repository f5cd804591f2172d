//! The queue: a bounded FIFO per class, `upstream.max_concurrency` permits, dispatch strictly
//! by class priority, and admission that predicts from the estimator whether a request with a
//! deadline can start in time.
//!
//! One mutex guards the whole state; every critical section is short and never awaits.

pub mod estimator;

use std::{
    collections::{BTreeMap, HashMap, VecDeque},
    sync::{Arc, Mutex, MutexGuard},
    time::Duration,
};

use tokio::{sync::oneshot, time::Instant};

use crate::{config::Config, metrics::Metrics};
use estimator::{Estimator, predict_start};

/// Why a request is turned away with 503.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RejectReason {
    QueueFull,
    Deadline,
    ShuttingDown,
}

impl RejectReason {
    /// The label in metrics and the word in error messages.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::QueueFull => "queue_full",
            Self::Deadline => "deadline",
            Self::ShuttingDown => "shutting_down",
        }
    }
}

/// A 503 with guard's estimate of when to try again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rejection {
    pub reason: RejectReason,
    pub retry_after: Duration,
    /// Whether the request had been queued (true) or was turned away on arrival.
    pub after_queueing: bool,
}

/// A class's limits, from its config.
#[derive(Clone, Debug, PartialEq)]
struct Limits {
    priority: i32,
    max_queue: usize,
    deadline: Option<Duration>,
}

struct Waiter {
    id: u64,
    arrived: Instant,
    service: Duration,
    grant: oneshot::Sender<Result<(), RejectReason>>,
}

struct ClassState {
    limits: Limits,
    queue: VecDeque<Waiter>,
    running: usize,
    /// Removed from the config by a reload: takes no new requests, drains what it has.
    retired: bool,
}

struct Running {
    started: Instant,
    expected: Duration,
}

struct State {
    classes: BTreeMap<Arc<str>, ClassState>,
    capacity: usize,
    running: HashMap<u64, Running>,
    next_id: u64,
    estimator: Estimator,
    /// While set, classes with a priority value above it are not dispatched (at risk).
    hold_above: Option<i32>,
    shutting_down: bool,
}

/// The scheduler shared by every request.
pub struct Scheduler {
    state: Mutex<State>,
    metrics: Metrics,
}

/// A class as /status shows it.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ClassSnapshot {
    pub name: String,
    pub priority: i32,
    pub max_queue: usize,
    pub deadline_ms: Option<u64>,
    pub queued: usize,
    pub running: usize,
    pub held: bool,
    pub retired: bool,
    /// When a request arriving now would start, by guard's estimate.
    pub predicted_wait_ms: u64,
}

impl Scheduler {
    pub fn new(config: &Config, metrics: Metrics) -> Arc<Self> {
        let state = State {
            classes: BTreeMap::new(),
            capacity: 1,
            running: HashMap::new(),
            next_id: 0,
            estimator: Estimator::new(Duration::from_millis(config.estimate.initial_service_ms)),
            hold_above: None,
            shutting_down: false,
        };
        let scheduler = Arc::new(Self {
            state: Mutex::new(state),
            metrics,
        });
        scheduler.reconfigure(config);
        scheduler
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Applies a (re)loaded config: limits change in place, queued requests stay queued.
    pub fn reconfigure(&self, config: &Config) {
        let mut state = self.lock();
        state.capacity = config.upstream.max_concurrency as usize;
        state
            .estimator
            .set_prior(Duration::from_millis(config.estimate.initial_service_ms));
        for class in state.classes.values_mut() {
            class.retired = true;
        }
        for (name, class) in &config.class {
            let limits = Limits {
                priority: class.priority,
                max_queue: class.max_queue,
                deadline: class.deadline_ms.map(Duration::from_millis),
            };
            match limits.deadline {
                Some(deadline) => self
                    .metrics
                    .class_deadline_seconds
                    .with_label_values(&[name])
                    .set(deadline.as_secs_f64()),
                None => {
                    let _ = self
                        .metrics
                        .class_deadline_seconds
                        .remove_label_values(&[name]);
                }
            }
            match state.classes.get_mut(name.as_str()) {
                Some(existing) => {
                    existing.limits = limits;
                    existing.retired = false;
                }
                None => {
                    self.metrics.init_class(name);
                    let fresh = ClassState {
                        limits,
                        queue: VecDeque::new(),
                        running: 0,
                        retired: false,
                    };
                    state.classes.insert(Arc::from(name.as_str()), fresh);
                }
            }
        }
        state
            .classes
            .retain(|_, class| !class.retired || !class.queue.is_empty() || class.running > 0);
        self.dispatch(&mut state);
    }

    /// Admits a request of `class` into its queue, or says why not. The returned ticket
    /// resolves to a permit when it is this request's turn.
    pub fn enqueue(
        self: &Arc<Self>,
        class: &str,
        model: Option<&str>,
    ) -> Result<Ticket, Rejection> {
        let now = Instant::now();
        let mut state = self.lock();
        let reject = |reason, retry_after| Rejection {
            reason,
            retry_after,
            after_queueing: false,
        };
        if state.shutting_down {
            return Err(reject(RejectReason::ShuttingDown, Duration::from_secs(1)));
        }
        let Some((name, class_state)) = state.classes.get_key_value(class) else {
            // The classifier only names configured classes; a reload may have raced it.
            return Err(reject(RejectReason::ShuttingDown, Duration::from_secs(1)));
        };
        let name = Arc::clone(name);
        let limits = class_state.limits.clone();
        if class_state.retired {
            return Err(reject(RejectReason::ShuttingDown, Duration::from_secs(1)));
        }
        if class_state.queue.len() >= limits.max_queue {
            let head_starts = state.predict_start(now, &name, 0);
            return Err(reject(RejectReason::QueueFull, head_starts));
        }
        let position = class_state.queue.len();
        let starts = state.predict_start(now, &name, position);
        if let Some(deadline) = limits.deadline
            && starts > deadline
        {
            return Err(reject(RejectReason::Deadline, starts - deadline));
        }

        let service = state.estimator.service_time(&name, model);
        let id = state.next_id;
        state.next_id += 1;
        let (grant, granted) = oneshot::channel();
        if let Some(class_state) = state.classes.get_mut(&name) {
            class_state.queue.push_back(Waiter {
                id,
                arrived: now,
                service,
                grant,
            });
        }
        self.dispatch(&mut state);
        self.publish(&state, &name);
        Ok(Ticket {
            scheduler: Arc::clone(self),
            id,
            class: name,
            model: model.map(str::to_owned),
            arrived: now,
            deadline: limits.deadline.map(|d| now + d),
            granted: Some(granted),
        })
    }

    /// Starts as many waiting requests as there are free permits, highest priority first.
    fn dispatch(&self, state: &mut State) {
        while state.running.len() < state.capacity {
            let hold_above = state.hold_above;
            let next = state
                .classes
                .iter()
                .filter(|(_, class)| !class.queue.is_empty())
                .filter(|(_, class)| hold_above.is_none_or(|level| class.limits.priority <= level))
                .min_by_key(|(_, class)| {
                    (
                        class.limits.priority,
                        class.queue.front().map(|w| w.arrived),
                    )
                })
                .map(|(name, _)| Arc::clone(name));
            let Some(name) = next else { break };
            let Some(class) = state.classes.get_mut(&name) else {
                break;
            };
            let Some(waiter) = class.queue.pop_front() else {
                break;
            };
            if waiter.grant.send(Ok(())).is_ok() {
                class.running += 1;
                state.running.insert(
                    waiter.id,
                    Running {
                        started: Instant::now(),
                        expected: waiter.service,
                    },
                );
                self.metrics
                    .queue_wait_seconds
                    .with_label_values(&[&name])
                    .observe(waiter.arrived.elapsed().as_secs_f64());
            }
            self.publish(state, &name);
        }
    }

    /// Frees a permit and starts the next request.
    fn release(&self, id: u64, class: &str, completed: Option<(Option<&str>, Duration)>) {
        let mut state = self.lock();
        if state.running.remove(&id).is_none() {
            return;
        }
        if let Some(class_state) = state.classes.get_mut(class) {
            class_state.running = class_state.running.saturating_sub(1);
        }
        if let Some((model, took)) = completed {
            state.estimator.record(class, model, took);
        }
        self.publish(&state, class);
        self.dispatch(&mut state);
        state
            .classes
            .retain(|_, class| !class.retired || !class.queue.is_empty() || class.running > 0);
    }

    /// Takes a waiting request out of its queue; false if it was not there (already granted).
    fn remove(&self, id: u64, class: &str) -> bool {
        let mut state = self.lock();
        let Some(class_state) = state.classes.get_mut(class) else {
            return false;
        };
        let before = class_state.queue.len();
        class_state.queue.retain(|waiter| waiter.id != id);
        let removed = class_state.queue.len() < before;
        if removed {
            self.publish(&state, class);
        }
        removed
    }

    /// Turns every waiting request away (shutting_down) and refuses new ones.
    pub fn shut_down(&self) {
        let mut state = self.lock();
        state.shutting_down = true;
        let names: Vec<Arc<str>> = state.classes.keys().cloned().collect();
        for name in names {
            if let Some(class) = state.classes.get_mut(&name) {
                for waiter in class.queue.drain(..) {
                    let _ = waiter.grant.send(Err(RejectReason::ShuttingDown));
                }
            }
            self.publish(&state, &name);
        }
    }

    /// Holds back dispatch of classes whose priority value is above `level` (None lifts it).
    pub fn hold_above(&self, level: Option<i32>) {
        let mut state = self.lock();
        state.hold_above = level;
        self.dispatch(&mut state);
    }

    /// Requests waiting and running, over all classes.
    pub fn load(&self) -> (usize, usize) {
        let state = self.lock();
        let queued = state.classes.values().map(|c| c.queue.len()).sum();
        (queued, state.running.len())
    }

    /// How long the oldest waiting request of each class with a deadline has waited, as a
    /// share of that deadline (the risk detector reads it).
    pub fn wait_fractions(&self) -> Vec<(String, f64)> {
        let state = self.lock();
        state
            .classes
            .iter()
            .filter_map(|(name, class)| {
                let deadline = class.limits.deadline?;
                let oldest = class.queue.front()?;
                let fraction = oldest.arrived.elapsed().as_secs_f64() / deadline.as_secs_f64();
                Some((name.to_string(), fraction))
            })
            .collect()
    }

    pub fn snapshot(&self) -> Vec<ClassSnapshot> {
        let state = self.lock();
        let now = Instant::now();
        state
            .classes
            .iter()
            .map(|(name, class)| ClassSnapshot {
                name: name.to_string(),
                priority: class.limits.priority,
                max_queue: class.limits.max_queue,
                deadline_ms: class.limits.deadline.map(|d| d.as_millis() as u64),
                queued: class.queue.len(),
                running: class.running,
                held: state
                    .hold_above
                    .is_some_and(|level| class.limits.priority > level),
                retired: class.retired,
                predicted_wait_ms: state
                    .predict_start(now, name, class.queue.len())
                    .as_millis() as u64,
            })
            .collect()
    }

    fn publish(&self, state: &State, class: &str) {
        if let Some(class_state) = state.classes.get(class) {
            self.metrics
                .queue_depth
                .with_label_values(&[class])
                .set(class_state.queue.len() as i64);
            self.metrics
                .inflight
                .with_label_values(&[class])
                .set(class_state.running as i64);
        }
    }
}

impl State {
    /// When a request at `position` in `class`'s queue would start: after what runs now and
    /// everything dispatched before it (higher priorities, and its class's requests ahead).
    fn predict_start(&self, now: Instant, class: &str, position: usize) -> Duration {
        let Some(own) = self.classes.get(class) else {
            return Duration::ZERO;
        };
        let remaining = self.running.values().map(|running| {
            running
                .expected
                .saturating_sub(now.saturating_duration_since(running.started))
        });
        let higher = self
            .classes
            .iter()
            .filter(|(name, c)| c.limits.priority < own.limits.priority && name.as_ref() != class)
            .flat_map(|(_, c)| c.queue.iter().map(|w| w.service));
        let own_ahead = own.queue.iter().take(position).map(|w| w.service);
        predict_start(self.capacity, remaining, higher.chain(own_ahead))
    }
}

/// A queued request's place in line. Dropping it (the client left) takes it out of the queue,
/// or hands back a permit that arrived meanwhile.
pub struct Ticket {
    scheduler: Arc<Scheduler>,
    id: u64,
    class: Arc<str>,
    model: Option<String>,
    arrived: Instant,
    deadline: Option<Instant>,
    granted: Option<oneshot::Receiver<Result<(), RejectReason>>>,
}

impl Ticket {
    /// Waits for this request's turn; past its deadline it leaves the queue with a rejection.
    pub async fn wait(mut self) -> Result<Permit, Rejection> {
        let Some(granted) = self.granted.as_mut() else {
            return Err(self.rejection(RejectReason::ShuttingDown));
        };
        let outcome = match self.deadline {
            Some(deadline) => tokio::select! {
                outcome = granted => Some(outcome),
                () = tokio::time::sleep_until(deadline) => None,
            },
            None => Some(granted.await),
        };
        let outcome = match outcome {
            Some(outcome) => outcome,
            None if self.scheduler.remove(self.id, &self.class) => {
                self.granted = None;
                return Err(self.rejection(RejectReason::Deadline));
            }
            // The permit was sent as the deadline passed: take it.
            None => match self.granted.as_mut().map(oneshot::Receiver::try_recv) {
                Some(Ok(outcome)) => Ok(outcome),
                _ => Ok(Err(RejectReason::Deadline)),
            },
        };
        self.granted = None;
        match outcome {
            Ok(Ok(())) => Ok(Permit {
                scheduler: Arc::clone(&self.scheduler),
                id: self.id,
                class: Arc::clone(&self.class),
                model: self.model.take(),
                waited: self.arrived.elapsed(),
                dispatched: Instant::now(),
                released: false,
            }),
            Ok(Err(reason)) => Err(self.rejection(reason)),
            Err(_) => Err(self.rejection(RejectReason::ShuttingDown)),
        }
    }

    fn rejection(&self, reason: RejectReason) -> Rejection {
        let retry_after = {
            let state = self.scheduler.lock();
            state.predict_start(Instant::now(), &self.class, 0)
        };
        Rejection {
            reason,
            retry_after,
            after_queueing: true,
        }
    }
}

impl std::fmt::Debug for Ticket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ticket")
            .field("id", &self.id)
            .field("class", &self.class)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for Permit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Permit")
            .field("id", &self.id)
            .field("class", &self.class)
            .finish_non_exhaustive()
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let Some(mut granted) = self.granted.take() else {
            return;
        };
        if self.scheduler.remove(self.id, &self.class) {
            return;
        }
        // Not queued any more: a permit may be waiting in the channel; give it back.
        if let Ok(Ok(())) = granted.try_recv() {
            self.scheduler.release(self.id, &self.class, None);
        }
    }
}

/// The right to have one request at the upstream. Dropping it frees the slot.
pub struct Permit {
    scheduler: Arc<Scheduler>,
    id: u64,
    class: Arc<str>,
    model: Option<String>,
    waited: Duration,
    dispatched: Instant,
    released: bool,
}

impl Permit {
    /// Time from arrival to dispatch.
    pub fn waited(&self) -> Duration {
        self.waited
    }

    /// Frees the slot and teaches the estimator how long this request took.
    pub fn complete(mut self) {
        self.released = true;
        let took = self.dispatched.elapsed();
        self.scheduler
            .release(self.id, &self.class, Some((self.model.as_deref(), took)));
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        if !self.released {
            self.scheduler.release(self.id, &self.class, None);
        }
    }
}

#[cfg(test)]
mod tests;
