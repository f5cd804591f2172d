//! The queue: a bounded FIFO per class, `upstream.max_concurrency` permits, dispatch strictly
//! by class priority, and admission that predicts from the estimator whether a request with a
//! deadline can start in time.
//!
//! One mutex guards the whole state; every critical section is short and never awaits.

pub mod estimator;
mod fair;
mod line;
mod progress;
mod ticket;

use std::{
    collections::{BTreeMap, HashMap},
    sync::{Arc, Mutex, MutexGuard},
    time::Duration,
};

use tokio::{sync::oneshot, time::Instant};

use crate::{config::Config, metrics::Metrics};
use estimator::{Estimator, predict_start};
pub use progress::Progress;
pub use ticket::{Permit, Ticket};

/// Why a request is turned away with 503.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RejectReason {
    QueueFull,
    /// On arrival: guard predicts it cannot start within its class's deadline.
    DeadlinePredicted,
    /// While waiting: its deadline passed.
    DeadlineExpired,
    ShuttingDown,
    /// Request bodies already fill `server.max_body_bytes_in_flight` (decided before queueing).
    BodyBytesFull,
}

impl RejectReason {
    pub const ALL: [Self; 5] = [
        Self::QueueFull,
        Self::DeadlinePredicted,
        Self::DeadlineExpired,
        Self::ShuttingDown,
        Self::BodyBytesFull,
    ];

    /// The label in metrics and the word in error messages.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::QueueFull => "queue_full",
            Self::DeadlinePredicted => "deadline_predicted",
            Self::DeadlineExpired => "deadline_expired",
            Self::ShuttingDown => "shutting_down",
            Self::BodyBytesFull => "body_bytes_full",
        }
    }
}

/// A 503 with guard's estimate of when to try again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rejection {
    pub reason: RejectReason,
    pub retry_after: Duration,
}

/// What the scheduler needs to know of a request to queue it.
#[derive(Clone, Debug, Default)]
pub struct Job {
    pub class: String,
    pub model: Option<String>,
    /// The output tokens it asks for (`max_tokens` and kin), where it says.
    pub tokens: Option<u64>,
    /// Its class may be preempted and this request can be continued later.
    pub preemptible: bool,
    /// Its flow within the class (`fair_by`): a key, or 0 for the shared flow.
    pub flow: u64,
    /// Its prompt's size in tokens, roughly.
    pub prompt_tokens: u64,
}

/// A class's limits, from its config.
#[derive(Clone, Debug, PartialEq)]
struct Limits {
    priority: i32,
    max_queue: usize,
    /// Requests one flow may have waiting (`max_queue_per_flow`).
    max_per_flow: usize,
    deadline: Option<Duration>,
}

/// Up to this many jobs ahead, a start is predicted slot by slot.
const EXACT_UP_TO: usize = 32;

/// Which of its own class's waiters a predicted request waits behind.
#[derive(Clone, Copy, Debug)]
enum Ahead {
    /// None: it would be first.
    Head,
    /// Those a request of this fair tag joining now would follow.
    Tag(u128),
    /// All of them: it would be last.
    End,
}

/// What a waiter is told when its turn comes: the progress its relay will report.
type Grant = Result<Arc<Progress>, RejectReason>;

struct Waiter {
    id: u64,
    arrived: Instant,
    service: Duration,
    tokens: Option<u64>,
    preemptible: bool,
    /// It ran, was preempted, and waits to go on (first in its class's line): since when.
    paused: Option<Instant>,
    /// Its flow, and its place in the class's fair order.
    flow: u64,
    tag: u128,
    grant: oneshot::Sender<Grant>,
}

struct ClassState {
    limits: Limits,
    /// In fair order (tags ascending): first come, first served within a flow.
    queue: line::Line,
    flows: fair::Flows,
    running: usize,
    /// Removed from the config by a reload: takes no new requests, drains what it has.
    retired: bool,
}

