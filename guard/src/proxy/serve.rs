//! The proxy listener: accepts client connections and serves each with hyper until it ends,
//! its client is known to have left, or guard stops; between requests an idle connection is
//! parked outside hyper (`park`).

use std::{convert::Infallible, net::SocketAddr, pin::Pin, sync::Arc, task::Poll, time::Duration};

use bytes::{Bytes, BytesMut};
use guard_net::{
    linger::Lingering,
    listen::{Accepted, Acceptor, Arrival},
    park::{Activity, Inbound, Outbound, Parkable, Watched},
    workers::Workers,
};
use http::{Request, Response};
use hyper::{
    body::Incoming,
    server::conn::http1,
    service::{Service, service_fn},
};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::{
    net::{TcpListener, TcpStream},
    sync::watch,
    time::Instant,
};
use tokio_util::task::TaskTracker;

use super::{ErrorShape, Proxy, ProxyError};
use crate::{
    config::Api,
    reap::{registry::Connection, userspace},
};

/// hyper's buffer limit for a client connection (its default is 400 KiB).
const READ_BUFFER: usize = 32 << 10;
// hyper answers a URI over 65,534 bytes 414, any other head too large 431: `unread_head` counts
// every head too large as 431, true while no such URI fits in the buffer.
const _: () = assert!(READ_BUFFER < 65_534);

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
    let open = TaskTracker::new();
    let refused = proxy
        .queued
        .metrics
        .connections_refused_total
        .of(&crate::metrics::labels::Listener { listener: "proxy" });
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
        proxy.queued.metrics.connections.inc();
        let _ = stream.set_nodelay(true);
        let metrics = proxy.queued.metrics.clone();
        // Without the kernel's events, watch the socket from user space. Duplicated here, at
        // accept: out of descriptors, accept itself pauses (and logs once a second).
        let watched = match proxy.queued.tracker {
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
                shutdown: shutdown.clone(),
            })
        });
        workers.next().spawn(open.track_future(async move {
            match serving {
                Ok(serving) => serving.serve().await,
                Err(err) => tracing::warn!(%peer, %err, "cannot hand the connection over"),
            }
            drop(place);
            metrics.connections.dec();
        }));
    }
    drop(acceptor);
    open.close();
    if tokio::time::timeout(grace, open.wait()).await.is_err() {
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
    /// Turns true when guard stops.
    shutdown: watch::Receiver<bool>,
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
            shutdown,
        } = self;
        let _open = guard_net::workers::OpenHere::count();
        let registered = TcpStream::from_std(stream).and_then(|stream| {
            let watched = watched.map(TcpStream::from_std).transpose()?;
            Ok((stream, watched))
        });
        match registered {
            Ok((stream, watched)) => {
                serve_connection(proxy, stream, (peer, local), watched, Some(shutdown)).await;
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

/// Serves one client connection (from `peer`, to guard's `local` address) until it ends or
/// its client is known to have left; then every request still riding on it learns so
/// (`Connection::gone`). With `shutdown` true, a request being served is finished and the
/// connection closes.
pub fn serve_connection<I: Parkable>(
    proxy: Arc<Proxy>,
    io: I,
    (peer, local): (SocketAddr, SocketAddr),
    watched: Option<TcpStream>,
    shutdown: Option<watch::Receiver<bool>>,
) -> impl Future<Output = ()> + Send + use<I> {
    let connection = proxy.connections.register(peer, local);
    let half_close = proxy.half_close_means_gone();
    async move {
        let watch = async {
            match watched {
                Some(socket) => userspace::watch(socket, &connection, half_close).await,
                None => std::future::pending().await,
            }
        };
        let io = Lingering::new(io, Arc::clone(&connection));
        tokio::select! {
            biased;
            // The client left (or guard cut the connection): dropping hyper's side closes the
            // socket, and the requests on it conclude as they see `gone`.
            () = connection.gone() => {}
            () = watch => {}
            () = sessions(&proxy, io, &connection, shutdown) => {}
        }
        connection.end();
        proxy.connections.unregister(&connection);
    }
}

/// hyper serves the connection while requests come; whenever it waits for the next request
/// with nothing left to send and more than `server.ready_connections` are in its hands, the
/// socket is taken back and parked, holding no buffer, until the client sends again. hyper's header-read timeout holds across: a connection that
/// completes no request head within it from its last answer (or its accept) is closed.
async fn sessions<I: Parkable>(
    proxy: &Arc<Proxy>,
    mut io: Lingering<I, Connection>,
    connection: &Arc<Connection>,
    mut shutdown: Option<watch::Receiver<bool>>,
) {
    let timeout = proxy.header_read_timeout;
    let mut deadline = Instant::now() + timeout;
    let mut leftover = Bytes::new();
    loop {
        if I::PARKS && !park(proxy, &io, deadline, &mut shutdown).await {
            return;
        }
        let activity = Arc::new(Activity::default());
        let session = Session {
            proxy,
            connection,
            activity: &activity,
            deadline,
        };
        let Some((back, rest)) = session.run(io, leftover, &mut shutdown).await else {
            return;
        };
        // A session parks only after an answer: the next head is due from now.
        (io, leftover) = (back, rest);
        deadline = Instant::now() + timeout;
    }
}

/// Waits, holding only the socket, until the client sends (true), or until the connection is
/// to close (false): its next request head is due (hyper, too, closes without a word then),
/// or guard stops.
async fn park<I: Parkable>(
    proxy: &Proxy,
    io: &Lingering<I, Connection>,
    deadline: Instant,
    shutdown: &mut Option<watch::Receiver<bool>>,
) -> bool {
    // Counted while parked, however the wait ends (the client may leave meanwhile).
    let _parked = Counted::new(&proxy.queued.metrics.connections_parked);
    tokio::select! {
        biased;
        () = stopping(shutdown) => false,
        () = tokio::time::sleep_until(deadline) => false,
        ready = io.get_ref().readable() => ready.is_ok(),
    }
}

/// One unit of a gauge, for as long as it lives.
struct Counted<'a>(&'a prometheus::IntGauge);

impl<'a> Counted<'a> {
    fn new(gauge: &'a prometheus::IntGauge) -> Self {
        gauge.inc();
        Self(gauge)
    }
}

impl Drop for Counted<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// One stretch of a connection in hyper's hands.
struct Session<'a> {
    proxy: &'a Arc<Proxy>,
    connection: &'a Arc<Connection>,
    activity: &'a Arc<Activity>,
    /// The next request head must be complete by then.
    deadline: Instant,
}

