//! Holding lower classes' cgroups back while protected deadlines are at risk, and always
//! putting them back: when risk clears, on SIGTERM, and after a crash on the next start.

pub mod cgroup;
pub mod risk;
pub mod state;
pub mod ttft;

use std::time::{Duration, Instant};

use crate::{
    config::Config,
    metrics::{
        Metrics,
        labels::{Class, ClassChange},
    },
};
use cgroup::Cgroup;
use state::{Record, StateError};

/// Why throttling could not be set up; the key names the config entry.
#[derive(Debug, thiserror::Error)]
#[error("{key}")]
pub struct ThrottleSetupError {
    pub key: String,
    #[source]
    pub source: StateError,
}

struct Target {
    class: String,
    cgroup: Cgroup,
    record: Record,
    hold: Hold,
    /// A restore that failed is tried again from then on, not at once (no busy loop).
    retry_at: Option<Instant>,
}

/// Why a class's cgroup was held back or let go (the `reason` label, and the log).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    /// A protected class's deadline is at risk.
    AtRisk,
    /// Risk has been clear for `risk.hold_ms`.
    RiskClear,
    /// The hold reached `risk.max_throttle_ms`.
    MaxThrottle,
    /// guard is stopping.
    Shutdown,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::AtRisk => "at_risk",
            Self::RiskClear => "risk_clear",
            Self::MaxThrottle => "max_throttle",
            Self::Shutdown => "shutdown",
        }
    }
}

/// How long a hold may last, and how long a class runs free between two.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub max_throttle: Duration,
    pub min_release: Duration,
}

impl Limits {
    pub fn of(config: &Config) -> Self {
        Self {
            max_throttle: Duration::from_millis(config.risk.max_throttle_ms),
            min_release: Duration::from_millis(config.risk.min_release_ms),
        }
    }
}

/// One hold's timeline, under the limits every hold obeys (a class's cgroup, and the hold on
/// dispatching lower classes): since when it is held, when it was last let go.
#[derive(Clone, Copy, Debug, Default)]
pub struct Hold {
    since: Option<Instant>,
    released: Option<Instant>,
}

impl Hold {
    pub fn is_held(&self) -> bool {
        self.since.is_some()
    }

    pub fn since(&self) -> Option<Instant> {
        self.since
    }

    /// Not held, and rested `min_release` since the last release.
    pub fn may_take(&self, now: Instant, limits: Limits) -> bool {
        !self.is_held()
            && self
                .released
                .is_none_or(|at| now.saturating_duration_since(at) >= limits.min_release)
    }

    pub fn take(&mut self, now: Instant) {
        self.since = Some(now);
    }

    /// Held for `max_throttle` or longer.
    pub fn overdue(&self, now: Instant, limits: Limits) -> bool {
        self.since
            .is_some_and(|since| now.saturating_duration_since(since) >= limits.max_throttle)
    }

    /// Lets go; returns how long it was held.
    pub fn release(&mut self, now: Instant) -> Duration {
        self.released = Some(now);
        self.since
            .take()
            .map_or(Duration::ZERO, |since| now.saturating_duration_since(since))
    }
}

/// Every class with a cgroup and a throttle mode.
pub struct Throttler {
    targets: Vec<Target>,
    metrics: Metrics,
}

impl Throttler {
    /// Resolves, checks and locks each class's cgroup (restoring what a crashed guard left).
    pub fn new(config: &Config, metrics: &Metrics) -> Result<Self, ThrottleSetupError> {
        let mut targets = Vec::new();
        for (name, class) in &config.class {
            let (Some(path), Some(mode)) = (&class.cgroup, class.throttle) else {
                continue;
            };
            let setup = |source: StateError| ThrottleSetupError {
                key: format!("class.{name}.cgroup"),
                source,
            };
            let cgroup = Cgroup::resolve(path, mode).map_err(|e| setup(e.into()))?;
            let record =
                Record::open(&config.risk.state_dir, path, &cgroup.control.file).map_err(setup)?;
            targets.push(Target {
                class: name.clone(),
                cgroup,
                record,
                hold: Hold::default(),
                retry_at: None,
            });
        }
        // Every class, throttleable or not, shows as not held back from the start.
        for name in config.class.keys() {
            metrics.class_throttled.of(&Class { class: name }).set(0);
            for (change, reason) in CHANGES {
                let reason = reason.as_str();
                let class = name;
                metrics.throttle_changes_total.of(&ClassChange {
                    class,
                    change,
                    reason,
                });
            }
        }
        Ok(Self {
            targets,
            metrics: metrics.clone(),
        })
    }

    /// The classes whose cgroups are held back now.
    pub fn throttled(&self) -> Vec<String> {
        self.targets
            .iter()
            .filter(|t| t.hold.is_held())
            .map(|t| t.class.clone())
            .collect()
    }

