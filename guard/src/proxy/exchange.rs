//! One queued request's exchange with the upstream, on a connection of its own.
//!
//! The exchange drives its hyper connection itself (no spawned task), so dropping it closes
//! the socket at once: when its owner returns the permit after dropping it, the upstream
//! exchange is over. Nothing is ever sent twice: a fresh connection per request means no
//! pooled connection the server may have closed meanwhile, so no retry (nginx proxies to
//! upstreams the same way unless told to keep connections alive).

use std::{
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};

use bytes::Bytes;
use http::{Request, response};
use http_body::{Body as _, Frame};
use hyper::{
    body::Incoming,
    client::conn::http1::{self, Connection},
};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite};

use super::upstream::Body;

/// Any byte stream to the upstream: TCP in production, an in-memory pipe in unit tests.
pub trait Io: AsyncRead + AsyncWrite + Send + Unpin + 'static {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin + 'static> Io for T {}

/// Makes an in-memory connection to an in-process upstream (unit tests).
pub type MemoryConnect = Arc<dyn Fn() -> Box<dyn Io> + Send + Sync>;

/// How guard reaches the upstream for queued requests.
#[derive(Clone)]
pub enum Connector {
    Tcp {
        /// `host:port`.
        authority: String,
        connect_timeout: Duration,
    },
    Memory(MemoryConnect),
}

impl std::fmt::Debug for Connector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Tcp { authority, .. } => write!(f, "tcp {authority}"),
            Self::Memory(_) => f.write_str("in-memory"),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ExchangeError {
    #[error("cannot connect to {authority}: {source}")]
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
    #[error("the upstream connection failed before the answer: {0}")]
    Http(#[source] hyper::Error),
}

type UpstreamConnection = Connection<TokioIo<Box<dyn Io>>, Body>;

/// A request sent and its answer being read. Drop closes the connection.
pub struct Exchange {
    /// None once the connection has finished (the server closed it, or it failed).
    connection: Option<Pin<Box<UpstreamConnection>>>,
    body: Incoming,
}

impl Exchange {
    /// Connects, sends `request` and waits for the response head.
    pub async fn start(
        connector: &Connector,
        request: Request<Body>,
    ) -> Result<(Self, response::Parts), ExchangeError> {
        let io = connect(connector).await?;
        let (mut sender, connection) = http1::handshake(TokioIo::new(io))
            .await
            .map_err(ExchangeError::Http)?;
        let mut connection = Some(Box::pin(connection));
        let mut sending = std::pin::pin!(sender.send_request(request));
        let response = std::future::poll_fn(|cx| {
            drive(&mut connection, cx);
            sending.as_mut().poll(cx)
        })
        .await
        .map_err(ExchangeError::Http)?;
        let (head, body) = response.into_parts();
        Ok((Self { connection, body }, head))
    }

    /// The next frame of the answer; None at its end.
    pub async fn frame(&mut self) -> Option<Result<Frame<Bytes>, hyper::Error>> {
        std::future::poll_fn(|cx| {
            drive(&mut self.connection, cx);
            Pin::new(&mut self.body).poll_frame(cx)
        })
        .await
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

/// Polls the connection so that it reads and writes; forgets it once it has finished (the
/// body then reports its end or the error).
fn drive(connection: &mut Option<Pin<Box<UpstreamConnection>>>, cx: &mut Context<'_>) {
    if let Some(conn) = connection
        && let Poll::Ready(result) = conn.as_mut().poll(cx)
    {
        if let Err(err) = result {
            tracing::debug!(%err, "upstream connection ended with an error");
        }
        *connection = None;
    }
}

async fn connect(connector: &Connector) -> Result<Box<dyn Io>, ExchangeError> {
    match connector {
        Connector::Tcp {
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
        Connector::Memory(make) => Ok(make()),
    }
}
