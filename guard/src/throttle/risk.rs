//! The risk detector of docs/design.md §8: are protected classes' deadlines at risk? Each
//! signal has a threshold; a signal that is on stays on until it falls below 80 % of its
//! threshold (hysteresis), and guard lifts its holds only after every signal has been clear
//! for `risk.hold_ms`.

use std::{
    collections::BTreeSet,
    sync::{Arc, Mutex},
    time::Duration,
};

use tokio::time::Instant;

use super::{Hold, Limits, Reason, Throttler, ttft::TtftWindow};
use crate::{
    config::Config,
    metrics::{Metrics, labels},
    queue::Scheduler,
    watch::Watched,
};

/// A signal may clear only below this share of its threshold.
const CLEAR_BAND: f64 = 0.8;
/// How often the detector looks.
const TICK: Duration = Duration::from_millis(250);
/// The window of TTFT samples the p95 is taken over.
pub const TTFT_WINDOW: Duration = Duration::from_secs(60);

/// What can put protected deadlines at risk.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum Signal {
    /// A protected request has waited its share of its deadline.
    Wait,
    /// A protected class's recent TTFT p95 is over its deadline.
    Ttft,
    Swap,
    MemoryPressure,
    GpuMemory,
}

impl Signal {
    pub const ALL: [Self; 5] = [
        Self::Wait,
        Self::Ttft,
        Self::Swap,
        Self::MemoryPressure,
        Self::GpuMemory,
    ];

    /// The `reason` label of `guard_at_risk`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Wait => "wait",
            Self::Ttft => "ttft",
            Self::Swap => "swap",
            Self::MemoryPressure => "memory_pressure",
            Self::GpuMemory => "gpu_memory",
        }
    }
}

/// The signals that are on now, as /status shows them (the detector writes, others read).
#[derive(Debug, Default)]
pub struct RiskView(Mutex<BTreeSet<Signal>>);

impl RiskView {
    pub fn signals(&self) -> Vec<Signal> {
        self.lock().iter().copied().collect()
    }

