//! Every way a proxied request can fail, and the one place that turns each into an HTTP
//! response in the API's own error shape (docs/design.md §6).

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};

use super::outcome::Timeout;
use crate::{
    classify::UnknownClass,
    queue::RejectReason,
    upstream::{
        Body, UpstreamError, error_chain, exchange::ExchangeError, frames::StreamFormat, full,
    },
};

/// Which API's error shape a response uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorShape {
    /// `{"error": "..."}`
    Ollama,
    /// `{"error": {"message": "...", "type": "...", "code": "..."}}`
    Openai,
}

/// Every way a request can fail; the causes stay attached (`#[source]`) and the client's
/// message names them all.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("the request's length can be read two ways: {0}")]
    Framing(&'static str),
    #[error("reading the request body failed")]
    BodyRead(#[source] hyper::Error),
    #[error(transparent)]
    UnknownClass(#[from] UnknownClass),
    #[error(transparent)]
    BadPath(#[from] crate::route::PathError),
    #[error("too_many_connections: guard has server.max_connections clients connected")]
    TooManyConnections,
    #[error(
        "passthrough_full: {limit} requests to other endpoints are already in flight (upstream.max_passthrough)"
    )]
    PassthroughFull { limit: u32 },
    #[error("request body is larger than the limit of {limit} bytes (server.body_limit_bytes)")]
    BodyTooLarge { limit: u64 },
    #[error("class {class}: {}: {}", reason.as_str(), explain(*reason))]
    Rejected {
        class: String,
        reason: RejectReason,
        retry_after: Duration,
    },
    #[error(
        "model `{model}` is served from elsewhere (a remote or cloud model) and class {class} \
         may not ask for that (class.{class}.allow_remote_models): the request would leave \
         this machine"
    )]
    RemoteModel { class: String, model: String },
    #[error(transparent)]
    Upstream(#[from] UpstreamError),
    /// Its own words say what failed: "cannot connect to 127.0.0.1:8080: connection refused".
    #[error(transparent)]
    Exchange(#[from] ExchangeError),
    #[error("upstream did not answer within {} ms", .0.as_millis())]
    UpstreamTimeout(Duration),
    #[error("the upstream's answer broke off")]
    UpstreamReset(#[source] hyper::Error),
    #[error("the request body did not arrive within {} ms ({})", limit.as_millis(), Timeout::BodyRead.key())]
    BodyReadTimeout { limit: Duration },
    #[error("class {class}: {} ms passed ({}): {}", limit.as_millis(), which.key(), explain_timeout(*which))]
    TimedOut {
        class: String,
        which: Timeout,
        limit: Duration,
    },
    #[error("the upstream refused to continue a preempted answer ({0})")]
    Continuation(http::StatusCode),
    #[error("a preempted answer could not go on exactly")]
    Diverged(#[source] crate::upstream::exact::Diverged),
    #[error("the upstream stopped the answer with an error: {0}")]
    UpstreamSaid(String),
    #[error("the upstream's answer ended before its end marker")]
    Truncated,
    #[error(
        "method {method} is not passed on: guard forwards requests for a path on the upstream only"
    )]
    MethodNotAllowed { method: http::Method },
    #[error("guard let go of this request (an internal error)")]
    Internal,
}

fn explain_timeout(which: Timeout) -> &'static str {
    match which {
        Timeout::BodyRead => "the request body did not arrive in time",
        Timeout::UpstreamIdle => "the upstream sent nothing more for that long",
        Timeout::ClientStall => "the client did not read for that long",
        Timeout::MaxDuration => "the request took longer than its class allows",
    }
}

fn explain(reason: RejectReason) -> &'static str {
    match reason {
        RejectReason::QueueFull => "the class's queue is full",
        RejectReason::DeadlinePredicted => {
            "guard predicts the request cannot start within the class's deadline"
        }
        RejectReason::DeadlineExpired => "the class's deadline passed while the request waited",
        RejectReason::ShuttingDown => "guard is shutting down",
        RejectReason::BodyBytesFull => {
            "guard holds as many request body bytes as server.max_body_bytes_in_flight allows"
        }
    }
}

