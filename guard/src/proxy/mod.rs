//! The HTTP proxy from `server.listen` to the upstream inference server.

pub mod error;
pub mod upstream;

use std::{convert::Infallible, sync::Arc, time::Duration};

use http::{Request, Response};
use http_body_util::BodyExt as _;
use hyper::{body::Incoming, server::conn::http1, service::service_fn};
use hyper_util::{
    rt::{TokioIo, TokioTimer},
    server::graceful::GracefulShutdown,
};
use tokio::{net::TcpListener, sync::watch};

pub use error::{ErrorShape, ProxyError};
pub use upstream::{Body, Upstream};

use crate::{
    config::{Api, Config},
    metrics::Metrics,
};

/// What every connection handler shares.
pub struct Proxy {
    upstream: Upstream,
    metrics: Metrics,
    api: Api,
    header_read_timeout: Duration,
}

impl Proxy {
    pub fn new(config: &Config, metrics: Metrics) -> Result<Self, ProxyError> {
        Ok(Self {
            upstream: Upstream::new(&config.upstream)?,
            metrics,
            api: config.upstream.api,
            header_read_timeout: config.header_read_timeout(),
        })
    }

    /// Handles one request: passes it to the upstream and relays the answer as it arrives.
    async fn handle(&self, request: Request<Incoming>) -> Response<Body> {
        let shape = error_shape(request.uri().path(), self.api);
        let request = request.map(|body| body.boxed());
        let response = match self.upstream.send(request).await {
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
        let connection = http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(proxy.header_read_timeout)
            .keep_alive(true)
            .serve_connection(TokioIo::new(stream), {
                let proxy = Arc::clone(&proxy);
                service_fn(move |request| {
                    let proxy = Arc::clone(&proxy);
                    async move { Ok::<_, Infallible>(proxy.handle(request).await) }
                })
            });
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            if let Err(err) = connection.await {
                tracing::debug!(%peer, %err, "client connection ended with an error");
            }
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