    /// Holds back every class whose priority is above `protect_priority`, except one let go
    /// less than `min_release` ago.
    pub fn throttle(&mut self, config: &Config, now: Instant) {
        let limits = Limits::of(config);
        for target in &mut self.targets {
            let protected = config
                .class
                .get(&target.class)
                .is_none_or(|c| c.priority <= config.risk.protect_priority);
            if protected || !target.hold.may_take(now, limits) {
                continue;
            }
            match throttle_one(target) {
                Ok(()) => {
                    target.hold.take(now);
                    changed(&self.metrics, &target.class, "hold", Reason::AtRisk);
                    tracing::info!(class = target.class, cgroup = %target.cgroup.path.display(), reason = Reason::AtRisk.as_str(), "throttled");
                }
                Err(err) => {
                    let error = crate::error_chain(&err);
                    tracing::error!(class = target.class, %error, "could not throttle");
                }
            }
        }
    }

    /// Lets go every hold that has lasted `max_throttle`.
    pub fn release_overdue(&mut self, limits: Limits, now: Instant) {
        self.release(Reason::MaxThrottle, now, |hold| hold.overdue(now, limits));
    }

    /// When the next hold reaches `max_throttle` (or its failed restore is tried again).
    pub fn next_deadline(&self, limits: Limits) -> Option<Instant> {
        self.targets
            .iter()
            .filter_map(|t| {
                let due = t.hold.since()? + limits.max_throttle;
                Some(t.retry_at.map_or(due, |retry| retry.max(due)))
            })
            .min()
    }

    /// Puts every throttled cgroup back as it was.
    pub fn restore(&mut self, reason: Reason) {
        self.release(reason, Instant::now(), Hold::is_held);
    }

    fn release(&mut self, reason: Reason, now: Instant, due: impl Fn(&Hold) -> bool) {
        for target in &mut self.targets {
            let waiting = target.retry_at.is_some_and(|at| at > now);
            if waiting || !due(&target.hold) {
                continue;
            }
            match restore_one(target) {
                Ok(()) => {
                    let held_ms = target.hold.release(now).as_millis() as u64;
                    target.retry_at = None;
                    changed(&self.metrics, &target.class, "release", reason);
                    tracing::info!(class = target.class, cgroup = %target.cgroup.path.display(), reason = reason.as_str(), held_ms, "restored");
                }
                Err(err) => {
                    target.retry_at = Some(now + RETRY);
                    let error = crate::error_chain(&err);
                    tracing::error!(class = target.class, %error, "could not restore; trying again in 1 s");
                }
            }
        }
    }
}

/// How long a failed restore waits before it is tried again.
const RETRY: Duration = Duration::from_secs(1);

/// Counts a hold or release and sets the class's gauge.
fn changed(metrics: &Metrics, class: &str, change: &str, reason: Reason) {
    let reason = reason.as_str();
    let changes = metrics.throttle_changes_total.of(&ClassChange {
        class,
        change,
        reason,
    });
    changes.inc();
    let held = metrics.class_throttled.of(&Class { class });
    held.set(i64::from(change == "hold"));
}

/// Every (change, reason) pair that can happen, for series at zero.
const CHANGES: [(&str, Reason); 4] = [
    ("hold", Reason::AtRisk),
    ("release", Reason::RiskClear),
    ("release", Reason::MaxThrottle),
    ("release", Reason::Shutdown),
];

impl Drop for Throttler {
    fn drop(&mut self) {
        self.restore(Reason::Shutdown);
    }
}

fn throttle_one(target: &mut Target) -> Result<(), StateError> {
    let original = target.cgroup.read()?;
    // Recorded before the change: a crash between the two leaves a record, never a silent change.
    target.record.save(&original)?;
    target.cgroup.write(&target.cgroup.control.throttled)?;
    Ok(())
}

fn restore_one(target: &mut Target) -> Result<(), StateError> {
    if let Some(original) = target.record.saved()? {
        target.cgroup.write(&state::restore_value(
            &target.cgroup.control.file,
            &original,
        ))?;
    }
    target.record.clear()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hold_lasts_at_most_max_throttle_then_rests_min_release() {
        let limits = Limits {
            max_throttle: Duration::from_secs(60),
            min_release: Duration::from_secs(5),
        };
        let t0 = Instant::now();
        let mut hold = Hold::default();
        assert!(hold.may_take(t0, limits));
        hold.take(t0);
        assert!(!hold.may_take(t0, limits), "held already");
        assert!(!hold.overdue(t0 + Duration::from_secs(59), limits));
        assert!(hold.overdue(t0 + limits.max_throttle, limits));
        let released = t0 + limits.max_throttle;
        assert_eq!(hold.release(released), limits.max_throttle);
        assert!(
            !hold.may_take(released + Duration::from_secs(4), limits),
            "resting"
        );
        assert!(hold.may_take(released + limits.min_release, limits));
    }
}
