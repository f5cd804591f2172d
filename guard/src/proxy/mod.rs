//! The HTTP proxy from `server.listen` to the upstream inference server: generation endpoints
//! go through the class queues, everything else passes straight through.

pub mod error;
mod queued;
mod record;
mod relay;
pub mod upstream;

use std::{
    convert::Infallible,
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
use hyper::{
    body::{Body as _, Incoming},
    server::conn::http1,
    service::service_fn,
};
use hyper_util::{
    rt::{TokioIo, TokioTimer},
    server::graceful::GracefulShutdown,
};
use tokio::{net::TcpListener, sync::watch};

pub use error::{ErrorShape, ProxyError};
pub use upstream::{Body, Upstream};

use crate::{
    classify::Classifier,
    config::{Api, Config},
    metrics::Metrics,
    queue::Scheduler,
    reap::{
        EbpfTracker,
        registry::{Connection, Registry},
        userspace,
    },
    watch::Watched,
};

/// Endpoints whose requests wait in the class queues (DESIGN section 6).
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
}

/// What every connection handler shares.
pub struct Proxy {
    upstream: Upstream,
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

impl Proxy {
    pub fn new(
        config: &Config,
        metrics: Metrics,
        scheduler: Arc<Scheduler>,
        connections: Arc<Registry>,
        tracker: Option<Arc<EbpfTracker>>,
        half_close_means_gone: Arc<AtomicBool>,
        watched: Arc<Watched>,
    ) -> Result<Self, ProxyError> {
        Ok(Self {
            upstream: Upstream::new(&config.upstream)?,
            metrics,
            scheduler,
            connections,
            tracker,
            settings: RwLock::new(Arc::new(Settings::from(config))),
            header_read_timeout: config.header_read_timeout(),
            listen: config.server.listen,
            half_close_means_gone,
            remote_models: watched,
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

    /// Handles one request on `connection`.
    async fn handle(
        &self,
        request: Request<Incoming>,
        connection: &Arc<Connection>,
    ) -> Response<Body> {
        let settings = self.settings();
        if request.method() == Method::POST && QUEUED_PATHS.contains(&request.uri().path()) {
            return self.queued(request, connection, &settings).await;
        }
        let shape = error_shape(request.uri().path(), settings.api);
        // A request without a body (GET /api/tags, /v1/models) can be sent again safely.
        let sent = if request.body().is_end_stream() {
            let (head, _) = request.into_parts();
            self.upstream.send_buffered(&head, Bytes::new()).await
        } else {
            self.upstream.send(request.map(|body| body.boxed())).await
        };
        let response = match sent {
            Ok(response) => response.map(|body| body.boxed()),
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

/// Accepts connections until `shutdown` turns true, then waits for open connections to
/// finish their current request, at most `grace`.
pub async fn serve(
    listener: TcpListener,
    proxy: Arc<Proxy>,
    mut shutdown: watch::Receiver<bool>,
    grace: Duration,
) {
    let graceful = GracefulShutdown::new();
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(err) => {
                    // EMFILE and friends: back off briefly instead of spinning.
                    tracing::warn!(%err, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = stop_requested(&mut shutdown) => break,
        };
        let _ = stream.set_nodelay(true);
        let connection = proxy.connections.register(peer);
        // Without the kernel's events, watch the socket from user space.
        let watched = match proxy.tracker {
            Some(_) => None,
            None => userspace::duplicate(&stream)
                .inspect_err(
                    |err| tracing::warn!(%peer, %err, "cannot watch this client for closes"),
                )
                .ok(),
        };
        let service = {
            let proxy = Arc::clone(&proxy);
            let connection = Arc::clone(&connection);
            service_fn(move |request| {
                let proxy = Arc::clone(&proxy);
                let connection = Arc::clone(&connection);
                async move { Ok::<_, Infallible>(proxy.handle(request, &connection).await) }
            })
        };
        let half_close = proxy.half_close_means_gone.load(Ordering::Relaxed);
        let serving = http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(proxy.header_read_timeout)
            .keep_alive(true)
            // hyper, too, ends a connection whose client half-closed with a request pending,
            // unless told that clients may half-close on purpose.
            .half_close(!half_close)
            .serve_connection(TokioIo::new(stream), service);
        let serving = graceful.watch(serving);
        let proxy = Arc::clone(&proxy);
        tokio::spawn(async move {
            let watch = async {
                match watched {
                    Some(socket) => userspace::watch(socket, &connection, half_close).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                biased;
                // The client left: dropping the connection drops its requests (reaped) and
                // with them any upstream request in flight.
                () = connection.gone() => {}
                () = watch => {}
                result = serving => {
                    if let Err(err) = result {
                        tracing::debug!(%peer, %err, "client connection ended with an error");
                    }
                }
            }
            proxy.connections.unregister(&connection);
        });
    }
    drop(listener);
    if tokio::time::timeout(grace, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!(
            grace_ms = grace.as_millis(),
            "connections still open after the grace period"
        );
    }
}

/// Resolves once `shutdown` is true (or its sender is gone).
pub async fn stop_requested(shutdown: &mut watch::Receiver<bool>) {
    // The guard wait_for returns is not Send: drop it here, not in the caller's select.
    let _ = shutdown.wait_for(|stop| *stop).await;
}
