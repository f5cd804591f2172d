//! A request to a generation endpoint: read and check its body, classify it, wait for its
//! turn (or be turned away), forward it, and relay the answer as it streams.

use std::{sync::Arc, time::Duration};

use http::{HeaderValue, Request, Response};
use http_body_util::{BodyExt as _, Limited};
use hyper::body::Incoming;
use tokio::time::Instant;

use super::{
    Proxy, Settings,
    error::{ErrorShape, ProxyError, full},
    error_shape,
    record::{Outcome, RequestRecord},
    relay::{ColdLoadProbe, RelayBody},
    upstream::Body,
};
use crate::{
    classify::RequestFacts,
    reap::{owner::client_cgroup, registry::Connection},
};

impl Proxy {
    pub(super) async fn queued(
        &self,
        request: Request<Incoming>,
        connection: &Arc<Connection>,
        settings: &Settings,
    ) -> Response<Body> {
        let arrived = Instant::now();
        let shape = error_shape(request.uri().path(), settings.api);
        let (parts, body) = request.into_parts();

        let bytes = match Limited::new(body, settings.body_limit as usize)
            .collect()
            .await
        {
            Ok(collected) => collected.to_bytes(),
            Err(err) if err.is::<http_body_util::LengthLimitError>() => {
                return self.invalid(
                    "body_too_large",
                    ProxyError::BodyTooLarge {
                        limit: settings.body_limit,
                    },
                    shape,
                );
            }
            Err(err) => {
                let reason = format!("reading the request body: {err}");
                return self.invalid("body_read", ProxyError::BadRequest(reason), shape);
            }
        };
        let json: serde_json::Value = match serde_json::from_slice(&bytes) {
            Ok(json) => json,
            Err(err) => {
                return self.invalid(
                    "malformed_json",
                    ProxyError::MalformedJson(err.to_string()),
                    shape,
                );
            }
        };
        let model = json.get("model").and_then(serde_json::Value::as_str);
        if let Some(model) = model
            && settings.refuse_remote_models
            && self.remote_models.remote_models.is_remote(model)
        {
            self.metrics
                .remote_refused_total
                .with_label_values(&[model])
                .inc();
            return ProxyError::RemoteModel {
                model: model.to_owned(),
            }
            .into_response(shape);
        }

        let decision = {
            let (listen, peer) = (self.listen, connection.peer);
            let tracker = self.tracker.as_deref();
            let cgroup = move || client_cgroup(tracker, peer, listen);
            settings.classifier.classify(&RequestFacts {
                path: parts.uri.path(),
                headers: &parts.headers,
                model,
                source: peer.ip(),
                cgroup: &cgroup,
            })
        };
        let decision = match decision {
            Ok(decision) => decision,
            Err(unknown) => return self.invalid("unknown_class", unknown.into(), shape),
        };
        let class = decision.class;

        let ticket = match self.scheduler.enqueue(&class, model) {
            Ok(ticket) => ticket,
            Err(rejection) => {
                self.metrics
                    .rejected_total
                    .with_label_values(&[&class, rejection.reason.as_str()])
                    .inc();
                self.metrics
                    .requests_total
                    .with_label_values(&[&class, "rejected"])
                    .inc();
                let error = ProxyError::Rejected {
                    class: class.clone(),
                    reason: rejection.reason,
                    retry_after: rejection.retry_after,
                };
                return tag(error.into_response(shape), &class, arrived.elapsed());
            }
        };
        let mut record =
            RequestRecord::admitted(&self.metrics, &class, arrived, Arc::clone(connection));
        let permit = match ticket.wait().await {
            Ok(permit) => permit,
            Err(rejection) => {
                record.finish(Outcome::Rejected(rejection.reason));
                let error = ProxyError::Rejected {
                    class: class.clone(),
                    reason: rejection.reason,
                    retry_after: rejection.retry_after,
                };
                return tag(error.into_response(shape), &class, arrived.elapsed());
            }
        };
        if connection.is_gone() {
            // Its turn came as its client left: hand the permit on; the record counts it
            // reaped while queued.
            drop(permit);
            return client_gone();
        }
        record.dispatched();
        let waited = permit.waited();
        tracing::trace!(
            class,
            by = decision.by,
            waited_ms = permit.waited().as_millis() as u64,
            "dispatched"
        );

        let cold_load = (shape == ErrorShape::Ollama).then(|| ColdLoadProbe {
            model: model.unwrap_or("unknown").to_owned(),
            threshold: settings.cold_load,
            metrics: self.metrics.clone(),
            tail: Vec::new(),
        });
        match self.upstream.send_buffered(&parts, bytes).await {
            Ok(response) => {
                let failed = response.status().is_server_error();
                let response = response
                    .map(|body| RelayBody::new(body, permit, record, failed, cold_load).boxed());
                tag(response, &class, waited)
            }
            Err(err) => {
                tracing::warn!(class = %class, error = %err, "upstream request failed");
                record.finish(Outcome::Failed);
                drop(permit);
                tag(err.into_response(shape), &class, waited)
            }
        }
    }

    /// A request refused before it was queued (bad input): counted, answered, not forwarded.
    fn invalid(&self, reason: &str, error: ProxyError, shape: ErrorShape) -> Response<Body> {
        self.metrics
            .invalid_requests_total
            .with_label_values(&[reason])
            .inc();
        error.into_response(shape)
    }
}

/// The answer to a request whose client has left: nobody reads it (nginx logs such as 499).
fn client_gone() -> Response<Body> {
    let mut response = Response::new(full(""));
    *response.status_mut() =
        http::StatusCode::from_u16(499).unwrap_or(http::StatusCode::BAD_REQUEST);
    response
}

/// Adds `X-Guard-Class` and `X-Guard-Queue-Ms` (the time the request waited in guard).
fn tag(mut response: Response<Body>, class: &str, waited: Duration) -> Response<Body> {
    let headers = response.headers_mut();
    if let Ok(value) = HeaderValue::from_str(class) {
        headers.insert("x-guard-class", value);
    }
    headers.insert(
        "x-guard-queue-ms",
        HeaderValue::from(waited.as_millis() as u64),
    );
    response
}