    fn set(&self, signals: &BTreeSet<Signal>) {
        self.lock().clone_from(signals);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeSet<Signal>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// What the detector reads in one look.
#[derive(Clone, Debug, Default)]
pub struct Inputs {
    /// Oldest waiter's wait as a share of its deadline, per protected class.
    pub wait_fractions: Vec<f64>,
    /// (recent TTFT p95, samples, deadline) per protected class.
    pub ttft: Vec<(Duration, usize, Duration)>,
    pub swap_in: Option<f64>,
    pub memory_pressure: Option<f64>,
    pub gpu_memory: Option<f64>,
}

/// The signals that are on, given the last look's (for hysteresis).
pub fn evaluate(
    inputs: &Inputs,
    config: &crate::config::RiskConfig,
    before: &BTreeSet<Signal>,
) -> BTreeSet<Signal> {
    let over = |signal: Signal, value: f64, threshold: f64| {
        let limit = if before.contains(&signal) {
            threshold * CLEAR_BAND
        } else {
            threshold
        };
        value > limit
    };
    let mut on = BTreeSet::new();
    if inputs
        .wait_fractions
        .iter()
        .any(|f| over(Signal::Wait, *f, config.wait_fraction))
    {
        on.insert(Signal::Wait);
    }
    let ttft_over = inputs.ttft.iter().any(|(p95, samples, deadline)| {
        *samples >= config.ttft_min_samples
            && over(Signal::Ttft, p95.as_secs_f64(), deadline.as_secs_f64())
    });
    if ttft_over {
        on.insert(Signal::Ttft);
    }
    for (signal, value, threshold) in [
        (
            Signal::Swap,
            inputs.swap_in,
            config.swap_in_pages_per_second,
        ),
        (
            Signal::MemoryPressure,
            inputs.memory_pressure,
            config.memory_pressure,
        ),
        (Signal::GpuMemory, inputs.gpu_memory, config.gpu_memory),
    ] {
        if value.is_some_and(|v| over(signal, v, threshold)) {
            on.insert(signal);
        }
    }
    on
}

/// At risk or not, with the hold time.
#[derive(Debug, Default)]
pub struct State {
    pub at_risk: bool,
    pub signals: BTreeSet<Signal>,
    clear_since: Option<Instant>,
}

/// A change of state to act on.
#[derive(Debug, PartialEq, Eq)]
pub enum Change {
    Enter,
    Exit,
}

impl State {
    pub fn step(
        &mut self,
        now: Instant,
        signals: BTreeSet<Signal>,
        hold: Duration,
    ) -> Option<Change> {
        self.signals = signals;
        if !self.signals.is_empty() {
            self.clear_since = None;
            if !self.at_risk {
                self.at_risk = true;
                return Some(Change::Enter);
            }
            return None;
        }
        if !self.at_risk {
            return None;
        }
        let since = *self.clear_since.get_or_insert(now);
        if now.duration_since(since) >= hold {
            self.at_risk = false;
            self.clear_since = None;
            return Some(Change::Exit);
        }
        None
    }
}

/// The protected classes and their deadlines.
fn protected_classes(config: &Config) -> Vec<(String, Duration)> {
    config
        .class
        .iter()
        .filter(|(_, c)| c.priority <= config.risk.protect_priority)
        .filter_map(|(name, c)| Some((name.clone(), Duration::from_millis(c.deadline_ms?))))
        .collect()
}

/// What the detector reads and writes.
pub struct Detector {
    pub scheduler: Arc<Scheduler>,
    pub watched: Arc<Watched>,
    pub metrics: Metrics,
    pub throttler: Arc<Mutex<Throttler>>,
    pub ttft: Arc<TtftWindow>,
    pub view: Arc<RiskView>,
}

/// Makes `guard_at_risk` exist at zero for every signal.
pub fn init(metrics: &Metrics) {
    for signal in Signal::ALL {
        let reason = signal.as_str();
        metrics.at_risk.of(&labels::Reason { reason }).set(0);
    }
}

/// Runs the detector until the task is dropped. A reloaded config (SIGHUP) changes its
/// thresholds, hold time and protected classes from the next look on.
pub async fn run(mut configs: tokio::sync::watch::Receiver<Config>, detector: Detector) {
    let Detector {
        scheduler,
        watched,
        metrics,
        throttler,
        ttft,
        view,
    } = detector;
    init(&metrics);
    let mut state = State::default();
    let mut config = configs.borrow_and_update().clone();
    let mut protected = protected_classes(&config);
    let mut ticks = tokio::time::interval(TICK);
    let mut dispatch = DispatchHold::default();
    loop {
        let limits = Limits::of(&config);
        // Woken at the next tick, or sooner where a hold reaches max_throttle_ms then.
        let overdue = lock(&throttler).next_deadline(limits);
        tokio::select! {
            _ = ticks.tick() => {}
            () = sleep_until(overdue) => {}
        }
        lock(&throttler).release_overdue(limits, Instant::now().into_std());
        if configs.has_changed().unwrap_or(false) {
            config = configs.borrow_and_update().clone();
            protected = protected_classes(&config);
        }
        let hold = Duration::from_millis(config.risk.hold_ms);
        let inputs = Inputs::read(&scheduler, &watched, &ttft, &protected);
        let on = evaluate(&inputs, &config.risk, &state.signals);
        for signal in Signal::ALL {
            let reason = signal.as_str();
            let gauge = metrics.at_risk.of(&labels::Reason { reason });
            gauge.set(i64::from(on.contains(&signal)));
        }
        view.set(&on);
        let reasons = on.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(",");
        match state.step(Instant::now(), on, hold) {
            Some(Change::Enter) => {
                tracing::warn!(
                    reasons,
                    "at risk: holding back lower classes and throttling their cgroups"
                );
                dispatch.hold(&scheduler, &config, Instant::now());
            }
            Some(Change::Exit) => {
                tracing::info!(
                    hold_ms = hold.as_millis() as u64,
                    "risk clear: dispatch resumes, cgroups restored"
                );
                dispatch.release(&scheduler, Instant::now(), Reason::RiskClear);
                lock(&throttler).restore(Reason::RiskClear);
            }
            None => {}
        }
        // At risk: hold back what is not resting after a release; no hold outlasts
        // max_throttle_ms.
        if state.at_risk {
            dispatch.bound(&scheduler, &config, Instant::now());
            lock(&throttler).throttle(&config, Instant::now().into_std());
        }
    }
}

impl Inputs {
    /// What the detector looks at now: the protected classes' waits and TTFTs, and the host.
    fn read(
        scheduler: &Scheduler,
        watched: &Watched,
        ttft: &TtftWindow,
        protected: &[(String, Duration)],
    ) -> Self {
        let signals = watched.signals();
        let waits = scheduler.wait_fractions();
        Self {
            wait_fractions: waits
                .iter()
                .filter(|(class, _)| protected.iter().any(|(p, _)| p == class))
                .map(|(_, f)| *f)
                .collect(),
            ttft: protected
                .iter()
                .filter_map(|(class, deadline)| {
                    let (p95, samples) = ttft.p95(class, TTFT_WINDOW)?;
                    Some((p95, samples, *deadline))
                })
                .collect(),
            swap_in: signals.swap_in_pages_per_second,
            memory_pressure: signals.memory_pressure,
            gpu_memory: signals.gpu_memory_fraction,
        }
    }
}

/// The hold on dispatching lower classes, bounded like a cgroup hold: at most
/// `risk.max_throttle_ms` in one go, then free for at least `risk.min_release_ms`.
#[derive(Debug, Default)]
struct DispatchHold(Hold);

impl DispatchHold {
    fn hold(&mut self, scheduler: &Scheduler, config: &Config, now: Instant) {
        let now = now.into_std();
        if self.0.may_take(now, Limits::of(config)) {
            scheduler.hold_above(Some(config.risk.protect_priority));
            self.0.take(now);
        }
    }

    fn release(&mut self, scheduler: &Scheduler, now: Instant, reason: Reason) {
        if self.0.is_held() {
            self.0.release(now.into_std());
            scheduler.hold_above(None);
            tracing::info!(
                reason = reason.as_str(),
                "dispatch of lower classes resumes"
            );
        }
    }

    /// Lets go of a hold that reached max_throttle_ms; takes it again once rested.
    fn bound(&mut self, scheduler: &Scheduler, config: &Config, now: Instant) {
        if self.0.overdue(now.into_std(), Limits::of(config)) {
            self.release(scheduler, now, Reason::MaxThrottle);
        }
        self.hold(scheduler, config, now);
    }
}

/// Sleeps until `deadline`, or forever without one.
async fn sleep_until(deadline: Option<std::time::Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(Instant::from_std(deadline)).await,
        None => std::future::pending().await,
    }
}

fn lock(throttler: &Mutex<Throttler>) -> std::sync::MutexGuard<'_, Throttler> {
    throttler
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RiskConfig;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn each_signal_has_its_threshold_and_a_clear_band() {
        let config = RiskConfig::default();
        let none = BTreeSet::new();
        let inputs = Inputs {
            wait_fractions: vec![0.55],
            swap_in: Some(50.0),
            ..Inputs::default()
        };
        let on = evaluate(&inputs, &config, &none);
        assert_eq!(on, BTreeSet::from([Signal::Wait]));
        // 0.45 is under the threshold (0.5) but above the clear band (0.4): stays on.
        let inputs = Inputs {
            wait_fractions: vec![0.45],
            ..Inputs::default()
        };
        assert_eq!(
            evaluate(&inputs, &config, &on),
            BTreeSet::from([Signal::Wait])
        );
        assert!(
            evaluate(&inputs, &config, &none).is_empty(),
            "not on without having been on"
        );
        let inputs = Inputs {
            wait_fractions: vec![0.35],
            ..Inputs::default()
        };
        assert!(evaluate(&inputs, &config, &on).is_empty());
    }