struct Running {
    started: Instant,
    expected: Duration,
    tokens: Option<u64>,
    progress: Arc<Progress>,
    priority: i32,
    preemptible: bool,
    /// Asked to stop for a more urgent request; its slot is on the way back.
    preempting: bool,
    /// It went on after its longest pause: not stopped again before this instant.
    protected_until: Option<Instant>,
}

impl Running {
    /// Time until it ends: from its own pace where it streams and said how many tokens it
    /// wants, else from the estimate it was dispatched with. One that has run past its
    /// estimate is not about to end: it counts as another estimate long.
    fn remaining(&self, now: Instant) -> Duration {
        if let Some(left) = self.paced_remaining() {
            return left;
        }
        let ran = now.saturating_duration_since(self.started);
        match self.expected.checked_sub(ran) {
            Some(left) if !left.is_zero() => left,
            _ => self.expected,
        }
    }

    /// Time until it ends, from its own pace, where it said how many tokens it wants.
    fn paced_remaining(&self) -> Option<Duration> {
        let (asked, (done, per_token)) = (self.tokens?, self.progress.pace()?);
        let left = asked.saturating_sub(done) as f64;
        Some(estimator::clamp_secs(per_token.as_secs_f64() * left))
    }

    /// When it may be stopped for a request of priority `urgent`: now (zero), after a while
    /// (in its bounded run after a longest pause, or known to end within `grace`), or never
    /// (not preemptible, or as urgent). Only positive evidence counts as "about to end": its
    /// pace, or an estimate it has not yet run past; one past its estimate is long, whatever
    /// the estimate said.
    fn stoppable(&self, urgent: i32, grace: Duration, now: Instant) -> Option<Duration> {
        if !self.preemptible || self.priority <= urgent {
            return None;
        }
        if let Some(until) = self.protected_until.filter(|until| *until > now) {
            return Some(until - now);
        }
        let ends_within = match self.paced_remaining() {
            Some(left) => (left <= grace).then_some(grace),
            None => self
                .expected
                .checked_sub(now.saturating_duration_since(self.started))
                .filter(|left| !left.is_zero() && *left <= grace),
        };
        Some(ends_within.unwrap_or(Duration::ZERO))
    }
}

struct State {
    classes: BTreeMap<Arc<str>, ClassState>,
    capacity: usize,
    running: HashMap<u64, Running>,
    next_id: u64,
    estimator: Estimator,
    /// While set, classes with a priority value above it are not dispatched (at risk).
    hold_above: Option<i32>,
    /// A preemptible request expected to end within this is left to finish.
    preempt_grace: Duration,
    /// A preempted request waits at most this long before it goes on, urgent work or not
    /// (`risk.max_throttle_ms`); once it has, it runs `min_run` before it may be stopped again.
    max_pause: Duration,
    min_run: Duration,
    /// When a timer will look again for a request to stop, where one is set.
    recheck: Option<Instant>,
    shutting_down: bool,
}

/// The scheduler shared by every request.
pub struct Scheduler {
    state: Mutex<State>,
    metrics: Metrics,
    /// Itself, for the timer that ends a bounded run.
    me: std::sync::Weak<Scheduler>,
}