impl ProxyError {
    fn status(&self) -> StatusCode {
        match self {
            Self::Upstream(UpstreamError::Timeout(_)) => StatusCode::GATEWAY_TIMEOUT,
            Self::Upstream(_)
            | Self::Exchange(_)
            | Self::UpstreamReset(_)
            | Self::Continuation(_)
            | Self::Diverged(_)
            | Self::UpstreamSaid(_)
            | Self::Truncated => StatusCode::BAD_GATEWAY,
            Self::BodyReadTimeout { .. } => StatusCode::REQUEST_TIMEOUT,
            Self::TimedOut { .. } => StatusCode::GATEWAY_TIMEOUT,
            Self::Internal => StatusCode::INTERNAL_SERVER_ERROR,
            Self::Framing(_) | Self::BodyRead(_) | Self::UnknownClass(_) | Self::BadPath(_) => {
                StatusCode::BAD_REQUEST
            }
            Self::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Self::Rejected { .. } | Self::TooManyConnections | Self::PassthroughFull { .. } => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            Self::RemoteModel { .. } => StatusCode::FORBIDDEN,
            Self::MethodNotAllowed { .. } => StatusCode::METHOD_NOT_ALLOWED,
            Self::UpstreamTimeout(_) => StatusCode::GATEWAY_TIMEOUT,
        }
    }

    /// The machine-readable code in OpenAI-shaped bodies.
    fn code(&self) -> &'static str {
        match self {
            Self::Framing(_) => "framing",
            Self::BodyRead(_) => "body_read",
            Self::UnknownClass(_) => "unknown_class",
            Self::BodyTooLarge { .. } => "body_too_large",
            Self::BadPath(_) => "bad_path",
            Self::TooManyConnections => "too_many_connections",
            Self::PassthroughFull { .. } => "passthrough_full",
            Self::Rejected { reason, .. } => reason.as_str(),
            Self::RemoteModel { .. } => "remote_model_refused",
            Self::MethodNotAllowed { .. } => "method_not_allowed",
            Self::Upstream(UpstreamError::Timeout(_)) | Self::UpstreamTimeout(_) => {
                "upstream_timeout"
            }
            Self::Upstream(_) | Self::Exchange(_) => "upstream_unreachable",
            Self::UpstreamReset(_) => "upstream_reset",
            Self::Continuation(_) | Self::Diverged(_) | Self::UpstreamSaid(_) | Self::Truncated => {
                "upstream_error"
            }
            Self::BodyReadTimeout { .. } => "body_read_timeout",
            Self::TimedOut { which, .. } => which.as_str(),
            Self::Internal => "internal",
        }
    }

    /// The error in the API's own body shape.
    fn body(&self, shape: ErrorShape) -> serde_json::Value {
        let message = format!("guard: {}", error_chain(self));
        match shape {
            ErrorShape::Ollama => serde_json::json!({ "error": message }),
            ErrorShape::Openai => serde_json::json!({
                "error": {
                    "message": message,
                    "type": if self.status().is_server_error() { "server_error" } else { "invalid_request_error" },
                    "code": self.code(),
                }
            }),
        }
    }

    /// The error as the last piece of a stream cut short, where the format has one.
    pub fn stream_frame(&self, format: StreamFormat) -> Option<Bytes> {
        let text = match format {
            // llama-server and OpenAI send a stream's error as one more data event.
            StreamFormat::Sse => format!("data: {}\n\n", self.body(ErrorShape::Openai)),
            // Ollama ends a failed stream with an error line.
            StreamFormat::Ndjson => format!("{}\n", self.body(ErrorShape::Ollama)),
            StreamFormat::Whole => return None,
        };
        Some(Bytes::from(text))
    }

    /// The whole HTTP/1.1 response as bytes, for a connection refused before hyper serves it;
    /// the connection closes after it.
    pub fn raw_response(&self, shape: ErrorShape) -> Vec<u8> {
        let status = self.status();
        let body = self.body(shape).to_string();
        format!(
            "HTTP/1.1 {} {}\r\ncontent-type: application/json\r\nretry-after: 1\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
            status.as_str(),
            status.canonical_reason().unwrap_or_default(),
            body.len()
        )
        .into_bytes()
    }

    pub fn into_response(self, shape: ErrorShape) -> Response<Body> {
        let status = self.status();
        let body = self.body(shape);
        let mut response = Response::new(full(body.to_string()));
        *response.status_mut() = status;
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        let retry_after = match self {
            Self::Rejected { retry_after, .. } => Some(retry_after),
            Self::TooManyConnections | Self::PassthroughFull { .. } => Some(Duration::ZERO),
            _ => None,
        };
        if let Self::MethodNotAllowed { .. } = self {
            // A 405 says what is allowed (RFC 9110 §15.5.6): any origin request.
            headers.insert(header::ALLOW, HeaderValue::from_static(ALLOWED_METHODS));
        }
        if let Some(retry_after) = retry_after {
            headers.insert(
                header::RETRY_AFTER,
                HeaderValue::from(retry_after_secs(retry_after)),
            );
        }
        response
    }
}

