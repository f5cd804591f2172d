//! Holding lower classes' cgroups back while protected deadlines are at risk, and always
//! putting them back: when risk clears, on SIGTERM, and after a crash on the next start.

pub mod cgroup;
pub mod risk;
pub mod state;
pub mod ttft;

use crate::{config::Config, metrics::Metrics};
use cgroup::Cgroup;
use state::{Record, StateError};

/// Why throttling could not be set up; the key names the config entry.
#[derive(Debug, thiserror::Error)]
#[error("{key}: {source}")]
pub struct ThrottleSetupError {
    pub key: String,
    #[source]
    pub source: StateError,
}

struct Target {
    class: String,
    cgroup: Cgroup,
    record: Record,
    throttled: bool,
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
                throttled: false,
            });
        }
        // Every class, throttleable or not, shows as not held back from the start.
        for name in config.class.keys() {
            metrics.class_throttled.with_label_values(&[name]).set(0);
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
            .filter(|t| t.throttled)
            .map(|t| t.class.clone())
            .collect()
    }

    /// Holds back every class whose priority is above `protect_priority`.
    pub fn throttle(&mut self, config: &Config) {
        for target in &mut self.targets {
            let protected = config
                .class
                .get(&target.class)
                .is_none_or(|c| c.priority <= config.risk.protect_priority);
            if protected || target.throttled {
                continue;
            }
            match throttle_one(target) {
                Ok(()) => {
                    target.throttled = true;
                    self.metrics
                        .class_throttled
                        .with_label_values(&[&target.class])
                        .set(1);
                    tracing::info!(class = target.class, cgroup = %target.cgroup.path.display(), "throttled");
                }
                Err(err) => tracing::error!(class = target.class, %err, "could not throttle"),
            }
        }
    }

    /// Puts every throttled cgroup back as it was.
    pub fn restore(&mut self) {
        for target in &mut self.targets {
            if !target.throttled {
                continue;
            }
            match restore_one(target) {
                Ok(()) => {
                    target.throttled = false;
                    self.metrics
                        .class_throttled
                        .with_label_values(&[&target.class])
                        .set(0);
                    tracing::info!(class = target.class, cgroup = %target.cgroup.path.display(), "restored");
                }
                Err(err) => tracing::error!(class = target.class, %err, "could not restore"),
            }
        }
    }
}

impl Drop for Throttler {
    fn drop(&mut self) {
        self.restore();
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
        target
            .cgroup
            .write(&restore_value(&target.cgroup, &original))?;
    }
    target.record.clear()
}

/// The value to write back: what was read, in the form the file accepts. (cpu.max reads as
/// "max 100000" and accepts that; freezer.state reads FREEZING mid-transition.)
fn restore_value(cgroup: &Cgroup, original: &str) -> String {
    if cgroup.control.file.ends_with("freezer.state") && original != "FROZEN" {
        "THAWED".to_owned()
    } else {
        original.to_owned()
    }
}
