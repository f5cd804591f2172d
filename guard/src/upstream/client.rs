//! The connection pool to the inference server for pass-through requests and the watchers'
//! polls, with connect and response timeouts. Queued requests use an exchange of their own
//! (`exchange.rs`).

use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, Uri, uri::Authority};
use hyper::body::Incoming;
use hyper_util::{
    client::legacy::{Client as Pool, Error as PoolError, connect::HttpConnector},
    rt::TokioExecutor,
};

use super::{Body, full, strip_hop_by_hop};
use crate::config::UpstreamConfig;

/// Why a request to the upstream got no answer.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    /// Said as a queued request's failed connect is (`ExchangeError::Connect`), without
    /// hyper-util's layers ("client error (Connect): tcp connect error").
    #[error("cannot connect to {authority}")]
    Connect {
        authority: String,
        #[source]
        source: std::io::Error,
    },
    #[error("upstream unreachable")]
    Unreachable(#[source] PoolError),
    #[error("upstream did not answer within {} ms", .0.as_millis())]
    Timeout(Duration),
    #[error("the request cannot be addressed to the upstream")]
    Address(#[source] http::Error),
}

/// A keep-alive client for one upstream server.
#[derive(Clone)]
pub struct Client {
    pool: Pool<HttpConnector, Body>,
    authority: Authority,
    response_timeout: Duration,
}

impl Client {
    pub fn new(config: &UpstreamConfig) -> Self {
        let authority = config.url.authority().clone();
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(Duration::from_millis(config.connect_timeout_ms)));
        connector.set_nodelay(true);
        // Pass-through requests are at most `max_passthrough` at once: so are the connections
        // kept for them.
        let pool = Pool::builder(TokioExecutor::new())
            // Answers keep the header spelling the upstream chose.
            .http1_preserve_header_case(true)
            .pool_idle_timeout(Duration::from_secs(30))
            .pool_max_idle_per_host(config.max_passthrough as usize)
            .build(connector);
        Self {
            pool,
            authority,
            response_timeout: Duration::from_millis(config.response_timeout_ms),
        }
    }

    /// Sends `request` (its URI's path and query are kept) and waits for the response head.
    pub async fn send(&self, request: Request<Body>) -> Result<Response<Incoming>, UpstreamError> {
        let request = self.to_upstream(request)?;
        self.exchange(request)
            .await?
            .map_err(|err| self.unreachable(err))
    }

    /// Sends a request whose body is in memory (bodiless pass-through requests, the watchers'
    /// polls). A pooled connection that the server closed just as guard reused it fails before
    /// any answer: llama-server shuts its side after each streamed response although it
    /// advertises keep-alive, and the request behind it meets the closed socket. Such a request
    /// (a GET, which runs nothing) is sent once more, on another connection.
    pub async fn send_buffered(
        &self,
        head: &http::request::Parts,
        body: Bytes,
    ) -> Result<Response<Incoming>, UpstreamError> {
        let request = || {
            let mut request = Request::new(full(body.clone()));
            *request.method_mut() = head.method.clone();
            *request.uri_mut() = head.uri.clone();
            *request.version_mut() = head.version;
            *request.headers_mut() = headers_of(&head.headers);
            self.to_upstream(request)
        };
        match self.exchange(request()?).await? {
            Err(err) if closed_before_answering(&err) => {
                tracing::debug!(error = %super::error_chain(&err), "upstream closed a reused connection; sending again");
                self.exchange(request()?).await?
            }
            result => result,
        }
        .map_err(|err| self.unreachable(err))
    }

    /// Sends one request on a connection of its own, closed after the answer. llama-server
    /// serves each connection on one of a few HTTP threads for as long as it stays open: kept
    /// alive in a pool, a burst of these small questions would hold those threads, and the
    /// requests that run generations would wait for a thread to come free.
    pub async fn send_once(
        &self,
        head: &http::request::Parts,
        body: Bytes,
    ) -> Result<Response<Incoming>, UpstreamError> {
        let mut request = Request::new(full(body));
        *request.method_mut() = head.method.clone();
        *request.uri_mut() = head.uri.clone();
        *request.headers_mut() = headers_of(&head.headers);
        let mut request = self.to_upstream(request)?;
        request.headers_mut().insert(
            http::header::CONNECTION,
            http::HeaderValue::from_static("close"),
        );
        self.exchange(request)
            .await?
            .map_err(|err| self.unreachable(err))
    }

    /// `GET path`, its body read whole when the answer is a success.
    pub async fn get(&self, path: &str) -> Option<Bytes> {
        use http_body_util::BodyExt as _;
        let (head, ()) = Request::get(path).body(()).ok()?.into_parts();
        let response = self.send_buffered(&head, Bytes::new()).await.ok()?;
        if !response.status().is_success() {
            return None;
        }
        Some(response.into_body().collect().await.ok()?.to_bytes())
    }

    /// A queued request as it goes to the upstream on an exchange of its own: origin-form
    /// target, the upstream's Host, and without what belongs to the client's hop (the body
    /// is already read, so an `Expect: 100-continue` has been answered). `headers`: the
    /// client's, moved out of `head` where the request goes upstream once, else `headers_of`
    /// them.
    pub fn for_exchange(
        &self,
        head: &http::request::Parts,
        headers: http::HeaderMap,
        body: Bytes,
    ) -> Result<Request<Body>, UpstreamError> {
        let target = head.uri.path_and_query().map_or("/", |p| p.as_str());
        let length = body.len();
        let mut request = Request::new(full(body));
        *request.method_mut() = head.method.clone();
        *request.uri_mut() = target
            .parse()
            .map_err(|err: http::uri::InvalidUri| UpstreamError::Address(err.into()))?;
        *request.headers_mut() = headers;
        let headers = request.headers_mut();
        strip_hop_by_hop(headers);
        headers.remove(http::header::EXPECT);
        headers.insert(http::header::HOST, self.host());
        // The body may be guard's rewrite of the client's (a preemptible request's).
        headers.insert(
            http::header::CONTENT_LENGTH,
            http::HeaderValue::from(length),
        );
        Ok(request)
    }

    /// The upstream's own Host value (an authority is always a valid header value).
    fn host(&self) -> http::HeaderValue {
        http::HeaderValue::from_str(self.authority.as_str())
            .unwrap_or_else(|_| http::HeaderValue::from_static("localhost"))
    }

    /// Points `request` at the upstream and removes what belongs to the client's hop.
    fn to_upstream(&self, mut request: Request<Body>) -> Result<Request<Body>, UpstreamError> {
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
            .map_err(UpstreamError::Address)?;
        strip_hop_by_hop(request.headers_mut());
        request
            .headers_mut()
            .insert(http::header::HOST, self.host());
        Ok(request)
    }

    /// Why the pool got no answer: a connect the system refused is said by its OS error.
    fn unreachable(&self, err: PoolError) -> UpstreamError {
        match os_error_of(&err).filter(|_| err.is_connect()) {
            Some(code) => UpstreamError::Connect {
                authority: self.authority.to_string(),
                source: std::io::Error::from_raw_os_error(code),
            },
            None => UpstreamError::Unreachable(err),
        }
    }

    /// One exchange up to the response head; the outer error is the response timeout.
    async fn exchange(
        &self,
        request: Request<Body>,
    ) -> Result<Result<Response<Incoming>, PoolError>, UpstreamError> {
        match tokio::time::timeout(self.response_timeout, self.pool.request(request)).await {
            Err(_) => Err(UpstreamError::Timeout(self.response_timeout)),
            Ok(result) => Ok(result.map(|mut response| {
                strip_hop_by_hop(response.headers_mut());
                response
            })),
        }
    }
}