/// A class as /status shows it.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct ClassSnapshot {
    pub name: String,
    pub priority: i32,
    pub max_queue: usize,
    pub deadline_ms: Option<u64>,
    pub queued: usize,
    pub running: usize,
    /// Of the queued: preempted requests waiting to go on.
    #[serde(default)]
    pub paused: usize,
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
            preempt_grace: Duration::ZERO,
            max_pause: Duration::MAX,
            min_run: Duration::ZERO,
            recheck: None,
            shutting_down: false,
        };
        let scheduler = Arc::new_cyclic(|me| Self {
            state: Mutex::new(state),
            metrics,
            me: me.clone(),
        });
        scheduler.reconfigure(config);
        scheduler
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Applies a (re)loaded config: limits change in place, queued requests stay queued, and
    /// a lower `max_concurrency` lets running requests finish while nothing more starts.
    pub fn reconfigure(&self, config: &Config) {
        let mut state = self.lock();
        state.capacity = config.upstream.max_concurrency as usize;
        state.preempt_grace = Duration::from_millis(config.risk.preempt_grace_ms);
        state.max_pause = Duration::from_millis(config.risk.max_throttle_ms);
        state.min_run = Duration::from_millis(config.risk.min_run_ms);
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
                max_per_flow: class.max_queue_per_flow.unwrap_or(usize::MAX),
                deadline: class.deadline_ms.map(Duration::from_millis),
            };
            self.metrics.set_deadline(name, limits.deadline);
            match state.classes.get_mut(name.as_str()) {
                Some(existing) => {
                    existing.limits = limits;
                    existing.retired = false;
                }
                None => {
                    self.metrics.publish_class(name, 0, 0);
                    let fresh = ClassState {
                        limits,
                        queue: line::Line::default(),
                        flows: fair::Flows::default(),
                        running: 0,
                        retired: false,
                    };
                    state.classes.insert(Arc::from(name.as_str()), fresh);
                }
            }
        }
        state.forget_drained();
        self.dispatch(&mut state);
    }

    /// Admits a request into its class's queue, or says why not. The returned ticket
    /// resolves to a permit when it is this request's turn.
    pub fn enqueue(self: &Arc<Self>, job: Job) -> Result<Ticket, Rejection> {
        let now = Instant::now();
        let mut state = self.lock();
        let (name, limits) = state.open_class(&job.class)?;
        let service = state.estimator.service_time(
            &name,
            job.model.as_deref(),
            job.tokens,
            job.prompt_tokens,
        );
        let (flow, tag, queued, flow_waiting) = match state.classes.get(&name) {
            Some(class) => {
                let flow = class.flows.flow_of(job.flow);
                let tag = class.flows.peek(flow);
                (flow, tag, class.queue.len(), class.flows.waiting(flow))
            }
            None => (fair::SHARED, 0, 0, 0),
        };
        // One that starts now starts now: no need to weigh what runs.
        let starts = match state.starts_now(&name) {
            true => Duration::ZERO,
            false => state.predict_start(now, &name, Ahead::Tag(tag)),
        };
        let full = queued >= limits.max_queue || flow_waiting >= limits.max_per_flow;
        if full && !state.starts_now(&name) {
            let head_starts = state.predict_start(now, &name, Ahead::Head);
            return Err(Rejection {
                reason: RejectReason::QueueFull,
                retry_after: head_starts,
            });
        }
        if let Some(deadline) = limits.deadline
            && starts > deadline
        {
            return Err(Rejection {
                reason: RejectReason::DeadlinePredicted,
                retry_after: starts - deadline,
            });
        }
        let id = state.next_id;
        state.next_id += 1;
        let (grant, granted) = oneshot::channel();
        if let Some(class_state) = state.classes.get_mut(&name) {
            let joined = class_state.flows.join(flow, service);
            debug_assert_eq!(joined, tag);
            class_state.queue.push(Waiter {
                id,
                arrived: now,
                service,
                tokens: job.tokens,
                preemptible: job.preemptible,
                paused: None,
                flow,
                tag,
                grant,
            });
        }
        self.publish(&state, &name);
        self.dispatch(&mut state);
        Ok(Ticket::new(
            Arc::clone(self),
            id,
            name,
            job,
            ticket::Times {
                arrived: now,
                predicted: starts,
                deadline: limits.deadline,
            },
            granted,
        ))
    }

    /// Starts as many waiting requests as there are free permits, highest priority first.
    fn dispatch(&self, state: &mut State) {
        while state.running.len() < state.capacity {
            let Some(name) = state.next_to_dispatch() else {
                break;
            };
            let Some(waiter) = state.classes.get_mut(&name).and_then(|class| {
                let waiter = class.queue.pop_front()?;
                class.flows.leave(waiter.flow, waiter.tag, true);
                Some(waiter)
            }) else {
                break;
            };
            let now = Instant::now();
            let progress = Arc::new(Progress::new(now));
            let priority = state.classes.get(&name).map_or(0, |c| c.limits.priority);
            // A waiter whose ticket is gone takes nothing.
            if waiter.grant.send(Ok(Arc::clone(&progress))).is_ok() {
                if let Some(class) = state.classes.get_mut(&name) {
                    class.running += 1;
                }
                // One that waited its longest pause runs a while before it may stop again.
                let overdue = waiter.paused.is_some_and(|at| now - at >= state.max_pause);
                let protected_until = overdue.then(|| now + state.min_run);
                state.running.insert(
                    waiter.id,
                    Running {
                        started: now,
                        expected: waiter.service,
                        tokens: waiter.tokens,
                        progress,
                        priority,
                        preemptible: waiter.preemptible,
                        preempting: false,
                        protected_until,
                    },
                );
            }
            self.publish(state, &name);
        }
        self.preempt(state);
    }

    /// Asks a running request to stop where a more urgent one waits; where none may stop yet
    /// but one will (its bounded run ends, it runs past its estimate), looks again then.
    fn preempt(&self, state: &mut State) {
        let Some(after) = state.preempt_for_waiters() else {
            return;
        };
        let at = Instant::now() + after;
        let (Some(me), Ok(runtime)) = (self.me.upgrade(), tokio::runtime::Handle::try_current())
        else {
            return;
        };
        if state.recheck.is_some_and(|pending| pending <= at) {
            return;
        }
        state.recheck = Some(at);
        runtime.spawn(async move {
            tokio::time::sleep_until(at).await;
            let mut state = me.lock();
            if state.recheck == Some(at) {
                state.recheck = None;
            }
            me.preempt(&mut state);
        });
    }

    /// Stops a running preemptible request and puts it back, first in its class's line, to
    /// go on when its turn comes again; returns its new ticket. Its slot goes to whoever is
    /// first now.
    fn requeue(self: &Arc<Self>, id: u64, class: &Arc<str>, job: Job, arrived: Instant) -> Ticket {
        let mut state = self.lock();
        let (grant, granted) = oneshot::channel();
        if let Some(running) = state.running.remove(&id) {
            let service = running.remaining(Instant::now());
            if let Some(class_state) = state.classes.get_mut(class) {
                class_state.running = class_state.running.saturating_sub(1);
                let flow = class_state.flows.flow_of(job.flow);
                let tag = class_state.flows.rejoin(flow);
                class_state.queue.push_front(Waiter {
                    id,
                    arrived,
                    service,
                    tokens: job.tokens,
                    preemptible: job.preemptible,
                    paused: Some(Instant::now()),
                    flow,
                    tag,
                    grant,
                });
            }
        }
        self.publish(&state, class);
        self.dispatch(&mut state);
        let times = ticket::Times {
            arrived,
            predicted: Duration::ZERO,
            // It met its deadline when it first started.
            deadline: None,
        };
        Ticket::new(Arc::clone(self), id, Arc::clone(class), job, times, granted)
    }

    /// Frees a permit and starts the next request; a completed one teaches the estimator.
    fn release(&self, id: u64, class: &str, completed: Option<estimator::Observation<'_>>) {
        let mut state = self.lock();
        if state.running.remove(&id).is_none() {
            return;
        }
        if let Some(class_state) = state.classes.get_mut(class) {
            class_state.running = class_state.running.saturating_sub(1);
        }
        if let Some(seen) = completed {
            state.estimator.record(&seen);
        }
        self.publish(&state, class);
        self.dispatch(&mut state);
        state.forget_drained();
    }

    /// Takes a waiting request out of its queue; false if it was not there (already granted).
    fn remove(&self, id: u64, class: &str) -> bool {
        let mut state = self.lock();
        let Some(class_state) = state.classes.get_mut(class) else {
            return false;
        };
        let removed = class_state
            .queue
            .remove(id)
            .inspect(|waiter| class_state.flows.leave(waiter.flow, waiter.tag, false))
            .is_some();
        if removed {
            self.publish(&state, class);
        }
        removed
    }

    /// When a request of `class` at the head of its queue would start (for Retry-After).
    fn head_start(&self, class: &str) -> Duration {
        self.lock()
            .predict_start(Instant::now(), class, Ahead::Head)
    }

    /// Turns every waiting request away (shutting_down) and refuses new ones.
    pub fn shut_down(&self) {
        let mut state = self.lock();
        state.shutting_down = true;
        let names: Vec<Arc<str>> = state.classes.keys().cloned().collect();
        for name in names {
            if let Some(class) = state.classes.get_mut(&name) {
                for waiter in class.queue.drain() {
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

    /// Whether it turns every request away (guard is stopping).
    pub fn is_shutting_down(&self) -> bool {
        self.lock().shutting_down
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
                // Fair order puts newer requests of light flows first: the oldest is anywhere.
                // A paused request met its deadline when it started.
                let oldest = class
                    .queue
                    .iter()
                    .filter(|w| w.paused.is_none())
                    .map(|w| w.arrived)
                    .min()?;
                let fraction = oldest.elapsed().as_secs_f64() / deadline.as_secs_f64();
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
                paused: class.queue.paused(),
                held: state.is_held(class),
                retired: class.retired,
                predicted_wait_ms: state.predict_start(now, name, Ahead::End).as_millis() as u64,
            })
            .collect()
    }

    fn publish(&self, state: &State, class: &str) {
        if let Some(class_state) = state.classes.get(class) {
            self.metrics
                .publish_class(class, class_state.queue.len(), class_state.running);
        }
    }
}

impl State {
    /// The class a new request may join, with its limits; or why it may not.
    fn open_class(&self, class: &str) -> Result<(Arc<str>, Limits), Rejection> {
        let closed = Rejection {
            reason: RejectReason::ShuttingDown,
            retry_after: Duration::from_secs(1),
        };
        if self.shutting_down {
            return Err(closed);
        }
        // The classifier names only configured classes; a reload may have raced it.
        match self.classes.get_key_value(class) {
            Some((name, state)) if !state.retired => Ok((Arc::clone(name), state.limits.clone())),
            _ => Err(closed),
        }
    }

    fn is_held(&self, class: &ClassState) -> bool {
        self.hold_above
            .is_some_and(|level| class.limits.priority > level)
    }

    /// The class whose head goes next: a preempted request that has waited its longest pause,
    /// else the lowest priority value, the earliest arrival.
    fn next_to_dispatch(&self) -> Option<Arc<str>> {
        let now = Instant::now();
        let overdue = self.classes.iter().find(|(_, class)| {
            !self.is_held(class)
                && class
                    .queue
                    .front()
                    .and_then(|w| w.paused)
                    .is_some_and(|at| now - at >= self.max_pause)
        });
        if let Some((name, _)) = overdue {
            return Some(Arc::clone(name));
        }
        self.classes
            .iter()
            .filter(|(_, class)| !class.queue.is_empty() && !self.is_held(class))
            .min_by_key(|(_, class)| {
                (
                    class.limits.priority,
                    class.queue.front().map(|w| w.arrived),
                )
            })
            .map(|(name, _)| Arc::clone(name))
    }

    /// Whether a request of `class` arriving now would be dispatched at once.
    fn starts_now(&self, class: &str) -> bool {
        let Some(own) = self.classes.get(class) else {
            return false;
        };
        self.running.len() < self.capacity
            && !self.is_held(own)
            && !self
                .classes
                .values()
                .any(|c| c.limits.priority <= own.limits.priority && !c.queue.is_empty())
    }

    /// When a request of `class` would start: after what runs now (a request it may preempt
    /// only until it may be stopped) and the waiting work dispatched before it (classes of equal or higher priority, and its own class's requests
    /// `ahead`), each at its estimate. Up to `EXACT_UP_TO` jobs ahead, slot by slot; past that,
    /// from the kept sums: their work shared by the slots (an upper bound within one job's
    /// service), at a cost that does not grow with the line.
    fn predict_start(&self, now: Instant, class: &str, ahead: Ahead) -> Duration {
        let Some(own) = self.classes.get(class) else {
            return Duration::ZERO;
        };
        let before = |name: &Arc<str>, c: &ClassState| {
            c.limits.priority <= own.limits.priority && name.as_ref() != class
        };
        let others = || self.classes.iter().filter(|(name, c)| before(name, c));
        let own_count = match ahead {
            Ahead::Head => 0,
            Ahead::Tag(_) | Ahead::End => own.queue.len(),
        };
        let waiting = others().map(|(_, c)| c.queue.len()).sum::<usize>() + own_count;
        // A running request this one may stop holds its slot only until it may be stopped.
        let (urgent, grace) = (own.limits.priority, self.preempt_grace);
        let remaining = self.running.values().map(move |running| {
            let left = running.remaining(now);
            running
                .stoppable(urgent, grace, now)
                .map_or(left, |until| until.min(left))
        });
        if waiting <= EXACT_UP_TO {
            let own_ahead: Box<dyn Iterator<Item = &Waiter>> = match ahead {
                Ahead::Head => Box::new(std::iter::empty()),
                Ahead::Tag(tag) => Box::new(own.queue.ahead_of(tag)),
                Ahead::End => Box::new(own.queue.iter()),
            };
            let mut jobs: Vec<(i32, Instant, Duration)> = others()
                .flat_map(|(_, c)| {
                    c.queue
                        .iter()
                        .map(|w| (c.limits.priority, w.arrived, w.service))
                })
                .chain(own_ahead.map(|w| (own.limits.priority, w.arrived, w.service)))
                .collect();
            jobs.sort_by_key(|(priority, arrived, _)| (*priority, *arrived));
            return predict_start(
                self.capacity,
                remaining,
                jobs.into_iter().map(|(_, _, service)| service),
            );
        }
        if self.running.len() + waiting < self.capacity {
            return Duration::ZERO;
        }
        let own_work = match ahead {
            Ahead::Head => Duration::ZERO,
            Ahead::Tag(tag) => own.flows.work_before(tag).min(own.queue.service()),
            Ahead::End => own.queue.service(),
        };
        let work = remaining
            .chain(others().map(|(_, c)| c.queue.service()))
            .fold(own_work, Duration::saturating_add);
        work / u32::try_from(self.capacity.max(1)).unwrap_or(u32::MAX)
    }

    /// Where every slot is taken and a more urgent request waits: asks the running preemptible
    /// request with the least work to lose (fewest tokens so far) to stop. One at a time: the
    /// next is chosen when that slot has come back. Where none may stop yet but one will,
    /// returns how soon.
    fn preempt_for_waiters(&mut self) -> Option<Duration> {
        if self.running.len() < self.capacity || self.running.values().any(|r| r.preempting) {
            return None;
        }
        let urgent = self
            .classes
            .values()
            .filter(|class| !class.queue.is_empty() && !self.is_held(class))
            .map(|class| class.limits.priority)
            .min()?;
        let now = Instant::now();
        let grace = self.preempt_grace;
        let mut soonest: Option<Duration> = None;
        let mut victim: Option<&mut Running> = None;
        for running in self.running.values_mut() {
            match running.stoppable(urgent, grace, now) {
                Some(after) if !after.is_zero() => {
                    soonest = Some(soonest.map_or(after, |s| s.min(after)));
                }
                Some(_)
                    if victim
                        .as_ref()
                        .is_none_or(|v| running.progress.tokens() < v.progress.tokens()) =>
                {
                    victim = Some(running);
                }
                _ => {}
            }
        }
        let Some(victim) = victim else {
            return soonest;
        };
        victim.preempting = true;
        victim.progress.preempt();
        None
    }

    /// Drops classes a reload removed once nothing of theirs waits or runs.
    fn forget_drained(&mut self) {
        self.classes
            .retain(|_, class| !class.retired || !class.queue.is_empty() || class.running > 0);
    }
}

#[cfg(test)]
mod tests;