    #[test]
    fn ttft_counts_only_with_enough_samples() {
        let config = RiskConfig::default();
        let slow = |n| Inputs {
            ttft: vec![(3000 * MS, n, 2000 * MS)],
            ..Inputs::default()
        };
        assert!(evaluate(&slow(2), &config, &BTreeSet::new()).is_empty());
        assert_eq!(
            evaluate(&slow(5), &config, &BTreeSet::new()),
            BTreeSet::from([Signal::Ttft])
        );
    }

    #[test]
    fn host_signals() {
        let config = RiskConfig::default();
        let inputs = Inputs {
            swap_in: Some(500.0),
            memory_pressure: Some(0.2),
            gpu_memory: Some(0.99),
            ..Inputs::default()
        };
        let on = evaluate(&inputs, &config, &BTreeSet::new());
        assert_eq!(
            on,
            BTreeSet::from([Signal::Swap, Signal::MemoryPressure, Signal::GpuMemory])
        );
    }

    #[tokio::test(start_paused = true)]
    async fn risk_lifts_only_after_the_hold_time() {
        let mut state = State::default();
        let hold = Duration::from_secs(10);
        let t0 = Instant::now();
        assert_eq!(
            state.step(t0, BTreeSet::from([Signal::Wait]), hold),
            Some(Change::Enter)
        );
        assert_eq!(
            state.step(t0 + MS, BTreeSet::from([Signal::Swap]), hold),
            None
        );
        assert_eq!(
            state.step(t0 + 2 * MS, BTreeSet::new(), hold),
            None,
            "clear starts the hold"
        );
        assert_eq!(
            state.step(t0 + Duration::from_secs(5), BTreeSet::new(), hold),
            None
        );
        assert_eq!(
            state.step(
                t0 + Duration::from_secs(6),
                BTreeSet::from([Signal::Wait]),
                hold
            ),
            None,
            "back on: hold restarts"
        );
        assert_eq!(
            state.step(t0 + Duration::from_secs(7), BTreeSet::new(), hold),
            None
        );
        assert_eq!(
            state.step(t0 + Duration::from_secs(17), BTreeSet::new(), hold),
            Some(Change::Exit)
        );
        assert!(!state.at_risk);
    }
}
