//! Watching what fails quietly: swap, memory pressure, the upstream process, GPUs (NVML), and
//! the upstream's own state (partial CPU offload, cold loads, models served from elsewhere);
//! and the box's energy, shared among the requests that hold upstream slots.
//!
//! Each watcher turns readings into metrics and into [`Signals`] the risk detector reads.

pub mod energy;
pub mod gpu;
pub mod host;
pub mod upstream;

pub use upstream::RunningFn;

use std::{
    collections::BTreeSet,
    sync::{Arc, Mutex},
    time::Duration,
};

use crate::{config::Config, metrics::Metrics, upstream::Client};

/// The latest readings the risk detector needs; `None` where a source is absent.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Signals {
    pub swap_in_pages_per_second: Option<f64>,
    /// PSI memory "full" avg10, 0..1.
    pub memory_pressure: Option<f64>,
    /// The fullest GPU's share of memory used.
    pub gpu_memory_fraction: Option<f64>,
}

/// What the watchers last read, as /status shows it; a part is absent until its first reading.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct WatchStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<host::HostReading>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu: Option<gpu::GpuStatus>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upstream: Option<upstream::UpstreamState>,
}

/// What the watchers last saw, shared with the risk detector and /status.
#[derive(Default)]
pub struct Watched {
    pub signals: Mutex<Signals>,
    status: Mutex<WatchStatus>,
    pub remote_models: upstream::RemoteModels,
    /// Joules per held slot, for each request's share of the energy.
    pub energy: Arc<energy::EnergyIndex>,
}

impl Watched {
    pub fn signals(&self) -> Signals {
        self.signals
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    fn update_status(&self, update: impl FnOnce(&mut WatchStatus)) {
        update(
            &mut self
                .status
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        );
    }

    /// A model's name as a metric label: the name where the upstream lists the model or the
    /// config names it (`named`, from the request's own settings: no lock shared by every
    /// request), else `other`, so made-up names cannot grow `/metrics`.
    pub fn model_label<'a>(&self, named: &BTreeSet<String>, model: &'a str) -> &'a str {
        if named.contains(model) || self.remote_models.known(model) {
            model
        } else {
            "other"
        }
    }

    pub fn status(&self) -> WatchStatus {
        self.status
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}

/// The watchers that read synchronous sources (procfs, sysfs, NVML), run off the reactor.
struct Samplers {
    host: host::HostWatcher,
    gpu: gpu::GpuWatcher,
    energy: energy::EnergySampler,
    /// The slots held now (the scheduler's running requests).
    held: upstream::RunningFn,
}

impl Samplers {
    fn sample(&mut self) -> (host::HostReading, gpu::GpusReading) {
        crate::memory::trim();
        let host = self.host.sample();
        let gpu = self.gpu.sample();
        self.energy.sample((self.held)());
        (host, gpu)
    }
}

/// The energy reader over the GPU watcher's NVML, else the host's RAPL zones.
fn energy_sampler(
    config: &Config,
    metrics: &Metrics,
    gpu: &gpu::GpuWatcher,
) -> energy::EnergySampler {
    let reader = energy::EnergyReader::new(gpu.nvml(), std::path::Path::new(energy::POWERCAP_ROOT));
    let sampler = energy::EnergySampler::new(reader);
    let index = sampler.index();
    match index.source() {
        Some(source) => {
            tracing::info!(source = source.as_str(), from = %sampler.describe(), "energy per request on");
        }
        None => tracing::info!(
            "no energy counter ({}): requests carry no energy",
            sampler.describe()
        ),
    }
    index.init_classes(metrics, config.class.keys().map(String::as_str));
    sampler
}

/// Starts every watcher; they run until the runtime stops.
pub fn spawn(
    config: &Config,
    metrics: &Metrics,
    upstream: Client,
    running: upstream::RunningFn,
) -> Arc<Watched> {
    let gpu = gpu::GpuWatcher::new(metrics);
    let mut samplers = Samplers {
        host: host::HostWatcher::new(metrics, config),
        energy: energy_sampler(config, metrics, &gpu),
        gpu,
        held: Arc::clone(&running),
    };
    let watched = Arc::new(Watched {
        energy: samplers.energy.index(),
        ..Watched::default()
    });
    let interval = Duration::from_millis(config.watch.interval_ms);
    let mut upstream = upstream::UpstreamWatcher::new(metrics, config, upstream, running);
    let shared = Arc::clone(&watched);
    tokio::spawn(async move {
        let mut ticks = tokio::time::interval(interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        loop {
            ticks.tick().await;
            // procfs, sysfs and NVML reads are quick synchronous syscalls; run them off the
            // reactor.
            let (back, readings) = tokio::task::spawn_blocking(move || {
                let readings = samplers.sample();
                (samplers, readings)
            })
            .await
            .unwrap_or_else(|err| std::panic::resume_unwind(err.into_panic()));
            samplers = back;
            let (host_reading, gpu_reading) = readings;
            {
                let mut signals = shared
                    .signals
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                signals.swap_in_pages_per_second = host_reading.swap_in_pages_per_second;
                signals.memory_pressure = host_reading.memory_pressure;
                signals.gpu_memory_fraction = gpu_reading.fullest_memory_fraction();
            }
            shared.update_status(|status| {
                status.gpu = Some(gpu_reading.status());
                status.host = Some(host_reading);
            });
            let state = upstream.sample(&shared.remote_models).await;
            shared.update_status(|status| status.upstream = Some(state));
        }
    });
    watched
}
