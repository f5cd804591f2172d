//! The proxy listener: accepts client connections and serves each with hyper until it ends,
//! its client is known to have left, or guard stops.

use std::{convert::Infallible, net::SocketAddr, sync::Arc, time::Duration};

use hyper::{server::conn::http1, service::service_fn};
use hyper_util::{
    rt::{TokioIo, TokioTimer},
    server::graceful::{GracefulShutdown, Watcher},
};
use tokio::{
    io::{AsyncRead, AsyncWrite},
    net::{TcpListener, TcpStream},
    sync::watch,
};

use super::{ErrorShape, Proxy, ProxyError, linger::Lingering, workers::Workers};
use crate::{
    config::Api,
    listen::{Accepted, Acceptor, Arrival},
    reap::userspace,
};

/// hyper's buffer limit for a client connection (its default is 400 KiB).
const READ_BUFFER: usize = 32 << 10;

/// Accepts connections until `shutdown` turns true, then waits for open connections to
/// finish their current request, at most `grace`. More than `server.max_connections` at once
/// are answered 503 and closed. Each connection is served on one of `workers`' threads.
pub async fn serve(
    listeners: Vec<TcpListener>,
    proxy: Arc<Proxy>,
    mut shutdown: watch::Receiver<bool>,
    grace: Duration,
    workers: Workers,
) {
    let graceful = GracefulShutdown::new();
    let refused = proxy
        .metrics
        .connections_refused_total
        .with_label_values(&["proxy"]);
    let mut acceptor = Acceptor::new(listeners, "proxy", proxy.max_connections, refused);
    loop {
        let arrival = tokio::select! {
            arrival = acceptor.next() => arrival,
            () = stop_requested(&mut shutdown) => break,
        };
        let Accepted {
            stream,
            peer,
            place,
        } = match arrival {
            Arrival::Accepted(accepted) => accepted,
            Arrival::OverCap(stream) => {
                refuse(&stream, proxy.settings().api);
                continue;
            }
        };
        proxy.metrics.connections.inc();
        let _ = stream.set_nodelay(true);
        let metrics = proxy.metrics.clone();
        // Without the kernel's events, watch the socket from user space. Duplicated here, at
        // accept: out of descriptors, accept itself pauses (and logs once a second).
        let watched = match proxy.tracker {
            Some(_) => None,
            None => userspace::duplicate(&stream)
                .inspect_err(
                    |err| tracing::warn!(%peer, %err, "cannot watch this client for closes"),
                )
                .ok(),
        };
        // Handed over as plain sockets: the serving thread registers them with its own
        // reactor, so that their readiness wakes that thread alone.
        let stream = stream.into_std();
        let serving = stream.and_then(|stream| {
            Ok(Handover {
                proxy: Arc::clone(&proxy),
                local: stream.local_addr()?,
                stream,
                watched,
                peer,
                graceful: graceful.watcher(),
            })
        });
        workers.next().spawn(async move {
            match serving {
                Ok(serving) => serving.serve().await,
                Err(err) => tracing::warn!(%peer, %err, "cannot hand the connection over"),
            }
            drop(place);
            metrics.connections.dec();
        });
    }
    drop(acceptor);
    if tokio::time::timeout(grace, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!(
            grace_ms = grace.as_millis(),
            "connections still open after the grace period"
        );
    }
    // Joining the threads blocks: not on this runtime's own threads.
    let _ = tokio::task::spawn_blocking(move || drop(workers)).await;
}

/// An accepted connection on its way to a serving thread.
struct Handover {
    proxy: Arc<Proxy>,
    stream: std::net::TcpStream,
    watched: Option<std::net::TcpStream>,
    peer: SocketAddr,
    /// The listener's address the client reached.
    local: SocketAddr,
    graceful: Watcher,
}

impl Handover {
    /// Serves the connection on the current thread.
    async fn serve(self) {
        let Self {
            proxy,
            stream,
            watched,
            peer,
            local,
            graceful,
        } = self;
        let registered = TcpStream::from_std(stream).and_then(|stream| {
            let watched = watched.map(TcpStream::from_std).transpose()?;
            Ok((stream, watched))
        });
        match registered {
            Ok((stream, watched)) => {
                serve_connection(proxy, stream, (peer, local), watched, Some(graceful)).await;
            }
            Err(err) => tracing::warn!(%peer, %err, "cannot serve the connection"),
        }
    }
}

/// A connection over the cap: a 503 if the socket takes it at once, then closed.
fn refuse(stream: &TcpStream, api: Api) {
    let shape = match api {
        Api::Ollama => ErrorShape::Ollama,
        Api::Openai => ErrorShape::Openai,
    };
    let _ = stream.try_write(&ProxyError::TooManyConnections.raw_response(shape));
}

/// Serves one client connection (from `peer`, to guard's `local` address) until it ends or its client is known to have left; then
/// every request still riding on it learns so (`Connection::gone`).
pub fn serve_connection<I>(
    proxy: Arc<Proxy>,
    io: I,
    (peer, local): (SocketAddr, SocketAddr),
    watched: Option<TcpStream>,
    graceful: Option<Watcher>,
) -> impl Future<Output = ()> + Send + use<I>
where
    I: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    let connection = proxy.connections.register(peer, local);
    let half_close = proxy.half_close_means_gone();
    let service = {
        let proxy = Arc::clone(&proxy);
        let connection = Arc::clone(&connection);
        service_fn(move |request| {
            let proxy = Arc::clone(&proxy);
            let connection = Arc::clone(&connection);
            async move { Ok::<_, Infallible>(proxy.handle(request, &connection).await) }
        })
    };
    let io = Lingering::new(io, Arc::clone(&connection));
    let serving = http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(proxy.header_read_timeout)
        // A connection's read and write buffers stay this small however large the body: a
        // request head over it is refused (431), and thousands of waiting clients hold only
        // their bodies.
        .max_buf_size(READ_BUFFER)
        .max_header_size(READ_BUFFER)
        .keep_alive(true)
        // The upstream's header names go out as it spelled them (the spelling rides in the
        // response); guard's own, and any without one, in the Title-Case the ecosystem uses
        // (`Retry-After`, `X-Guard-Class`).
        .title_case_headers(true)
        // hyper, too, ends a connection whose client half-closed with a request pending,
        // unless told that clients may half-close on purpose.
        .half_close(!half_close)
        .serve_connection(TokioIo::new(io), service);
    let serving: std::pin::Pin<Box<dyn Future<Output = hyper::Result<()>> + Send>> = match graceful
    {
        Some(graceful) => Box::pin(graceful.watch(serving)),
        None => Box::pin(serving),
    };
    async move {
        let watch = async {
            match watched {
                Some(socket) => userspace::watch(socket, &connection, half_close).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            biased;
            // The client left (or guard cut the connection): dropping hyper's side closes the
            // socket, and the requests on it conclude as they see `gone`.
            () = connection.gone() => {}
            () = watch => {}
            result = serving => {
                if let Err(err) = result {
                    tracing::debug!(%peer, %err, "client connection ended with an error");
                }
            }
        }
        connection.end();
        proxy.connections.unregister(&connection);
    }
}

/// Resolves once `shutdown` is true (or its sender is gone).
pub async fn stop_requested(shutdown: &mut watch::Receiver<bool>) {
    // The guard wait_for returns is not Send: drop it here, not in the caller's select.
    let _ = shutdown.wait_for(|stop| *stop).await;
}
