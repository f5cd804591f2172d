//! GPU readings through NVML (nvml-wrapper): memory, utilisation, power, energy, temperature,
//! throttle reasons, and the inference server's own GPU memory. Without an NVIDIA driver it
//! says so once and exports `guard_gpu_available 0`; it never retries.
//!
//! Reading the device and turning a reading into metrics are separate, so the second is
//! tested without a GPU.

use std::sync::Arc;

use nvml_wrapper::{Nvml, enum_wrappers::device::TemperatureSensor, enums::device::UsedGpuMemory};
use prometheus::IntGauge;

use crate::metrics::{
    Family, Gauges, Metrics,
    family::Labels,
    labels::{ByGpu, ByGpuPid, ByGpuReason, Gpu, GpuPid, GpuReason},
};

/// One GPU, as read.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct GpuReading {
    pub index: u32,
    pub name: String,
    pub memory_used_bytes: u64,
    pub memory_total_bytes: u64,
    pub utilization_ratio: Option<f64>,
    pub power_watts: Option<f64>,
    pub energy_joules: Option<f64>,
    pub temperature_celsius: Option<f64>,
    pub throttle_reasons: Vec<String>,
    /// GPU memory held by the processes NVML lists, by pid.
    pub processes: Vec<(u32, u64)>,
}

/// Every GPU's reading, or why there are none.
#[derive(Clone, Debug, Default)]
pub struct GpusReading {
    pub gpus: Vec<GpuReading>,
    pub unavailable: Option<String>,
}

impl GpusReading {
    /// The fullest GPU's share of memory used (the risk detector's input).
    pub fn fullest_memory_fraction(&self) -> Option<f64> {
        self.gpus
            .iter()
            .filter(|g| g.memory_total_bytes > 0)
            .map(|g| g.memory_used_bytes as f64 / g.memory_total_bytes as f64)
            .reduce(f64::max)
    }

    pub fn status(&self) -> GpuStatus {
        GpuStatus {
            available: self.unavailable.is_none(),
            unavailable_reason: self.unavailable.clone(),
            gpus: self.gpus.clone(),
        }
    }
}

/// The GPUs as /status shows them.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct GpuStatus {
    pub available: bool,
    pub unavailable_reason: Option<String>,
    pub gpus: Vec<GpuReading>,
}

/// The exported GPU metrics.
pub struct GpuMetrics {
    pub available: IntGauge,
    memory_used: Gauges<ByGpu>,
    memory_total: Gauges<ByGpu>,
    utilization: Gauges<ByGpu>,
    power: Gauges<ByGpu>,
    energy: Gauges<ByGpu>,
    temperature: Gauges<ByGpu>,
    throttled: Gauges<ByGpuReason>,
    process_memory: Gauges<ByGpuPid>,
}

impl GpuMetrics {
    pub fn new(metrics: &Metrics) -> Self {
        let available = IntGauge::new(
            "guard_gpu_available",
            "1 where NVML reads at least one NVIDIA GPU.",
        )
        .expect("valid gauge");
        metrics.register(Box::new(available.clone()));
        let vec = |name: &str, help: &str| registered(metrics, Family::gauge(name, help));
        Self {
            available,
            memory_used: vec("guard_gpu_memory_used_bytes", "GPU memory in use."),
            memory_total: vec("guard_gpu_memory_total_bytes", "GPU memory in all."),
            utilization: vec(
                "guard_gpu_utilization_ratio",
                "Share of time the GPU was busy.",
            ),
            power: vec("guard_gpu_power_watts", "GPU power draw."),
            energy: vec(
                "guard_gpu_energy_joules",
                "Energy the GPU has used since the driver loaded (a gauge: it restarts with the driver).",
            ),
            temperature: vec("guard_gpu_temperature_celsius", "GPU temperature."),
            throttled: registered(
                metrics,
                Family::gauge(
                    "guard_gpu_throttled",
                    "1 while NVML reports this clock throttle reason.",
                ),
            ),
            process_memory: registered(
                metrics,
                Family::gauge(
                    "guard_gpu_process_memory_bytes",
                    "GPU memory held by a process (the inference server among them).",
                ),
            ),
        }
    }

    /// Turns a reading into metric values.
    pub fn apply(&self, reading: &GpusReading) {
        self.available.set(i64::from(!reading.gpus.is_empty()));
        self.throttled.reset();
        self.process_memory.reset();
        for gpu in &reading.gpus {
            let label = gpu.index.to_string();
            let of = Gpu { gpu: &label };
            self.memory_used.of(&of).set(gpu.memory_used_bytes as f64);
            self.memory_total.of(&of).set(gpu.memory_total_bytes as f64);
            let optional = [
                (&self.utilization, gpu.utilization_ratio),
                (&self.power, gpu.power_watts),
                (&self.energy, gpu.energy_joules),
                (&self.temperature, gpu.temperature_celsius),
            ];
            for (metric, value) in optional {
                if let Some(value) = value {
                    metric.of(&of).set(value);
                }
            }
            for reason in &gpu.throttle_reasons {
                let of = GpuReason {
                    gpu: &label,
                    reason,
                };
                self.throttled.of(&of).set(1.0);
            }
            for (pid, bytes) in &gpu.processes {
                let pid = pid.to_string();
                let of = GpuPid {
                    gpu: &label,
                    pid: &pid,
                };
                self.process_memory.of(&of).set(*bytes as f64);
            }
        }
    }
}

