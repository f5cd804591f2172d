//! Every way a proxied request can fail, and the one place that turns each into an HTTP
//! response in the API's own error shape (DESIGN section 6).

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};
use http_body_util::{BodyExt as _, Full};

use super::upstream::Body;
use crate::{classify::UnknownClass, queue::RejectReason};

/// Which API's error shape a response uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorShape {
    /// `{"error": "..."}`
    Ollama,
    /// `{"error": {"message": "...", "type": "...", "code": "..."}}`
    Openai,
}

#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("invalid upstream: {0}")]
    Config(String),
    #[error("bad request: {0}")]
    BadRequest(String),
    #[error(transparent)]
    UnknownClass(#[from] UnknownClass),
    #[error("request body is larger than the limit of {limit} bytes (server.body_limit_bytes)")]
    BodyTooLarge { limit: u64 },
    #[error("request body is not valid JSON: {0}")]
    MalformedJson(String),
    #[error("class {class}: {}: {}", reason.as_str(), explain(*reason))]
    Rejected {
        class: String,
        reason: RejectReason,
        retry_after: Duration,
    },
    #[error(
        "model `{model}` is served from elsewhere (a remote or cloud model) and \
         upstream.refuse_remote_models is set: the request would leave this machine"
    )]
    RemoteModel { model: String },
    #[error("upstream unreachable: {0}")]
    UpstreamUnreachable(String),
    #[error("upstream did not answer within {} ms", .0.as_millis())]
    UpstreamTimeout(Duration),
}

fn explain(reason: RejectReason) -> &'static str {
    match reason {
        RejectReason::QueueFull => "the class's queue is full",
        RejectReason::Deadline => "the request cannot start within the class's deadline",
        RejectReason::ShuttingDown => "guard is shutting down",
    }
}

impl ProxyError {
    fn status(&self) -> StatusCode {
        match self {
            Self::Config(_) | Self::UpstreamUnreachable(_) => StatusCode::BAD_GATEWAY,
            Self::BadRequest(_) | Self::UnknownClass(_) | Self::MalformedJson(_) => {
                StatusCode::BAD_REQUEST
            }
            Self::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Self::Rejected { .. } => StatusCode::SERVICE_UNAVAILABLE,
            Self::RemoteModel { .. } => StatusCode::FORBIDDEN,
            Self::UpstreamTimeout(_) => StatusCode::GATEWAY_TIMEOUT,
        }
    }

    /// The machine-readable code in OpenAI-shaped bodies.
    fn code(&self) -> &'static str {
        match self {
            Self::Config(_) => "upstream_config",
            Self::BadRequest(_) => "bad_request",
            Self::UnknownClass(_) => "unknown_class",
            Self::BodyTooLarge { .. } => "body_too_large",
            Self::MalformedJson(_) => "malformed_json",
            Self::Rejected { reason, .. } => reason.as_str(),
            Self::RemoteModel { .. } => "remote_model_refused",
            Self::UpstreamUnreachable(_) => "upstream_unreachable",
            Self::UpstreamTimeout(_) => "upstream_timeout",
        }
    }

    pub fn into_response(self, shape: ErrorShape) -> Response<Body> {
        let message = format!("guard: {self}");
        let status = self.status();
        let body = match shape {
            ErrorShape::Ollama => serde_json::json!({ "error": message }),
            ErrorShape::Openai => serde_json::json!({
                "error": {
                    "message": message,
                    "type": if status.is_server_error() { "server_error" } else { "invalid_request_error" },
                    "code": self.code(),
                }
            }),
        };
        let mut response = Response::new(full(body.to_string()));
        *response.status_mut() = status;
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if let Self::Rejected { retry_after, .. } = self {
            headers.insert(
                header::RETRY_AFTER,
                HeaderValue::from(retry_after_secs(retry_after)),
            );
        }
        response
    }
}

/// Whole seconds, rounded up, at least one (DESIGN section 6).
pub fn retry_after_secs(estimate: Duration) -> u64 {
    estimate.as_secs_f64().ceil().max(1.0) as u64
}

/// A complete body from bytes.
pub fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into())
        .map_err(|never| match never {})
        .boxed()
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn body_json(response: Response<Body>) -> serde_json::Value {
        let bytes = response
            .into_body()
            .collect()
            .await
            .expect("body")
            .to_bytes();
        serde_json::from_slice(&bytes).expect("json")
    }

    #[tokio::test]
    async fn rejections_carry_retry_after_and_both_shapes() {
        let rejected = || ProxyError::Rejected {
            class: "batch".to_owned(),
            reason: RejectReason::QueueFull,
            retry_after: Duration::from_millis(1_200),
        };
        let response = rejected().into_response(ErrorShape::Ollama);
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(response.headers()[header::RETRY_AFTER], "2");
        let body = body_json(response).await;
        let message = body["error"].as_str().expect("ollama: error is a string");
        assert!(
            message.contains("batch") && message.contains("queue_full"),
            "{message}"
        );

        let body = body_json(rejected().into_response(ErrorShape::Openai)).await;
        assert_eq!(body["error"]["code"], "queue_full");
        assert_eq!(body["error"]["type"], "server_error");
        assert!(
            body["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("batch"))
        );
    }

    #[test]
    fn retry_after_is_whole_seconds_at_least_one() {
        assert_eq!(retry_after_secs(Duration::ZERO), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(1_001)), 2);
        assert_eq!(retry_after_secs(Duration::from_secs(7)), 7);
    }
}
