//! The upstream's own state: Ollama's loaded models (`/api/ps`: how much of each is in GPU
//! memory) and which models are served from elsewhere (`/api/show`: remote_host), and
//! llama-server's busy and deferred requests (`/metrics`).

use std::{collections::HashMap, sync::RwLock};

use bytes::Bytes;
use http::{Method, Request};
use http_body_util::BodyExt as _;
use prometheus::IntGauge;
use serde::de::DeserializeOwned;

use crate::{
    config::{Api, Config},
    metrics::{
        Counters, Family, Gauges, Metrics,
        labels::{ByModel, Model},
    },
    upstream::{
        Client,
        api::{self, llama, ollama, openai},
    },
};

/// At most this many model names may label series: an upstream listing more is not a host.
const MAX_MODELS: usize = 1_024;

/// Models served from elsewhere, as far as guard has learnt (a privacy boundary).
#[derive(Default)]
pub struct RemoteModels(RwLock<HashMap<String, bool>>);

impl RemoteModels {
    /// Whether `model` runs elsewhere: Ollama's cloud names, or what /api/show said.
    pub fn is_remote(&self, model: &str) -> bool {
        model.ends_with("-cloud")
            || model.ends_with(":cloud")
            || self
                .0
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .get(model)
                .copied()
                .unwrap_or(false)
    }

    /// Whether the upstream has listed `model` (so a label may carry its name).
    pub fn known(&self, model: &str) -> bool {
        self.0
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .contains_key(model)
    }

    /// Records what guard learnt of `model`, up to `MAX_MODELS` names.
    fn set(&self, model: &str, remote: bool) {
        let mut models = self
            .0
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if models.len() < MAX_MODELS || models.contains_key(model) {
            models.insert(model.to_owned(), remote);
        }
    }
}

/// How many of guard's own requests run at the upstream now.
pub type RunningFn = std::sync::Arc<dyn Fn() -> usize + Send + Sync>;

/// The upstream's own state as /status shows it: whether it answers, and what its API tells.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct UpstreamState {
    pub up: bool,
    /// Ollama: the models it has loaded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loaded_models: Option<Vec<LoadedModel>>,
    /// llama-server: requests it is processing, and waiting in its own queue.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub busy: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deferred: Option<f64>,
    /// llama-server: its KV cache's usage, 0..1, where its `/metrics` says.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_usage: Option<f64>,
    /// llama-server: its slots (requests it works on at once), where `/slots` answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slots: Option<usize>,
}

impl UpstreamState {
    fn down() -> Self {
        Self::default()
    }
}

/// A model Ollama has loaded.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LoadedModel {
    pub name: String,
    pub size_bytes: u64,
    pub size_vram_bytes: u64,
    pub cpu_offload_ratio: f64,
    pub expires_at: Option<String>,
}

impl From<&ollama::Running> for LoadedModel {
    fn from(running: &ollama::Running) -> Self {
        Self {
            name: running.name().unwrap_or_default().to_owned(),
            size_bytes: running.size,
            size_vram_bytes: running.size_vram,
            cpu_offload_ratio: running.cpu_offload_ratio(),
            expires_at: running.expires_at.clone(),
        }
    }
}

pub struct UpstreamWatcher {
    upstream: Client,
    api: Api,
    /// Read llama-server's `/metrics` too (`watch.upstream_metrics`).
    read_metrics: bool,
    /// guard's own requests running at the upstream now (the scheduler's count).
    running: RunningFn,
    up: IntGauge,
    offload: Gauges<ByModel>,
    remote: Gauges<ByModel>,
    busy: IntGauge,
    deferred: IntGauge,
    /// The proxy counts cold loads; the watcher starts each model it sees at 0.
    cold_loads: Counters<ByModel>,
}

impl UpstreamWatcher {
    pub fn new(metrics: &Metrics, config: &Config, upstream: Client, running: RunningFn) -> Self {
        let gauge_vec = |name: &str, help: &str| {
            let g = Family::gauge(name, help);
            metrics.register(g.collector());
            g
        };
        let gauge = |name: &str, help: &str| {
            let g = IntGauge::new(name, help).expect("valid gauge");
            metrics.register(Box::new(g.clone()));
            g
        };
        Self {
            upstream,
            api: config.upstream.api,
            read_metrics: config.watch.upstream_metrics,
            running,
            up: gauge(
                "guard_upstream_up",
                "1 while the upstream answers its status endpoint.",
            ),
            offload: gauge_vec(
                "guard_model_cpu_offload_ratio",
                "Share of a loaded model not in GPU memory (Ollama /api/ps: 1 - size_vram/size).",
            ),
            remote: gauge_vec(
                "guard_model_remote",
                "1 for a model served from elsewhere (Ollama remote or cloud model): the privacy boundary moves.",
            ),
            busy: gauge(
                "guard_upstream_busy_requests",
                "Requests the upstream itself says it is processing (llama-server).",
            ),
            deferred: gauge(
                "guard_upstream_deferred_requests",
                "Requests waiting in the upstream's own queue (llama-server).",
            ),
            cold_loads: metrics.model_cold_loads_total.clone(),
        }
    }

    /// One round; returns what /status shows of the upstream.
    pub async fn sample(&mut self, remote_models: &RemoteModels) -> UpstreamState {
        match self.api {
            Api::Ollama => self.sample_ollama(remote_models).await,
            Api::Openai => self.sample_llama(remote_models).await,
        }
    }