/// The methods guard passes on: every one but those that ask for a tunnel or a trace.
pub const ALLOWED_METHODS: &str = "GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS";

/// Whole seconds, rounded up, at least one (docs/design.md §6).
pub fn retry_after_secs(estimate: Duration) -> u64 {
    estimate.as_secs_f64().ceil().max(1.0) as u64
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt as _;

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

    /// An address nothing listens on: a port the kernel gave out, closed again.
    fn closed_port() -> std::net::SocketAddr {
        std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|listener| listener.local_addr())
            .expect("a free port")
    }

    #[tokio::test]
    async fn a_dead_upstream_is_a_502_that_says_the_refused_connect_once() {
        use crate::upstream::exchange::{Connector, Dial, Exchange};
        let addr = closed_port();
        let dial = Dial::Tcp {
            authority: addr.to_string(),
            connect_timeout: Duration::from_secs(5),
        };
        let request = http::Request::post("/api/chat")
            .body(full("{}"))
            .expect("request");
        let Err(err) = Exchange::start(&Connector::new(dial, 1), request).await else {
            panic!("nothing listens on {addr}");
        };
        assert_eq!(
            error_chain(&err),
            format!("cannot connect to {addr}: connection refused"),
            "the log's words"
        );
        let response = ProxyError::from(err).into_response(ErrorShape::Openai);
        assert_eq!(response.status(), StatusCode::BAD_GATEWAY);
        let body = body_json(response).await;
        assert_eq!(
            body["error"]["message"],
            format!("guard: cannot connect to {addr}: connection refused")
        );
        assert_eq!(body["error"]["code"], "upstream_unreachable");
    }

    #[tokio::test]
    async fn a_dead_upstream_reads_the_same_on_a_pass_through_request() {
        let addr = closed_port();
        let upstream = crate::upstream::Client::new(&crate::config::UpstreamConfig {
            url: format!("http://{addr}").parse().expect("a URL"),
            ..crate::config::UpstreamConfig::default()
        });
        let (head, ()) = http::Request::get("/api/tags")
            .body(())
            .expect("request")
            .into_parts();
        let err = upstream
            .send_buffered(&head, Bytes::new())
            .await
            .expect_err("nothing listens");
        let response = ProxyError::from(err).into_response(ErrorShape::Ollama);
        assert_eq!(response.status(), StatusCode::BAD_GATEWAY);
        assert_eq!(
            body_json(response).await["error"],
            format!("guard: cannot connect to {addr}: connection refused")
        );
    }

    #[test]
    fn retry_after_is_whole_seconds_at_least_one() {
        assert_eq!(retry_after_secs(Duration::ZERO), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(1_001)), 2);
        assert_eq!(retry_after_secs(Duration::from_secs(7)), 7);
    }
}
