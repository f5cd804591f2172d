//! The model-server view the llm-d router's endpoint picker scrapes by default, in vLLM's
//! names: requests waiting, requests running, and a 0..1 KV-cache usage.

use prometheus::{Encoder as _, Gauge, IntGauge, Registry, TextEncoder};

use super::ClusterView;

/// The three series, in a registry of their own (the picker reads nothing else there).
pub struct ModelServer {
    registry: Registry,
    waiting: IntGauge,
    running: IntGauge,
    usage: Gauge,
}

impl ModelServer {
    pub fn new() -> Result<Self, prometheus::Error> {
        let registry = Registry::new();
        let waiting = IntGauge::new(
            "vllm:num_requests_waiting",
            "Requests waiting: in guard's class queues and the server's own queue.",
        )?;
        let running = IntGauge::new(
            "vllm:num_requests_running",
            "Requests guard has sent to the server and not yet seen end.",
        )?;
        let usage = Gauge::new(
            "vllm:kv_cache_usage_perc",
            "The server's KV-cache usage (0..1) where it reports it, else guard's saturation.",
        )?;
        registry.register(Box::new(waiting.clone()))?;
        registry.register(Box::new(running.clone()))?;
        registry.register(Box::new(usage.clone()))?;
        Ok(Self {
            registry,
            waiting,
            running,
            usage,
        })
    }

    /// The Prometheus text for `view`.
    pub fn render(&self, view: &ClusterView) -> String {
        self.waiting
            .set(i64::try_from(view.waiting).unwrap_or(i64::MAX));
        self.running
            .set(i64::try_from(view.running).unwrap_or(i64::MAX));
        self.usage.set(view.usage);
        let mut out = Vec::new();
        if let Err(err) = TextEncoder::new().encode(&self.registry.gather(), &mut out) {
            let error = crate::error_chain(&err);
            tracing::warn!(%error, "cannot render the model-server view");
        }
        String::from_utf8(out).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_view_renders_in_vllm_names() {
        let server = ModelServer::new().expect("registry");
        let text = server.render(&ClusterView {
            agent: String::new(),
            waiting: 3,
            running: 1,
            usage: 0.5,
        });
        for line in [
            "vllm:num_requests_waiting 3",
            "vllm:num_requests_running 1",
            "vllm:kv_cache_usage_perc 0.5",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} in {text}");
        }
    }
}
