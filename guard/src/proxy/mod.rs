//! The HTTP proxy from `server.listen` to the upstream inference server: generation endpoints
//! go through the class queues, everything else passes straight through.

pub mod budget;
pub mod error;
mod logged;
pub mod outcome;
mod passthrough;
mod request;
pub mod resumes;
mod serve;
mod throughput;

use std::{
    borrow::Cow,
    collections::BTreeMap,
    sync::{Arc, RwLock},
    time::Duration,
};

use guard_net::park::Inbound;
use http::{Method, Request, Response};

pub use error::{ErrorShape, ProxyError};
pub use guard_net::workers::{Workers, WorkersError};
use logged::{End, Line};
pub use serve::{serve, serve_connection, stop_requested};
pub use throughput::{Hourly, Throughput};

use crate::{
    classify::{Classifier, Tally},
    config::{Api, ClassTimeouts, Config},
    metrics::Metrics,
    proxy::outcome::Invalid,
    queue::Scheduler,
    reap::{
        EbpfTracker,
        registry::{Connection, Registry},
    },
    route::QueuedPaths,
    upstream::{
        Body, Client,
        exchange::{Connector, Dial},
    },
    watch::Watched,
};

/// The settings a SIGHUP can change.
struct Settings {
    classifier: Classifier,
    api: Api,
    body_limit: u64,
    /// The classes that may ask for a model served elsewhere.
    remote_allowed: std::collections::BTreeSet<String>,
    cold_load: Duration,
    timeouts: BTreeMap<String, ClassTimeouts>,
    /// Each class's preemptibility.
    preemptible: BTreeMap<String, crate::config::Preemptible>,
    /// What tells flows apart in the classes that do.
    fair_by: BTreeMap<String, crate::config::FairBy>,
    /// The classes whose answers must parse as JSON to count as valid jobs.
    expect_json: std::collections::BTreeSet<String>,
    /// Model names the config spells out: a `model` label may name them.
    named_models: std::collections::BTreeSet<String>,
    default_class: String,
    queued: QueuedPaths,
    max_passthrough: u32,
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
    /// What the queued requests share.
    queued: Arc<request::Shared>,
    passthrough: passthrough::Passthrough,
    connections: Arc<Registry>,
    settings: RwLock<Arc<Settings>>,
    header_read_timeout: Duration,
    max_connections: usize,
    /// Client connections hyper may keep between requests (`server.ready_connections`).
    ready_connections: usize,
}

/// The shared pieces a proxy is built from.
pub struct Parts {
    pub metrics: Metrics,
    pub scheduler: Arc<Scheduler>,
    pub connections: Arc<Registry>,
    pub tracker: Option<Arc<EbpfTracker>>,
    pub watched: Arc<Watched>,
    /// Where first-byte times go for the risk detector.
    pub ttft: Arc<crate::throttle::ttft::TtftWindow>,
    /// Where classification decisions are counted.
    pub tally: Arc<Tally>,
    /// Where finished jobs are counted for the last hour.
    pub throughput: Arc<Throughput>,
    /// Where each class's way of going on after a preemption is kept.
    pub resume_kinds: Arc<resumes::ResumeKinds>,
    /// Where each request's access log line goes.
    pub access: crate::access::AccessLog,
}

impl Proxy {
    /// A proxy to the upstream of `config`, over TCP.
    pub fn new(config: &Config, parts: Parts) -> Result<Self, ProxyError> {
        let authority = config.upstream.url.authority();
        let dial = Dial::Tcp {
            authority: authority.to_string(),
            connect_timeout: Duration::from_millis(config.upstream.connect_timeout_ms),
        };
        Self::with_dial(config, parts, dial)
    }

