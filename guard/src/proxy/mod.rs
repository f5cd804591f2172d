//! The HTTP proxy from `server.listen` to the upstream inference server: generation endpoints
//! go through the class queues, everything else passes straight through.

mod client_body;
pub mod error;
pub mod exchange;
pub mod outcome;
mod request;
mod serve;
pub mod upstream;

use std::{
    collections::BTreeMap,
    net::SocketAddr,
    sync::{
        Arc, RwLock,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use bytes::Bytes;
use http::{Method, Request, Response};
use http_body_util::BodyExt as _;
use hyper::body::{Body as _, Incoming};

pub use error::{ErrorShape, ProxyError};
pub use exchange::{Connector, Dial};
pub use serve::{serve, serve_connection, stop_requested};
pub use upstream::{Body, Upstream};

use crate::{
    classify::Classifier,
    config::{Api, ClassTimeouts, Config},
    metrics::Metrics,
    queue::Scheduler,
    reap::{EbpfTracker, registry::Registry},
    watch::Watched,
};

/// Endpoints whose requests wait in the class queues (docs/design.md §6).
const QUEUED_PATHS: &[&str] = &[
    "/api/generate",
    "/api/chat",
    "/api/embed",
    "/api/embeddings",
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/completion",
];

/// The settings a SIGHUP can change.
struct Settings {
    classifier: Classifier,
    api: Api,
    body_limit: u64,
    refuse_remote_models: bool,
    cold_load: Duration,
    timeouts: BTreeMap<String, ClassTimeouts>,
    default_class: String,
}

impl Settings {
    /// A class's timeouts (the default class's for a name a reload removed).
    fn timeouts(&self, class: &str) -> ClassTimeouts {
        self.timeouts
            .get(class)
            .or_else(|| self.timeouts.get(&self.default_class))
            .copied()
            .unwrap_or_else(|| crate::config::ClassConfig::new(0, 0, None).timeouts())
    }
}

/// What every connection handler shares.
pub struct Proxy {
    upstream: Upstream,
    connector: Arc<Connector>,
    response_timeout: Duration,
    metrics: Metrics,
    scheduler: Arc<Scheduler>,
    connections: Arc<Registry>,
    tracker: Option<Arc<EbpfTracker>>,
    settings: RwLock<Arc<Settings>>,
    header_read_timeout: Duration,
    listen: SocketAddr,
    half_close_means_gone: Arc<AtomicBool>,
    remote_models: Arc<Watched>,
}

/// The shared pieces a proxy is built from.
pub struct Parts {
    pub metrics: Metrics,
    pub scheduler: Arc<Scheduler>,
    pub connections: Arc<Registry>,
    pub tracker: Option<Arc<EbpfTracker>>,
    pub half_close_means_gone: Arc<AtomicBool>,
    pub watched: Arc<Watched>,
}

impl Proxy {
    /// A proxy to the upstream of `config`, over TCP.
    pub fn new(config: &Config, parts: Parts) -> Result<Self, ProxyError> {
        let authority =
            crate::config::upstream_authority(&config.upstream.url).map_err(ProxyError::Config)?;
        let dial = Dial::Tcp {
            authority: authority.to_string(),
            connect_timeout: Duration::from_millis(config.upstream.connect_timeout_ms),
        };
        Self::with_dial(config, parts, dial)
    }

    /// A proxy whose queued requests reach the upstream as `dial` says.
    pub fn with_dial(config: &Config, parts: Parts, dial: Dial) -> Result<Self, ProxyError> {
        Ok(Self {
            upstream: Upstream::new(&config.upstream)?,
            connector: Connector::new(dial),
            response_timeout: Duration::from_millis(config.upstream.response_timeout_ms),
            metrics: parts.metrics,
            scheduler: parts.scheduler,
            connections: parts.connections,
            tracker: parts.tracker,
            settings: RwLock::new(Arc::new(Settings::from(config))),
            header_read_timeout: config.header_read_timeout(),
            listen: config.server.listen,
            half_close_means_gone: parts.half_close_means_gone,
            remote_models: parts.watched,
        })
    }

    /// Applies a reloaded config's classes, limits and rules. Queued and running requests
    /// keep their place.
    pub fn reload(&self, config: &Config) {
        self.scheduler.reconfigure(config);
        *self
            .settings
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Arc::new(Settings::from(config));
    }

    fn settings(&self) -> Arc<Settings> {
        Arc::clone(
            &self
                .settings
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    }

    fn half_close_means_gone(&self) -> bool {
        self.half_close_means_gone.load(Ordering::Relaxed)
    }

    /// Handles one request on `connection`.
    async fn handle(
        self: &Arc<Self>,
        request: Request<Incoming>,
        connection: &Arc<crate::reap::registry::Connection>,
    ) -> Response<Body> {
        let settings = self.settings();
        if request.method() == Method::POST && QUEUED_PATHS.contains(&request.uri().path()) {
            return request::handle(Arc::clone(self), settings, request, connection).await;
        }
        let shape = error_shape(request.uri().path(), settings.api);
        // A request without a body (GET /api/tags, /v1/models) can be sent again safely.
        let sent = if request.body().is_end_stream() {
            let (head, _) = request.into_parts();
            self.upstream.send_buffered(&head, Bytes::new()).await
        } else {
            let request = request.map(|body| body.map_err(Into::into).boxed());
            self.upstream.send(request).await
        };
        let response = match sent {
            Ok(response) => response.map(|body| body.map_err(Into::into).boxed()),
            Err(err) => err.into_response(shape),
        };
        self.metrics
            .passthrough_requests_total
            .with_label_values(&[response.status().as_str()])
            .inc();
        response
    }
}

impl From<&Config> for Settings {
    fn from(config: &Config) -> Self {
        Self {
            classifier: Classifier::new(config),
            api: config.upstream.api,
            body_limit: config.server.body_limit_bytes,
            refuse_remote_models: config.upstream.refuse_remote_models,
            cold_load: Duration::from_millis(config.watch.cold_load_ms),
            timeouts: config
                .class
                .iter()
                .map(|(name, class)| (name.clone(), class.timeouts()))
                .collect(),
            default_class: config.classify.default.clone(),
        }
    }
}

/// The error shape for a path: each API's own paths get its shape, others the upstream's.
pub fn error_shape(path: &str, api: Api) -> ErrorShape {
    if path.starts_with("/v1/") {
        ErrorShape::Openai
    } else if path.starts_with("/api/") {
        ErrorShape::Ollama
    } else {
        match api {
            Api::Ollama => ErrorShape::Ollama,
            Api::Openai => ErrorShape::Openai,
        }
    }
}

#[cfg(test)]
mod tests;
