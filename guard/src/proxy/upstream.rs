//! The connection pool to the inference server, with connect and response timeouts.

use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, Uri, uri::Authority};
use http_body_util::combinators::BoxBody;
use hyper::body::Incoming;
use hyper_util::{
    client::legacy::{Client, connect::HttpConnector},
    rt::TokioExecutor,
};

use super::error::ProxyError;
use crate::config::{UpstreamConfig, upstream_authority};

/// Any request or response body guard relays.
pub type Body = BoxBody<Bytes, hyper::Error>;

/// A keep-alive client for one upstream server.
#[derive(Clone)]
pub struct Upstream {
    client: Client<HttpConnector, Body>,
    authority: Authority,
    response_timeout: Duration,
}

impl Upstream {
    pub fn new(config: &UpstreamConfig) -> Result<Self, ProxyError> {
        let authority = upstream_authority(&config.url).map_err(ProxyError::Config)?;
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(Duration::from_millis(config.connect_timeout_ms)));
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .build(connector);
        Ok(Self {
            client,
            authority,
            response_timeout: Duration::from_millis(config.response_timeout_ms),
        })
    }

    /// Sends `request` (its URI's path and query are kept) and waits for the response head.
    pub async fn send(&self, mut request: Request<Body>) -> Result<Response<Incoming>, ProxyError> {
        let path = request
            .uri()
            .path_and_query()
            .map_or("/", |p| p.as_str())
            .to_owned();
        *request.uri_mut() = Uri::builder()
            .scheme("http")
            .authority(self.authority.clone())
            .path_and_query(path)
            .build()
            .map_err(|err| ProxyError::BadRequest(err.to_string()))?;
        strip_hop_by_hop(request.headers_mut());
        request.headers_mut().insert(
            http::header::HOST,
            http::HeaderValue::from_str(self.authority.as_str())
                .map_err(|err| ProxyError::BadRequest(err.to_string()))?,
        );
        match tokio::time::timeout(self.response_timeout, self.client.request(request)).await {
            Err(_) => Err(ProxyError::UpstreamTimeout(self.response_timeout)),
            Ok(Err(err)) => Err(ProxyError::UpstreamUnreachable(error_chain(&err))),
            Ok(Ok(mut response)) => {
                strip_hop_by_hop(response.headers_mut());
                Ok(response)
            }
        }
    }
}

/// Headers that describe one hop, not the message (RFC 9110 section 7.6.1).
fn strip_hop_by_hop(headers: &mut http::HeaderMap) {
    const HOP_BY_HOP: &[&str] = &[
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "upgrade",
    ];
    for name in HOP_BY_HOP {
        headers.remove(*name);
    }
}

/// The error and its causes on one line: hyper's top-level messages alone say little.
fn error_chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
