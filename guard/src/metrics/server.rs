//! The metrics listener: `GET /metrics` (Prometheus text), `GET /status` (JSON), and one more
//! text endpoint (the model-server view, `cluster.model_server_path`).

use std::{convert::Infallible, sync::Arc, time::Duration};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::Full;
use hyper::{body::Incoming, server::conn::http1, service::service_fn};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;

use super::Metrics;
use guard_net::listen::{Accepted, Acceptor, Arrival};

/// Produces the `/status` document (JSON), and brings metrics read from elsewhere up to date.
pub type StatusFn = Arc<dyn Fn() -> String + Send + Sync>;

/// One more text endpoint on the listener (the model-server view): its path and its text.
#[derive(Clone)]
pub struct Extra {
    pub path: String,
    pub render: Arc<dyn Fn() -> String + Send + Sync>,
}

/// How the metrics listener is bounded: scrapers are few, and none may hold it up.
#[derive(Clone, Debug)]
pub struct Limits {
    pub max_connections: usize,
    pub header_read_timeout: Duration,
    /// The token both endpoints then require (`metrics.bearer_token_file`).
    pub bearer: Option<crate::secret::Secret>,
}

/// Serves until the task is dropped. Connections over the cap are closed at once; a scraper
/// must send its request head within the header timeout. Whatever happens here, the proxy
/// listener is another task and another socket.
pub async fn serve(
    listeners: Vec<TcpListener>,
    metrics: Metrics,
    status: StatusFn,
    limits: Limits,
    extra: Extra,
) {
    let refused = metrics
        .connections_refused_total
        .of(&super::labels::Listener {
            listener: "metrics",
        });
    let mut acceptor = Acceptor::new(listeners, "metrics", limits.max_connections, refused);
    loop {
        let Arrival::Accepted(Accepted { stream, place, .. }) = acceptor.next().await else {
            // Over the cap: closed as it is dropped.
            continue;
        };
        let metrics = metrics.clone();
        let status = Arc::clone(&status);
        let bearer = limits.bearer.clone();
        let extra = extra.clone();
        tokio::spawn(async move {
            let service = service_fn(move |request| {
                let response = match &bearer {
                    Some(secret) if !secret.authorizes(request.headers()) => unauthorized(),
                    _ if request.method() == Method::GET && request.uri().path() == extra.path => {
                        text((extra.render)())
                    }
                    _ => respond(&request, &metrics, &status),
                };
                async move { Ok::<_, Infallible>(response) }
            });
            if let Err(err) = http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_read_timeout)
                .max_buf_size(16 << 10)
                .max_header_size(8 << 10)
                .serve_connection(TokioIo::new(stream), service)
                .await
            {
                tracing::debug!(%err, "metrics connection ended with an error");
            }
            drop(place);
        });
    }
}

fn respond(
    request: &Request<Incoming>,
    metrics: &Metrics,
    status: &StatusFn,
) -> Response<Full<Bytes>> {
    if request.method() != Method::GET {
        return plain(StatusCode::METHOD_NOT_ALLOWED, "use GET\n");
    }
    match request.uri().path() {
        "/metrics" => {
            // /status refreshes what is read from elsewhere (kernel counters, watchers).
            let _ = status();
            text(metrics.render())
        }
        "/status" => Response::builder()
            .header(header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(status())))
            .unwrap_or_default(),
        _ => plain(
            StatusCode::NOT_FOUND,
            "not found: try /metrics or /status\n",
        ),
    }
}

/// Prometheus text.
fn text(body: String) -> Response<Full<Bytes>> {
    Response::builder()
        .header(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )
        .body(Full::new(Bytes::from(body)))
        .unwrap_or_default()
}

/// 401: the token is missing or wrong (the same answer for both, and nothing else said).
fn unauthorized() -> Response<Full<Bytes>> {
    let mut response = plain(
        StatusCode::UNAUTHORIZED,
        "send Authorization: Bearer TOKEN (metrics.bearer_token_file)\n",
    );
    response.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        http::HeaderValue::from_static("Bearer"),
    );
    response
}

fn plain(status: StatusCode, text: &'static str) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from_static(text.as_bytes())));
    *response.status_mut() = status;
    response
}