/// The client's headers for a request of guard's own to the upstream. hyper reads the
/// answer into the map its request went out in, and guard adds its own headers to that answer:
/// the copy keeps the room the client's map had (its connection sized that map to the last
/// answer guard sent it), where a clone keeps room for the request's headers alone and the
/// answer regrows it.
pub fn headers_of(client: &http::HeaderMap) -> http::HeaderMap {
    let mut headers = http::HeaderMap::with_capacity(client.capacity());
    for (name, value) in client {
        headers.append(name.clone(), value.clone());
    }
    headers
}

/// The OS error among `err`'s causes, if any (it is all a failed connect says).
fn os_error_of(err: &PoolError) -> Option<i32> {
    let mut source = std::error::Error::source(err);
    while let Some(cause) = source {
        if let Some(code) = cause
            .downcast_ref::<std::io::Error>()
            .and_then(std::io::Error::raw_os_error)
        {
            return Some(code);
        }
        source = cause.source();
    }
    None
}

/// Whether the connection closed before any of the answer came: the mark of a pooled
/// keep-alive connection the server had already given up.
fn closed_before_answering(err: &PoolError) -> bool {
    std::error::Error::source(err)
        .and_then(|source| source.downcast_ref::<hyper::Error>())
        .is_some_and(hyper::Error::is_incomplete_message)
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt as _;
    use tokio::{
        io::{AsyncReadExt as _, AsyncWriteExt as _},
        net::{TcpListener, TcpStream},
    };

    use super::*;
    use crate::config::UpstreamConfig;

    /// Reads one request head and its body (the tests send bodies with a Content-Length).
    async fn read_request(stream: &mut TcpStream) -> bool {
        let mut seen = Vec::new();
        let mut buffer = [0u8; 1024];
        loop {
            let mut headers = [httparse::EMPTY_HEADER; 32];
            let mut request = httparse::Request::new(&mut headers);
            if let Ok(httparse::Status::Complete(end)) = request.parse(&seen) {
                let length: usize = request
                    .headers
                    .iter()
                    .find(|h| h.name.eq_ignore_ascii_case("content-length"))
                    .map_or(0, |h| {
                        String::from_utf8_lossy(h.value)
                            .trim()
                            .parse()
                            .expect("length")
                    });
                if seen.len() >= end + length {
                    return true;
                }
            }
            match stream.read(&mut buffer).await {
                Ok(0) | Err(_) => return false,
                Ok(n) => seen.extend_from_slice(&buffer[..n]),
            }
        }
    }

    /// A server like llama-server after a stream: it answers one request per connection with
    /// keep-alive headers, then reads the next request and closes without answering.
    async fn one_answer_per_connection() -> String {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        tokio::spawn(async move {
            loop {
                let (mut stream, _) = listener.accept().await.expect("accept");
                tokio::spawn(async move {
                    if read_request(&mut stream).await {
                        let answer = "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nKeep-Alive: timeout=5, max=100\r\n\r\nok";
                        stream.write_all(answer.as_bytes()).await.expect("answer");
                    }
                    read_request(&mut stream).await;
                });
            }
        });
        url
    }

    async fn upstream_that_answers_once_per_connection() -> Client {
        Client::new(&UpstreamConfig {
            url: one_answer_per_connection().await.parse().expect("a URL"),
            ..UpstreamConfig::default()
        })
    }

    #[tokio::test]
    async fn a_buffered_request_is_sent_again_when_a_reused_connection_was_closed() {
        let upstream = upstream_that_answers_once_per_connection().await;
        let (head, ()) = Request::post("/completion")
            .body(())
            .expect("request")
            .into_parts();
        for round in 0..3 {
            let response = upstream
                .send_buffered(&head, Bytes::from_static(b"{\"prompt\":\"hi\"}"))
                .await
                .unwrap_or_else(|err| panic!("round {round}: {err}"));
            let body = response.into_body().collect().await.expect("body");
            assert_eq!(body.to_bytes(), "ok", "round {round}");
        }
    }

    #[tokio::test]
    async fn a_streamed_request_is_not_sent_again() {
        let upstream = upstream_that_answers_once_per_connection().await;
        let request = || {
            Request::post("/completion")
                .body(full("{}"))
                .expect("request")
        };
        let first = upstream.send(request()).await.expect("first answer");
        first.into_body().collect().await.expect("body");
        let second = upstream.send(request()).await;
        assert!(
            matches!(second, Err(UpstreamError::Unreachable(_))),
            "a body that may be gone is never replayed: {second:?}"
        );
    }
}