/// A family registered with guard's metrics.
fn registered<L: Labels>(metrics: &Metrics, family: Gauges<L>) -> Gauges<L> {
    metrics.register(family.collector());
    family
}

pub struct GpuWatcher {
    /// Shared with the energy reader: NVML is loaded once.
    nvml: Option<Arc<Nvml>>,
    unavailable: Option<String>,
    metrics: GpuMetrics,
}

impl GpuWatcher {
    /// Loads NVML once; without a driver says why, once.
    pub fn new(metrics: &Metrics) -> Self {
        let metrics = GpuMetrics::new(metrics);
        match Nvml::init() {
            Ok(nvml) => {
                tracing::info!("NVML loaded: GPU metrics on");
                Self {
                    nvml: Some(Arc::new(nvml)),
                    unavailable: None,
                    metrics,
                }
            }
            Err(err) => {
                let reason = format!(
                    "no NVIDIA driver (NVML: {}); GPU metrics off",
                    crate::error_chain(&err)
                );
                tracing::info!("{reason}");
                metrics.available.set(0);
                Self {
                    nvml: None,
                    unavailable: Some(reason),
                    metrics,
                }
            }
        }
    }

    /// NVML as loaded here, for the other readers of the GPUs.
    pub fn nvml(&self) -> Option<Arc<Nvml>> {
        self.nvml.clone()
    }

    pub fn sample(&mut self) -> GpusReading {
        let Some(nvml) = &self.nvml else {
            return GpusReading {
                gpus: Vec::new(),
                unavailable: self.unavailable.clone(),
            };
        };
        let count = nvml.device_count().unwrap_or(0);
        let gpus: Vec<GpuReading> = (0..count)
            .filter_map(|index| {
                nvml.device_by_index(index)
                    .ok()
                    .map(|device| read(index, &device))
            })
            .collect();
        let reading = GpusReading {
            gpus,
            unavailable: None,
        };
        self.metrics.apply(&reading);
        reading
    }
}

fn read(index: u32, device: &nvml_wrapper::Device<'_>) -> GpuReading {
    let memory = device.memory_info().ok();
    GpuReading {
        index,
        name: device.name().unwrap_or_default(),
        memory_used_bytes: memory.as_ref().map_or(0, |m| m.used),
        memory_total_bytes: memory.as_ref().map_or(0, |m| m.total),
        utilization_ratio: device
            .utilization_rates()
            .ok()
            .map(|u| f64::from(u.gpu) / 100.0),
        power_watts: device.power_usage().ok().map(|mw| f64::from(mw) / 1000.0),
        energy_joules: device
            .total_energy_consumption()
            .ok()
            .map(|mj| mj as f64 / 1000.0),
        temperature_celsius: device
            .temperature(TemperatureSensor::Gpu)
            .ok()
            .map(f64::from),
        throttle_reasons: device
            .current_throttle_reasons()
            .map(|reasons| {
                reasons
                    .iter_names()
                    .map(|(name, _)| name.to_ascii_lowercase())
                    .collect()
            })
            .unwrap_or_default(),
        processes: device
            .running_compute_processes()
            .unwrap_or_default()
            .into_iter()
            .filter_map(|p| match p.used_gpu_memory {
                UsedGpuMemory::Used(bytes) => Some((p.pid, bytes)),
                UsedGpuMemory::Unavailable => None,
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(index: u32, used: u64, total: u64) -> GpuReading {
        GpuReading {
            index,
            name: "test".to_owned(),
            memory_used_bytes: used,
            memory_total_bytes: total,
            power_watts: Some(312.5),
            throttle_reasons: vec!["sw_power_cap".to_owned()],
            processes: vec![(4242, used / 2)],
            ..GpuReading::default()
        }
    }

    #[test]
    fn readings_become_metrics_without_a_gpu() {
        let metrics = Metrics::new();
        let gpu_metrics = GpuMetrics::new(&metrics);
        let reading = GpusReading {
            gpus: vec![gpu(0, 30, 100), gpu(1, 90, 100)],
            unavailable: None,
        };
        gpu_metrics.apply(&reading);
        let text = metrics.render();
        assert!(text.contains("guard_gpu_available 1"));
        assert!(text.contains("guard_gpu_memory_used_bytes{gpu=\"1\"} 90"));
        assert!(text.contains("guard_gpu_power_watts{gpu=\"0\"} 312.5"));
        assert!(text.contains("guard_gpu_throttled{gpu=\"0\",reason=\"sw_power_cap\"} 1"));
        assert!(text.contains("guard_gpu_process_memory_bytes{gpu=\"1\",pid=\"4242\"} 45"));
        assert_eq!(reading.fullest_memory_fraction(), Some(0.9));
    }

    #[test]
    fn no_gpu_is_zero_and_no_risk_signal() {
        let metrics = Metrics::new();
        let gpu_metrics = GpuMetrics::new(&metrics);
        let reading = GpusReading {
            gpus: vec![],
            unavailable: Some("no driver".to_owned()),
        };
        gpu_metrics.apply(&reading);
        assert!(metrics.render().contains("guard_gpu_available 0"));
        assert_eq!(reading.fullest_memory_fraction(), None);
        assert!(!reading.status().available);
    }

    #[test]
    fn this_machine_without_a_driver_says_so_once() {
        // On a machine with an NVIDIA driver this reads real GPUs instead.
        let metrics = Metrics::new();
        let mut watcher = GpuWatcher::new(&metrics);
        let reading = watcher.sample();
        assert_eq!(reading.unavailable.is_some(), reading.gpus.is_empty());
        let _ = watcher.sample();
    }
}
