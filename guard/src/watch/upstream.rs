//! The upstream's own state: Ollama's loaded models (`/api/ps`: how much of each is in GPU
//! memory) and which models are served from elsewhere (`/api/show`: remote_host), and
//! llama-server's busy and deferred requests (`/metrics`).

use std::{collections::HashMap, sync::RwLock};

use bytes::Bytes;
use http::{Method, Request};
use http_body_util::BodyExt as _;
use prometheus::{GaugeVec, IntGauge, Opts};

use crate::{
    config::{Api, Config},
    metrics::Metrics,
    proxy::Upstream,
};

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

    fn set(&self, model: &str, remote: bool) {
        self.0
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(model.to_owned(), remote);
    }
}

/// A model Ollama has loaded.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct LoadedModel {
    pub name: String,
    pub size_bytes: u64,
    pub size_vram_bytes: u64,
    pub cpu_offload_ratio: f64,
    pub expires_at: Option<String>,
}

/// Reads Ollama's /api/ps answer.
pub fn parse_ps(body: &serde_json::Value) -> Vec<LoadedModel> {
    body["models"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| {
            let name = m["name"]
                .as_str()
                .or_else(|| m["model"].as_str())?
                .to_owned();
            let size = m["size"].as_u64().unwrap_or(0);
            let vram = m["size_vram"].as_u64().unwrap_or(0);
            let cpu_offload_ratio = if size == 0 {
                0.0
            } else {
                1.0 - (vram.min(size) as f64 / size as f64)
            };
            Some(LoadedModel {
                name,
                size_bytes: size,
                size_vram_bytes: vram,
                cpu_offload_ratio,
                expires_at: m["expires_at"].as_str().map(str::to_owned),
            })
        })
        .collect()
}

pub struct UpstreamWatcher {
    upstream: Upstream,
    api: Api,
    up: IntGauge,
    offload: GaugeVec,
    remote: GaugeVec,
    busy: IntGauge,
    deferred: IntGauge,
}

impl UpstreamWatcher {
    pub fn new(metrics: &Metrics, config: &Config, upstream: Upstream) -> Self {
        let gauge_vec = |name: &str, help: &str| {
            let g = GaugeVec::new(Opts::new(name, help), &["model"]).expect("valid gauge");
            metrics.register(Box::new(g.clone()));
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
        }
    }

    /// One round; returns what /status shows of the upstream.
    pub async fn sample(&mut self, remote_models: &RemoteModels) -> serde_json::Value {
        match self.api {
            Api::Ollama => self.sample_ollama(remote_models).await,
            Api::Openai => self.sample_llama(remote_models).await,
        }
    }

    async fn sample_ollama(&mut self, remote_models: &RemoteModels) -> serde_json::Value {
        let Some(ps) = self.json(Method::GET, "/api/ps", None).await else {
            self.up.set(0);
            return serde_json::json!({ "up": false });
        };
        self.up.set(1);
        let loaded = parse_ps(&ps);
        self.offload.reset();
        for model in &loaded {
            self.offload
                .with_label_values(&[&model.name])
                .set(model.cpu_offload_ratio);
        }
        if let Some(tags) = self.json(Method::GET, "/api/tags", None).await {
            for name in tags["models"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|m| m["name"].as_str())
            {
                if remote_models.known(name) {
                    continue;
                }
                let show = self
                    .json(
                        Method::POST,
                        "/api/show",
                        Some(serde_json::json!({ "model": name })),
                    )
                    .await;
                if let Some(show) = show {
                    let remote = show.get("remote_host").is_some_and(|h| !h.is_null());
                    remote_models.set(name, remote || remote_models.is_remote(name));
                }
            }
            for name in tags["models"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|m| m["name"].as_str())
            {
                self.remote
                    .with_label_values(&[name])
                    .set(f64::from(u8::from(remote_models.is_remote(name))));
            }
        }
        serde_json::json!({ "up": true, "loaded_models": loaded })
    }

    async fn sample_llama(&mut self, remote_models: &RemoteModels) -> serde_json::Value {
        // The models it serves: only these may name a metric label.
        if let Some(models) = self.json(Method::GET, "/v1/models", None).await {
            for id in models["data"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|m| m["id"].as_str())
            {
                if !remote_models.known(id) {
                    remote_models.set(id, false);
                }
            }
        }
        let Some(text) = self.text(Method::GET, "/metrics", None).await else {
            self.up.set(0);
            return serde_json::json!({ "up": false });
        };
        self.up.set(1);
        let value = |name: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(name)?.trim().parse::<f64>().ok())
                .unwrap_or(0.0)
        };
        let (busy, deferred) = (
            value("llamacpp:requests_processing"),
            value("llamacpp:requests_deferred"),
        );
        self.busy.set(busy as i64);
        self.deferred.set(deferred as i64);
        serde_json::json!({ "up": true, "busy": busy, "deferred": deferred })
    }

    async fn json(
        &self,
        method: Method,
        path: &str,
        body: Option<serde_json::Value>,
    ) -> Option<serde_json::Value> {
        serde_json::from_str(&self.text(method, path, body).await?).ok()
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
    fn offload_is_the_share_outside_gpu_memory() {
        let ps = serde_json::json!({ "models": [
            { "name": "a:1b", "size": 1000, "size_vram": 1000, "expires_at": "2026-12-02T10:00:00Z" },
            { "name": "b:7b", "size": 1000, "size_vram": 480 },
            { "name": "c:cpu", "size": 1000, "size_vram": 0 },
        ]});
        let loaded = parse_ps(&ps);
        let ratios: Vec<f64> = loaded.iter().map(|m| m.cpu_offload_ratio).collect();
        assert_eq!(ratios, vec![0.0, 0.52, 1.0]);
        assert_eq!(
            loaded[0].expires_at.as_deref(),
            Some("2026-12-02T10:00:00Z")
        );
    }

    #[test]
    fn cloud_names_are_remote_before_any_lookup() {
        let remote = RemoteModels::default();
        assert!(remote.is_remote("gpt-oss:120b-cloud"));
        assert!(!remote.is_remote("smollm2:135m"));
        remote.set("smollm2:135m", true);
        assert!(remote.is_remote("smollm2:135m"));
    }
}