    async fn sample_ollama(&mut self, remote_models: &RemoteModels) -> UpstreamState {
        let Some(ps) = self.json::<ollama::Ps>(Method::GET, "/api/ps", None).await else {
            self.up.set(0);
            return UpstreamState::down();
        };
        self.up.set(1);
        let loaded: Vec<LoadedModel> = ps.models.iter().map(LoadedModel::from).collect();
        self.offload.reset();
        for model in &loaded {
            let model_label = Model { model: &model.name };
            self.offload.of(&model_label).set(model.cpu_offload_ratio);
        }
        if let Some(tags) = self
            .json::<ollama::Tags>(Method::GET, "/api/tags", None)
            .await
        {
            for tag in &tags.models {
                self.learn(&tag.name, remote_models).await;
                self.saw(&tag.name, remote_models);
            }
        }
        UpstreamState {
            up: true,
            loaded_models: Some(loaded),
            ..UpstreamState::default()
        }
    }

    /// A model the upstream lists: once its name may label series, they exist from now on.
    fn saw(&self, model: &str, remote_models: &RemoteModels) {
        if !remote_models.known(model) {
            return;
        }
        let remote = f64::from(u8::from(remote_models.is_remote(model)));
        self.remote.of(&Model { model }).set(remote);
        self.cold_loads.of(&Model { model });
    }

    /// Asks Ollama once where a model it lists runs.
    async fn learn(&self, name: &str, remote_models: &RemoteModels) {
        if remote_models.known(name) {
            return;
        }
        let question = serde_json::json!({ "model": name });
        if let Some(show) = self
            .json::<ollama::Show>(Method::POST, "/api/show", Some(question))
            .await
        {
            let remote = show.remote_host.is_some();
            remote_models.set(name, remote || remote_models.is_remote(name));
        }
    }

    /// llama-server, read without disturbing it: `/v1/models` and `/props` answer from its
    /// cache and touch nothing (asleep, it stays asleep); `/slots` wakes a sleeping server and
    /// restarts an awake one's idle timer (`--sleep-idle-seconds`), so it is read only while
    /// guard's own requests run there (the server is awake and working then anyway); its
    /// `/metrics` resets its throughput gauges for every other scraper, so only where asked.
    async fn sample_llama(&mut self, remote_models: &RemoteModels) -> UpstreamState {
        // The models it serves: only these may name a metric label.
        let models = self
            .json::<openai::Models>(Method::GET, "/v1/models", None)
            .await;
        for model in models.iter().flat_map(|models| &models.data) {
            if !remote_models.known(&model.id) {
                remote_models.set(&model.id, false);
            }
            self.saw(&model.id, remote_models);
        }
        let props = self.json::<llama::Props>(Method::GET, "/props", None).await;
        let sleeping = props.as_ref().is_some_and(|p| p.is_sleeping);
        let own = (self.running)();
        let slots = match !sleeping && own > 0 {
            true => {
                self.json::<Vec<llama::Slot>>(Method::GET, "/slots", None)
                    .await
            }
            false => None,
        };
        let load = match self.read_metrics {
            true => self
                .text(Method::GET, "/metrics", None)
                .await
                .and_then(|text| llama::Load::parse(&text)),
            false => None,
        };
        // Up when it answers any of them: a server without `--metrics` or `--slots` serves.
        if models.is_none() && props.is_none() && slots.is_none() && load.is_none() {
            self.up.set(0);
            return UpstreamState::down();
        }
        self.up.set(1);
        // Without /metrics or /slots: what guard itself has running there (none while the
        // server sleeps), never the last reading left standing.
        let busy = load
            .map(|l| l.processing)
            .or_else(|| {
                let processing = slots.iter().flatten().filter(|s| s.is_processing).count();
                slots.as_ref().map(|_| processing as f64)
            })
            .unwrap_or(own as f64);
        self.busy.set(busy as i64);
        if let Some(load) = load {
            self.deferred.set(load.deferred as i64);
        }
        UpstreamState {
            up: true,
            busy: Some(busy),
            deferred: load.map(|l| l.deferred),
            kv_usage: load.and_then(|l| l.kv_usage),
            slots: slots
                .map(|slots| slots.len())
                .or_else(|| props.and_then(|p| p.total_slots)),
            ..UpstreamState::default()
        }
    }

    async fn json<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<serde_json::Value>,
    ) -> Option<T> {
        api::parse(self.text(method, path, body).await?.as_bytes())
    }

    async fn text(
        &self,
        method: Method,
        path: &str,
        body: Option<serde_json::Value>,
    ) -> Option<String> {
        let body = body.map_or(Bytes::new(), |b| Bytes::from(b.to_string()));
        let (head, ()) = Request::builder()
            .method(method)
            .uri(path)
            .body(())
            .ok()?
            .into_parts();
        let response = self.upstream.send_buffered(&head, body).await.ok()?;
        if !response.status().is_success() {
            return None;
        }
        let bytes = response.into_body().collect().await.ok()?.to_bytes();
        String::from_utf8(bytes.to_vec()).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cloud_names_are_remote_before_any_lookup() {
        let remote = RemoteModels::default();
        assert!(remote.is_remote("gpt-oss:120b-cloud"));
        assert!(!remote.is_remote("smollm2:135m"));
        remote.set("smollm2:135m", true);
        assert!(remote.is_remote("smollm2:135m"));
    }

    #[test]
    fn model_names_are_bounded() {
        let remote = RemoteModels::default();
        for n in 0..MAX_MODELS + 10 {
            remote.set(&format!("m{n}"), false);
        }
        assert!(remote.known("m0") && !remote.known(&format!("m{MAX_MODELS}")));
        remote.set("m0", true);
        assert!(remote.is_remote("m0"), "a known name is still updated");
    }
}
