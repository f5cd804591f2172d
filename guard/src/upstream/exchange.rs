//! One queued request's exchange with the upstream, on a connection no other request uses
//! meanwhile.
//!
//! The exchange drives its hyper connection itself (no spawned task), so dropping it ends the
//! exchange at once: an answer read to its end leaves an idle keep-alive connection, anything
//! else closes the socket. When its owner returns the permit after dropping it, the upstream
//! exchange is over.
//!
//! Nothing is ever sent twice, so a pooled connection must not be one the server is closing:
//! only connections whose answer was a single document (not a stream: llama-server shuts a
//! connection a moment after each stream) are kept, for at most `IDLE_TTL`, well inside common
//! keep-alive timeouts, and each is checked for a close before it is used.

use std::{
    collections::{HashMap, VecDeque},
    future::Future,
    pin::Pin,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    task::{Context, Poll},
    thread::ThreadId,
    time::Duration,
};

use bytes::Bytes;
use http::{Request, response};
use http_body::{Body as _, Frame};
use hyper::{
    body::Incoming,
    client::conn::http1::{self, Connection, SendRequest},
};
use hyper_util::rt::TokioIo;
use tokio::{
    io::{AsyncRead, AsyncWrite},
    time::Instant,
};

use super::Body;

/// Any byte stream to the upstream: TCP in production, an in-memory pipe in unit tests.
pub trait Io: AsyncRead + AsyncWrite + Send + Unpin + 'static {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin + 'static> Io for T {}

/// Makes an in-memory connection to an in-process upstream (unit tests).
pub type MemoryConnect = Arc<dyn Fn() -> Box<dyn Io> + Send + Sync>;

/// How long an idle connection is kept: far below the keep-alive timeouts of llama-server
/// (5 s), Ollama and nginx, so the server is not closing it as guard reuses it.
const IDLE_TTL: Duration = Duration::from_secs(2);

/// How guard reaches the upstream for queued requests.
#[derive(Clone)]
pub enum Dial {
    Tcp {
        /// `host:port`.
        authority: String,
        connect_timeout: Duration,
    },
    Memory(MemoryConnect),
}

/// Reaches the upstream, and keeps the idle connections finished exchanges leave: as many as
/// there may be exchanges at once (`upstream.max_concurrency`), so that a full house of
/// single-document answers does not open a connection per request.
///
/// Idle connections are kept per serving thread and handed only to requests on the thread
/// that made them: a socket's readiness comes through the reactor of the thread it was
/// registered on, so a connection used on another thread would have every read and write
/// woken across threads (an eventfd write and a context switch each).
pub struct Connector {
    dial: Dial,
    /// Each serving thread's idle connections, oldest first: connections are checked in in
    /// time order, so the expired ones are at the front and each check-in or check-out touches
    /// only the ends.
    idle: Mutex<HashMap<ThreadId, VecDeque<Idle>>>,
    idle_max: AtomicUsize,
}

/// A keep-alive connection with no exchange on it.
struct Idle {
    sender: SendRequest<Body>,
    connection: Pin<Box<UpstreamConnection>>,
    since: Instant,
}

impl Connector {
    pub fn new(dial: Dial, idle_max: usize) -> Arc<Self> {
        Arc::new(Self {
            dial,
            idle: Mutex::default(),
            idle_max: AtomicUsize::new(idle_max),
        })
    }

    /// Keeps at most `idle_max` idle connections from now on (a reload changed the limit).
    pub fn set_idle_max(&self, idle_max: usize) {
        self.idle_max.store(idle_max, Ordering::Relaxed);
    }

    fn idle(&self) -> std::sync::MutexGuard<'_, HashMap<ThreadId, VecDeque<Idle>>> {
        self.idle
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// This thread's most recent idle connection that is young and still open.
    fn check_out(&self) -> Option<Idle> {
        let mut pools = self.idle();
        let pool = pools.get_mut(&std::thread::current().id())?;
        while let Some(mut candidate) = pool.pop_back() {
            if candidate.since.elapsed() < IDLE_TTL && candidate.is_open() {
                return Some(candidate);
            }
        }
        None
    }

    /// Keeps a connection whose exchange ended cleanly, if it is still open, within
    /// `idle_max` in all (this thread's oldest go first).
    fn check_in(&self, mut idle: Idle) {
        if !idle.is_open() {
            return;
        }
        let max = self.idle_max.load(Ordering::Relaxed).max(1);
        let mut pools = self.idle();
        // One pool per serving thread: a sum over a handful.
        let mut count: usize = pools.values().map(VecDeque::len).sum();
        let pool = pools.entry(std::thread::current().id()).or_default();
        while pool
            .front()
            .is_some_and(|old| old.since.elapsed() >= IDLE_TTL || count >= max)
        {
            pool.pop_front();
            count -= 1;
        }
        if count < max {
            pool.push_back(idle);
        }
    }
}