    /// A proxy whose queued requests reach the upstream as `dial` says.
    pub fn with_dial(config: &Config, parts: Parts, dial: Dial) -> Result<Self, ProxyError> {
        for class in config.class.keys() {
            outcome::init_class(&parts.metrics, class);
        }
        outcome::init_invalid(&parts.metrics);
        parts
            .connections
            .set_half_close_means_gone(config.server.half_close_means_gone);
        let settings = Settings::from(config);
        parts.tally.prepare(&settings.classifier);
        let passthrough = passthrough::Passthrough::new(&config.upstream, &parts.metrics);
        let queued = request::Shared {
            upstream: Client::new(&config.upstream),
            connector: Connector::new(dial, config.upstream.max_concurrency as usize),
            response_timeout: Duration::from_millis(config.upstream.response_timeout_ms),
            budget: budget::BodyBudget::new(
                config.server.max_body_bytes_in_flight,
                parts.metrics.body_bytes_in_flight.clone(),
            ),
            metrics: parts.metrics,
            scheduler: parts.scheduler,
            tracker: parts.tracker,
            watched: parts.watched,
            ttft: parts.ttft,
            tally: parts.tally,
            throughput: parts.throughput,
            resume_kinds: parts.resume_kinds,
            flow_keys: std::hash::RandomState::new(),
            access: parts.access,
        };
        Ok(Self {
            queued: Arc::new(queued),
            passthrough,
            connections: parts.connections,
            settings: RwLock::new(Arc::new(settings)),
            header_read_timeout: config.header_read_timeout(),
            max_connections: config.server.max_connections as usize,
            ready_connections: config.server.ready_connections as usize,
        })
    }

    /// Applies a reloaded config's classes, limits and rules. Queued and running requests
    /// keep their place.
    pub fn reload(&self, config: &Config) {
        let queued = &self.queued;
        for class in config.class.keys() {
            outcome::init_class(&queued.metrics, class);
        }
        queued.scheduler.reconfigure(config);
        queued
            .connector
            .set_idle_max(config.upstream.max_concurrency as usize);
        queued
            .budget
            .set_cap(config.server.max_body_bytes_in_flight);
        self.connections
            .set_half_close_means_gone(config.server.half_close_means_gone);
        let settings = Settings::from(config);
        queued.tally.prepare(&settings.classifier);
        *self
            .settings
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Arc::new(settings);
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
        self.connections.half_close_means_gone()
    }

    /// Handles one request on `connection`: generation work waits in its class's queue,
    /// everything else passes through.
    async fn handle(
        self: &Arc<Self>,
        request: Request<Inbound>,
        connection: &Arc<Connection>,
    ) -> Response<Body> {
        let settings = self.settings();
        let shape = error_shape(request.uri().path(), settings.api);
        let (queued, path) = match sort(&request, &settings) {
            Ok(sorted) => sorted,
            Err((reason, error)) => {
                return self.bad_request(reason, error, connection, shape, &request);
            }
        };
        if queued {
            let queued = Arc::clone(&self.queued);
            return request::handle(queued, settings, request, connection).await;
        }
        let line = Line::begin(&self.queued, connection, request.method(), &path);
        // Boxed: hyper keeps room for this future in every connection, idle or not, and the
        // pass-through client's state is most of it.
        let limit = settings.max_passthrough;
        Box::pin(self.passthrough.handle(limit, request, shape, line)).await
    }

    /// A request head hyper refused and answered itself (400, or 431 where too large):
    /// counted and logged, with no method or path (they were never read). Nothing for an
    /// HTTP/2 preface, which hyper closes without a word. (A fault inside hyper's parser,
    /// which it asks to have reported and does not answer, counts as malformed: its public
    /// error cannot tell them apart.)
    pub(super) fn unread_head(&self, error: &hyper::Error, connection: &Arc<Connection>) {
        if !error.is_parse() || error.is_parse_version_h2() || error.is_parse_status() {
            return;
        }
        // Too large is 431: a URI too long for 414 (64 KiB) cannot fit in the read buffer
        // (asserted beside `serve::READ_BUFFER`).
        let (status, reason) = if error.is_parse_too_large() {
            (431, Invalid::HeadTooLarge)
        } else {
            (400, Invalid::MalformedHead)
        };
        outcome::invalid(&self.queued.metrics, reason.as_str());
        if let Some(line) = Line::unread(&self.queued, connection) {
            line.finish(End {
                status,
                outcome: "invalid",
                reason: Some(reason.as_str()),
                bytes_in: 0,
                bytes_out: 0,
            });
        }
    }

