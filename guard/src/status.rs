//! The status document: one struct, built by the daemon from each part's owner (the scheduler,
//! the risk detector, the throttler, the eBPF state, the watchers), served as `/status`, and
//! read back by `guard status`, which prints it as a table.

use bytes::Bytes;
use http_body_util::{BodyExt as _, Empty};
use hyper_util::{client::legacy::Client, rt::TokioExecutor};

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

#[derive(Debug, thiserror::Error)]
pub enum StatusError {
    #[error("`{url}` is not a URL: {reason}")]
    BadUrl { url: String, reason: String },
    #[error(
        "no guard answered at {url}: {reason} (is `guard run` running, and is this its metrics.listen?)"
    )]
    Unreachable { url: String, reason: String },
    #[error("{url} wants a bearer token: pass --token-file (metrics.bearer_token_file)")]
    Unauthorized { url: String },
    #[error("{url} answered something that is not guard's status: {reason}")]
    NotStatus { url: String, reason: String },
}

/// Fetches `<base>/status` (with the bearer token, where one is given) and renders it.
pub async fn show(base: &str, token: Option<&str>) -> Result<String, StatusError> {
    let url = format!("{}/status", base.trim_end_matches('/'));
    let uri: http::Uri = url
        .parse()
        .map_err(|err: http::uri::InvalidUri| StatusError::BadUrl {
            url: url.clone(),
            reason: err.to_string(),
        })?;
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    let unreachable = |reason: String| StatusError::Unreachable {
        url: url.clone(),
        reason,
    };
    let mut request = http::Request::get(uri);
    if let Some(token) = token {
        request = request.header(http::header::AUTHORIZATION, format!("Bearer {token}"));
    }
    let request = request
        .body(Empty::new())
        .map_err(|err| unreachable(err.to_string()))?;
    let response = client
        .request(request)
        .await
        .map_err(|err| unreachable(err.to_string()))?;
    if response.status() == http::StatusCode::UNAUTHORIZED {
        return Err(StatusError::Unauthorized { url });
    }
    let body = response
        .into_body()
        .collect()
        .await
        .map_err(|err| unreachable(err.to_string()))?
        .to_bytes();
    let status: Status = serde_json::from_slice(&body).map_err(|err| StatusError::NotStatus {
        url: url.clone(),
        reason: err.to_string(),
    })?;
    Ok(render(&status))
}

/// guard's concurrency beside the server's own slots, where it lists them: more than the
/// slots only moves the queue into the server, where guard cannot order or reap it.
fn concurrency(status: &Status) -> String {
    let max = status.upstream.max_concurrency;
    let slots = status.watch.upstream.as_ref().and_then(|u| u.slots);
    match slots {
        Some(slots) if max as usize > slots => format!(
            "{max} (the upstream has {slots} slots: lower upstream.max_concurrency to {slots})"
        ),
        Some(slots) => format!("{max} (the upstream has {slots} slots)"),
        None => max.to_string(),
    }
}

/// The status document as a readable table.
pub fn render(status: &Status) -> String {
    let mut out = String::new();
    let mut line = |key: &str, value: String| out.push_str(&format!("{key:<18} {value}\n"));
    line("version", status.version.clone());
    line("uptime", format!("{} s", status.uptime_seconds));
    line("listen", status.listen.clone());
    line("upstream", status.upstream.url.clone());
    line("concurrency", concurrency(status));
    let ebpf = &status.ebpf;
    line(
        "ebpf",
        match &ebpf.unavailable_reason {
            None if ebpf.attached => format!(
                "attached ({} events, {} dropped)",
                ebpf.events_total, ebpf.ring_drops_total
            ),
            reason => format!("off: {}", reason.as_deref().unwrap_or("-")),
        },
    );
    let list = |items: Vec<String>| match items.is_empty() {
        true => "none".to_owned(),
        false => items.join(", "),
    };
    let signals = status.risk.signals.iter().map(|s| s.as_str().to_owned());
    line("at risk", list(signals.collect()));
    line("throttled", list(status.risk.throttled_classes.clone()));
    line("capabilities", list(status.capabilities.clone()));
    let cluster = &status.cluster;
    line("haproxy agent", cluster.agent.clone());
    line(
        "llm-d router",
        format!(
            "waiting {}, running {}, kv usage {:.2}",
            cluster.waiting, cluster.running, cluster.usage
        ),
    );
    out.push_str(&format!(
        "\n{:<14} {:>8} {:>9} {:>11} {:>7} {:>8} {:>9}\n",
        "class", "priority", "max_queue", "deadline_ms", "queued", "running", "wait_ms"
    ));
    for class in &status.classes {
        let deadline = class
            .deadline_ms
            .map_or_else(|| "-".to_owned(), |d| d.to_string());
        out.push_str(&format!(
            "{:<14} {:>8} {:>9} {:>11} {:>7} {:>8} {:>9}\n",
            class.name,
            class.priority,
            class.max_queue,
            deadline,
            class.queued,
            class.running,
            class.predicted_wait_ms,
        ));
    }
    out.push_str(&format!(
        "\n{:<14} {:>10} {:>12} {:>14} {:>16}\n",
        "last hour", "valid jobs", "invalid jobs", "prompt tokens", "generated tokens"
    ));
    for (class, hour) in &status.last_hour {
        out.push_str(&format!(
            "{class:<14} {:>10} {:>12} {:>14} {:>16}\n",
            hour.valid_jobs, hour.invalid_jobs, hour.prompt_tokens, hour.generated_tokens
        ));
    }
    if !status.preemption.is_empty() {
        out.push_str(&format!(
            "\n{:<14} {:>12}  {}\n",
            "preemptible", "setting", "goes on"
        ));
    }
    for (class, preempt) in &status.preemption {
        let setting = serde_json::to_string(&preempt.preemptible).unwrap_or_default();
        let resume = match preempt.resume {
            Some(kind) => serde_json::to_string(&kind).unwrap_or_default(),
            None => "(no request yet)".to_owned(),
        };
        out.push_str(&format!(
            "{class:<14} {setting:>12}  {}\n",
            resume.trim_matches('"')
        ));
    }
    out.push_str(&format!("\n{:<14} {}\n", "class", "sent by"));
    for (class, by) in &status.classified {
        let by: Vec<String> = by.iter().map(|(by, n)| format!("{by}: {n}")).collect();
        out.push_str(&format!("{class:<14} {}\n", by.join(", ")));
    }
    out
}
