//! The status document: one struct, built by the daemon from each part's owner (the scheduler,
//! the risk detector, the throttler, the eBPF state, the watchers), served as `/status`, and
//! read back by `guard status` (guard-tools), which prints it as a table.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::{config::Api, queue::ClassSnapshot, throttle::risk::Signal, watch::WatchStatus};

/// What `/status` says.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Status {
    pub version: String,
    pub uptime_seconds: u64,
    /// The config file, or none for the built-in defaults.
    pub config: Option<String>,
    pub listen: String,
    pub upstream: UpstreamStatus,
    pub ebpf: EbpfStatus,
    pub classes: Vec<ClassSnapshot>,
    /// Per class, what sent how many requests there (a rule's name, `header`, `default`).
    /// (Defaults: a newer `guard status` still reads an older daemon.)
    #[serde(default)]
    pub classified: BTreeMap<String, BTreeMap<String, u64>>,
    /// Per preemptible class: what its config says, and how its requests go on after a
    /// preemption, as the last one was planned (none yet: no request so far).
    #[serde(default)]
    pub preemption: BTreeMap<String, PreemptStatus>,
    /// Per class, jobs and tokens over the last hour.
    #[serde(default)]
    pub last_hour: BTreeMap<String, crate::proxy::Hourly>,
    pub risk: RiskStatus,
    /// The capabilities the daemon holds now (after it dropped what it no longer needs).
    #[serde(default)]
    pub capabilities: Vec<String>,
    /// What the watchers last read (host, GPUs, the upstream's own state).
    pub watch: WatchStatus,
    /// What the balancers are told: HAProxy's agent line, the llm-d router's values.
    #[serde(default)]
    pub cluster: crate::cluster::ClusterView,
}

/// A preemptible class's way of going on after a preemption.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PreemptStatus {
    pub preemptible: crate::config::Preemptible,
    pub resume: Option<crate::upstream::resume::ResumeKind>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct UpstreamStatus {
    pub url: String,
    pub api: Api,
    pub max_concurrency: u32,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EbpfStatus {
    pub attached: bool,
    pub unavailable_reason: Option<String>,
    pub events_total: u64,
    pub ring_drops_total: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RiskStatus {
    pub signals: Vec<Signal>,
    pub throttled_classes: Vec<String>,
}