    /// Refused before anything else: 400 (405 for a method), and the connection closes after
    /// it (a body, if any, unread).
    fn bad_request(
        &self,
        reason: Invalid,
        error: ProxyError,
        connection: &Arc<Connection>,
        shape: ErrorShape,
        request: &Request<Inbound>,
    ) -> Response<Body> {
        outcome::invalid(&self.queued.metrics, reason.as_str());
        let raw = request.uri().path();
        let path = crate::route::normalize(raw);
        let path = path.as_deref().unwrap_or(raw);
        let line = Line::begin(&self.queued, connection, request.method(), path);
        let mut response = error.into_response(shape);
        response.headers_mut().insert(
            http::header::CONNECTION,
            http::HeaderValue::from_static("close"),
        );
        connection.linger();
        if let Some(line) = line {
            line.tag(&mut response);
            line.finish(End {
                status: response.status().as_u16(),
                outcome: "invalid",
                reason: Some(reason.as_str()),
                bytes_in: 0,
                bytes_out: http_body::Body::size_hint(response.body())
                    .exact()
                    .unwrap_or(0),
            });
        }
        response
    }
}

/// Whether a request is queued, passed through, or refused here: a method guard never passes
/// on, a length two parties could read two ways, a path the upstream cannot decode. With it,
/// the path as the upstream decodes it.
fn sort<'r>(
    request: &'r Request<Inbound>,
    settings: &Settings,
) -> Result<(bool, Cow<'r, str>), (Invalid, ProxyError)> {
    if !passes_on(request.method()) {
        let method = request.method().clone();
        return Err((Invalid::Method, ProxyError::MethodNotAllowed { method }));
    }
    framing(request.headers()).map_err(|reason| (Invalid::Framing, ProxyError::Framing(reason)))?;
    let path = crate::route::normalize(request.uri().path())
        .map_err(|err| (Invalid::BadPath, ProxyError::from(err)))?;
    let queued = settings.queued.contains_normalized(&path) && request.method() == Method::POST;
    Ok((queued, path))
}

/// Whether guard passes a request of this method on. `CONNECT` asks for a tunnel (hyper would
/// hand the connection over on a 2xx, and the upstream would wait for bytes that never come),
/// `TRACE` echoes the request's headers back (credentials included): guard answers both itself.
fn passes_on(method: &Method) -> bool {
    *method != Method::CONNECT && *method != Method::TRACE
}

/// A request whose length two parties could read two ways (RFC 9112 §6.3): a
/// `Content-Length` beside `Transfer-Encoding`, or several lengths. Refused, never forwarded.
/// hyper itself answers 400 to differing lengths, and reads a request with both by its
/// `Transfer-Encoding` alone, drops the length and closes the connection after the answer
/// (RFC 9112 §6.1); this check is for what reaches guard regardless.
fn framing(headers: &http::HeaderMap) -> Result<(), &'static str> {
    let lengths = headers.get_all(http::header::CONTENT_LENGTH).iter().count();
    if lengths > 0 && headers.contains_key(http::header::TRANSFER_ENCODING) {
        return Err("Content-Length and Transfer-Encoding together");
    }
    if lengths > 1 {
        return Err("more than one Content-Length");
    }
    Ok(())
}

impl From<&Config> for Settings {
    fn from(config: &Config) -> Self {
        Self {
            classifier: Classifier::new(config),
            api: config.upstream.api,
            body_limit: config.server.body_limit_bytes,
            remote_allowed: config
                .class
                .iter()
                .filter(|(_, class)| {
                    class
                        .allow_remote_models
                        .unwrap_or(!config.upstream.refuse_remote_models)
                })
                .map(|(name, _)| name.clone())
                .collect(),
            cold_load: Duration::from_millis(config.watch.cold_load_ms),
            named_models: config.named_models().into_iter().collect(),
            timeouts: config
                .class
                .iter()
                .map(|(name, class)| (name.clone(), class.timeouts()))
                .collect(),
            preemptible: config
                .class
                .iter()
                .map(|(name, class)| (name.clone(), class.preemptible))
                .collect(),
            fair_by: config
                .class
                .iter()
                .filter_map(|(name, class)| Some((name.clone(), class.fair_by.clone()?)))
                .collect(),
            expect_json: config
                .class
                .iter()
                .filter(|(_, class)| class.expect == Some(crate::config::Expect::Json))
                .map(|(name, _)| name.clone())
                .collect(),
            default_class: config.classify.default.clone(),
            queued: QueuedPaths::new(config.server.queued_paths.iter().map(String::as_str)),
            max_passthrough: config.upstream.max_passthrough,
        }
    }
}

/// The model and output tokens guard reads from a request body (for fuzzing).
pub fn read_asks(body: &[u8]) -> (Option<String>, Option<u64>) {
    let asks = request::read_asks(body);
    (asks.0, asks.1)
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
