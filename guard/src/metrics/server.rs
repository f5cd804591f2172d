//! The metrics listener: `GET /metrics` (Prometheus text) and `GET /status` (JSON).

use std::{convert::Infallible, sync::Arc};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::Full;
use hyper::{body::Incoming, server::conn::http1, service::service_fn};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

use super::Metrics;

/// Produces the `/status` document, and brings metrics read from elsewhere up to date.
pub type StatusFn = Arc<dyn Fn() -> serde_json::Value + Send + Sync>;

/// Serves until the task is dropped.
pub async fn serve(listener: TcpListener, metrics: Metrics, status: StatusFn) {
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(err) => {
                tracing::warn!(%err, "metrics listener: accept failed");
                continue;
            }
        };
        let metrics = metrics.clone();
        let status = Arc::clone(&status);
        tokio::spawn(async move {
            let service = service_fn(move |request| {
                let response = respond(&request, &metrics, &status);
                async move { Ok::<_, Infallible>(response) }
            });
            if let Err(err) = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await
            {
                tracing::debug!(%err, "metrics connection ended with an error");
            }
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
            Response::builder()
                .header(
                    header::CONTENT_TYPE,
                    "text/plain; version=0.0.4; charset=utf-8",
                )
                .body(Full::new(Bytes::from(metrics.render())))
                .unwrap_or_default()
        }
        "/status" => Response::builder()
            .header(header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(status().to_string())))
            .unwrap_or_default(),
        _ => plain(
            StatusCode::NOT_FOUND,
            "not found: try /metrics or /status\n",
        ),
    }
}

fn plain(status: StatusCode, text: &'static str) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from_static(text.as_bytes())));
    *response.status_mut() = status;
    response
}