impl Session<'_> {
    /// Serves requests until hyper waits for the next with nothing left to send: returns the
    /// socket and what hyper read of a next request; None once the connection is over.
    async fn run<I: Parkable>(
        self,
        io: Lingering<I, Connection>,
        leftover: Bytes,
        shutdown: &mut Option<watch::Receiver<bool>>,
    ) -> Option<(Lingering<I, Connection>, Bytes)> {
        let io = Watched::new(io, leftover, Arc::clone(self.activity));
        let half_close = self.proxy.half_close_means_gone();
        // Boxed: while the connection is parked, none of hyper's state is held.
        let mut hyper = Box::new(
            builder(self.proxy.header_read_timeout, half_close)
                .serve_connection(TokioIo::new(io), self.service()),
        );
        // hyper times each head from when it begins to wait for it; the first one's time
        // began at the last answer (or the accept), before the wait outside hyper.
        let mut first_head = std::pin::pin!(tokio::time::sleep_until(self.deadline));
        let mut stop = std::pin::pin!(stopping(shutdown));
        let (mut stopping, mut parks) = (false, I::PARKS);
        let parked = std::future::poll_fn(|cx| {
            if !stopping && stop.as_mut().poll(cx).is_ready() {
                stopping = true;
                Pin::new(&mut *hyper).graceful_shutdown();
            }
            if let Poll::Ready(result) = Pin::new(&mut *hyper).poll(cx) {
                return Poll::Ready(ended(result, self.proxy, self.connection));
            }
            if !self.activity.has_heads() && first_head.as_mut().poll(cx).is_ready() {
                // As hyper does at its own header timeout: closed without an answer.
                tracing::debug!(peer = %self.connection.peer, "no request head in time");
                return Poll::Ready(false);
            }
            if stopping || !parks || !self.activity.take_waiting() || !self.crowded() {
                return Poll::Pending;
            }
            // Idle, hyper closes at once without a word on the wire; and its shutdown of the
            // socket is skipped, so the socket comes back whole.
            self.activity.set_parking(true);
            Pin::new(&mut *hyper).graceful_shutdown();
            match Pin::new(&mut *hyper).poll(cx) {
                Poll::Ready(Ok(())) => Poll::Ready(true),
                Poll::Ready(result) => Poll::Ready(ended(result, self.proxy, self.connection)),
                Poll::Pending => {
                    // hyper was not idle after all: it ends the connection after this
                    // exchange, and closes the socket as it always does.
                    self.activity.set_parking(false);
                    parks = false;
                    Poll::Pending
                }
            }
        })
        .await;
        if !parked {
            return None;
        }
        let parts = hyper.into_parts();
        let (io, unread) = parts.io.into_inner().into_parts();
        // Copied: the bytes hyper read keep its whole read buffer alive.
        let mut rest = BytesMut::with_capacity(parts.read_buf.len() + unread.len());
        rest.extend_from_slice(&parts.read_buf);
        rest.extend_from_slice(&unread);
        Some((io, rest.freeze()))
    }

    /// Whether more connections are in hyper's hands than `server.ready_connections`: then an
    /// idle one leaves. Below it, an idle connection stays in hyper, ready for its next
    /// request at no cost (parking and coming back cost about a tenth of a small request).
    fn crowded(&self) -> bool {
        // Every open connection is parked or in hyper's hands.
        let metrics = &self.proxy.queued.metrics;
        let in_hyper = metrics.connections.get() - metrics.connections_parked.get();
        usize::try_from(in_hyper).is_ok_and(|n| n > self.proxy.ready_connections)
    }

    /// The proxy's handler, each request's body and answer carrying a token of the session's
    /// activity.
    fn service(
        &self,
    ) -> impl Service<
        Request<Incoming>,
        Response = Response<Outbound<crate::upstream::Body>>,
        Error = Infallible,
        Future: Send + 'static,
    > + Send
    + Unpin
    + 'static {
        let (proxy, connection) = (Arc::clone(self.proxy), Arc::clone(self.connection));
        let activity = Arc::clone(self.activity);
        service_fn(move |request: Request<Incoming>| {
            let (inbound, outbound) = activity.begin();
            let request = request.map(|body| Inbound::new(body, inbound));
            let (proxy, connection) = (Arc::clone(&proxy), Arc::clone(&connection));
            async move {
                let response = proxy.handle(request, &connection).await;
                Ok::<_, Infallible>(response.map(|body| Outbound::new(body, outbound)))
            }
        })
    }
}

/// hyper's settings for a client connection; `head_within` bounds each request head, from
/// when hyper begins to wait for it.
fn builder(head_within: Duration, half_close_means_gone: bool) -> http1::Builder {
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(head_within)
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
        .half_close(!half_close_means_gone);
    builder
}

/// The connection is over; hyper's error, if any, is logged (a head it refused, also counted
/// and written to the access log).
fn ended(result: hyper::Result<()>, proxy: &Proxy, connection: &Arc<Connection>) -> bool {
    if let Err(err) = result {
        proxy.unread_head(&err, connection);
        let error = crate::error_chain(&err);
        tracing::debug!(peer = %connection.peer, %error, "client connection ended with an error");
    }
    false
}

/// Resolves once guard stops; never without a shutdown signal.
async fn stopping(shutdown: &mut Option<watch::Receiver<bool>>) {
    match shutdown {
        Some(shutdown) => stop_requested(shutdown).await,
        None => std::future::pending().await,
    }
}

/// Resolves once `shutdown` is true (or its sender is gone).
pub async fn stop_requested(shutdown: &mut watch::Receiver<bool>) {
    // The guard wait_for returns is not Send: drop it here, not in the caller's select.
    let _ = shutdown.wait_for(|stop| *stop).await;
}