impl Idle {
    /// Lets hyper read what the socket holds (a close, say) without waiting, then asks whether
    /// it would take a request.
    fn is_open(&mut self) -> bool {
        let mut cx = Context::from_waker(std::task::Waker::noop());
        if self.connection.as_mut().poll(&mut cx).is_ready() {
            return false;
        }
        self.sender.is_ready()
    }
}

impl std::fmt::Debug for Dial {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Tcp { authority, .. } => write!(f, "tcp {authority}"),
            Self::Memory(_) => f.write_str("in-memory"),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ExchangeError {
    #[error("cannot connect to {authority}")]
    Connect {
        authority: String,
        #[source]
        source: std::io::Error,
    },
    #[error("connecting to {authority} took longer than {} ms", timeout.as_millis())]
    ConnectTimeout {
        authority: String,
        timeout: Duration,
    },
    #[error("the upstream connection failed before the answer")]
    Http(#[source] hyper::Error),
}

type UpstreamConnection = Connection<TokioIo<Box<dyn Io>>, Body>;

/// A request sent and its answer being read. Drop ends the exchange: an answer read to its
/// end leaves its connection idle for the next request, anything else closes it.
pub struct Exchange {
    /// None once the connection has finished (the server closed it, or it failed).
    connection: Option<Pin<Box<UpstreamConnection>>>,
    /// Kept so the connection stays open for the next request.
    sender: Option<SendRequest<Body>>,
    body: Incoming,
    /// The answer was one document on a connection the server keeps open.
    keep_alive: bool,
    ended: bool,
    home: Arc<Connector>,
}

impl Exchange {
    /// Sends `request` on an idle connection or a new one, and waits for the response head.
    pub async fn start(
        connector: &Arc<Connector>,
        request: Request<Body>,
    ) -> Result<(Self, response::Parts), ExchangeError> {
        let (mut sender, connection) = match connector.check_out() {
            Some(idle) => (idle.sender, idle.connection),
            None => {
                let io = connect(&connector.dial).await?;
                // The answer's header names reach the client as the upstream spelled them
                // (hyper carries the spelling in the response's extensions).
                let (sender, connection) = http1::Builder::new()
                    .preserve_header_case(true)
                    .handshake(TokioIo::new(io))
                    .await
                    .map_err(ExchangeError::Http)?;
                (sender, Box::pin(connection))
            }
        };
        let mut connection = Some(connection);
        let response = {
            let mut sending = std::pin::pin!(sender.send_request(request));
            std::future::poll_fn(|cx| {
                drive(&mut connection, cx);
                sending.as_mut().poll(cx)
            })
            .await
            .map_err(ExchangeError::Http)?
        };
        let (head, body) = response.into_parts();
        let exchange = Self {
            connection,
            sender: Some(sender),
            body,
            keep_alive: keeps_alive(&head),
            ended: false,
            home: Arc::clone(connector),
        };
        Ok((exchange, head))
    }

    /// The next frame of the answer; None at its end.
    pub async fn frame(&mut self) -> Option<Result<Frame<Bytes>, hyper::Error>> {
        let frame = std::future::poll_fn(|cx| {
            drive(&mut self.connection, cx);
            Pin::new(&mut self.body).poll_frame(cx)
        })
        .await;
        self.ended |= frame.is_none();
        frame
    }

    /// Whether the whole answer has been read.
    pub fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    /// What the answer's head says of its length.
    pub fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

impl Drop for Exchange {
    fn drop(&mut self) {
        let ended = self.ended || self.body.is_end_stream();
        if !(ended && self.keep_alive) {
            // The socket closes with the connection, now.
            return;
        }
        if let (Some(connection), Some(sender)) = (self.connection.take(), self.sender.take()) {
            self.home.check_in(Idle {
                sender,
                connection,
                since: Instant::now(),
            });
        }
    }
}

/// Whether a connection may carry another request after this answer: a single document
/// (a stream's server may close the connection right after), over HTTP/1.1, not `close`.
fn keeps_alive(head: &response::Parts) -> bool {
    let media = head
        .headers
        .get(http::header::CONTENT_TYPE)
        .map_or(&b""[..], http::HeaderValue::as_bytes);
    let starts = |prefix: &[u8]| {
        media
            .get(..prefix.len())
            .is_some_and(|s| s.eq_ignore_ascii_case(prefix))
    };
    let streamed = starts(b"text/event-stream") || starts(b"application/x-ndjson");
    let close = head
        .headers
        .get_all(http::header::CONNECTION)
        .iter()
        .any(|v| {
            v.as_bytes()
                .windows(5)
                .any(|w| w.eq_ignore_ascii_case(b"close"))
        });
    head.version == http::Version::HTTP_11 && !streamed && !close
}

/// Polls the connection so that it reads and writes; forgets it once it has finished (the
/// body then reports its end or the error).
fn drive(connection: &mut Option<Pin<Box<UpstreamConnection>>>, cx: &mut Context<'_>) {
    if let Some(conn) = connection
        && let Poll::Ready(result) = conn.as_mut().poll(cx)
    {
        if let Err(err) = result {
            let error = crate::error_chain(&err);
            tracing::debug!(%error, "upstream connection ended with an error");
        }
        *connection = None;
    }
}

async fn connect(dial: &Dial) -> Result<Box<dyn Io>, ExchangeError> {
    match dial {
        Dial::Tcp {
            authority,
            connect_timeout,
        } => {
            let connecting = tokio::net::TcpStream::connect(authority.as_str());
            let stream = tokio::time::timeout(*connect_timeout, connecting)
                .await
                .map_err(|_| ExchangeError::ConnectTimeout {
                    authority: authority.clone(),
                    timeout: *connect_timeout,
                })?
                .map_err(|source| ExchangeError::Connect {
                    authority: authority.clone(),
                    source,
                })?;
            // Token-sized frames must not wait for Nagle.
            let _ = stream.set_nodelay(true);
            Ok(Box::new(stream))
        }
        Dial::Memory(make) => Ok(make()),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use http_body_util::{BodyExt as _, Empty, Full};
    use hyper::{server::conn::http1 as server, service::service_fn};

    use super::*;

    #[test]
    fn only_a_single_document_on_a_connection_not_closing_keeps_it() {
        let head = |version, headers: &[(&str, &str)]| {
            let mut builder = http::Response::builder().version(version);
            for (name, value) in headers {
                builder = builder.header(*name, *value);
            }
            builder.body(()).expect("response").into_parts().0
        };
        let json = [("content-type", "application/json")];
        assert!(keeps_alive(&head(http::Version::HTTP_11, &json)));
        assert!(!keeps_alive(&head(http::Version::HTTP_10, &json)));
        for streamed in ["Text/Event-Stream; charset=utf-8", "application/x-ndjson"] {
            let headers = [("content-type", streamed)];
            assert!(!keeps_alive(&head(http::Version::HTTP_11, &headers)));
        }
        let closing = [
            ("connection", "keep-alive"),
            ("connection", "Upgrade, CLOSE"),
        ];
        assert!(!keeps_alive(&head(http::Version::HTTP_11, &closing)));
        assert!(keeps_alive(&head(http::Version::HTTP_11, &[])));
    }

    /// A connector to an in-memory upstream that answers every request with one JSON
    /// document on a kept-alive connection; counts its dials.
    fn connector() -> (Arc<Connector>, Arc<AtomicUsize>) {
        let dials = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&dials);
        let dial: MemoryConnect = Arc::new(move || {
            counted.fetch_add(1, Ordering::Relaxed);
            let (ours, theirs) = tokio::io::duplex(4096);
            let answer = service_fn(|_| async {
                http::Response::builder()
                    .header("content-type", "application/json")
                    .body(Full::new(Bytes::from_static(b"{}")))
            });
            tokio::spawn(server::Builder::new().serve_connection(TokioIo::new(theirs), answer));
            Box::new(ours)
        });
        (Connector::new(Dial::Memory(dial), 4), dials)
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime")
    }

    /// One exchange read to its end on `runtime`, this thread's own.
    fn exchange(runtime: &tokio::runtime::Runtime, connector: &Arc<Connector>) {
        runtime.block_on(async {
            let request = Request::post("/api/chat")
                .header("host", "upstream")
                .body(Empty::new().map_err(Into::into).boxed())
                .expect("request");
            let (mut exchange, head) = Exchange::start(connector, request).await.expect("start");
            assert_eq!(head.status, 200);
            while exchange.frame().await.is_some() {}
        });
    }

    #[test]
    fn an_idle_connection_is_used_again_only_on_the_thread_that_made_it() {
        let (connector, dials) = connector();
        let here = runtime();
        exchange(&here, &connector);
        exchange(&here, &connector);
        assert_eq!(dials.load(Ordering::Relaxed), 1, "kept and used again");
        let elsewhere = Arc::clone(&connector);
        std::thread::spawn(move || exchange(&runtime(), &elsewhere))
            .join()
            .expect("another thread");
        assert_eq!(
            dials.load(Ordering::Relaxed),
            2,
            "another thread makes its own"
        );
        exchange(&here, &connector);
        assert_eq!(
            dials.load(Ordering::Relaxed),
            2,
            "this thread's is still kept"
        );
    }
}
