//! Every way a proxied request can fail, and the one place that turns each into an HTTP
//! response in the API's own error shape (DESIGN section 6).

use std::time::Duration;

use bytes::Bytes;
use http::{Response, StatusCode, header};
use http_body_util::{BodyExt as _, Full};

use super::upstream::Body;

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
    #[error("upstream unreachable: {0}")]
    UpstreamUnreachable(String),
    #[error("upstream did not answer within {} ms", .0.as_millis())]
    UpstreamTimeout(Duration),
}

impl ProxyError {
    fn status(&self) -> StatusCode {
        match self {
            Self::Config(_) | Self::UpstreamUnreachable(_) => StatusCode::BAD_GATEWAY,
            Self::BadRequest(_) => StatusCode::BAD_REQUEST,
            Self::UpstreamTimeout(_) => StatusCode::GATEWAY_TIMEOUT,
        }
    }

    /// The machine-readable code in OpenAI-shaped bodies.
    fn code(&self) -> &'static str {
        match self {
            Self::Config(_) => "upstream_config",
            Self::BadRequest(_) => "bad_request",
            Self::UpstreamUnreachable(_) => "upstream_unreachable",
            Self::UpstreamTimeout(_) => "upstream_timeout",
        }
    }

    pub fn into_response(self, shape: ErrorShape) -> Response<Body> {
        let message = format!("guard: {self}");
        let body = match shape {
            ErrorShape::Ollama => serde_json::json!({ "error": message }),
            ErrorShape::Openai => serde_json::json!({
                "error": {
                    "message": message,
                    "type": if self.status().is_server_error() { "server_error" } else { "invalid_request_error" },
                    "code": self.code(),
                }
            }),
        };
        let mut response = Response::new(full(body.to_string()));
        *response.status_mut() = self.status();
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            header::HeaderValue::from_static("application/json"),
        );
        response
    }
}

/// A complete body from bytes.
pub fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into())
        .map_err(|never| match never {})
        .boxed()
}
