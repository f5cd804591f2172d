//! The in-process world of the proxy tests: a scripted upstream that counts the exchanges in
//! flight (a request arrived, its answer not yet all produced, and guard has not closed the
//! connection); clients on pipes; metrics read from their handles.

use std::{
    convert::Infallible,
    pin::Pin,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU16, AtomicUsize, Ordering},
    },
    task::{Context, Poll},
    time::Duration,
};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt as _, Full, StreamBody};
use hyper::{
    body::{Frame, Incoming},
    client::conn::http1 as client,
    server::conn::http1 as server,
    service::service_fn,
};
use hyper_util::rt::TokioIo;
use serde::{Deserialize, Serialize};
use tokio::{
    io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _, DuplexStream, ReadBuf},
    sync::mpsc,
    task::JoinHandle,
    time::Instant,
};

use crate::{
    config::Config,
    metrics::Metrics,
    proxy::outcome::OUTCOMES,
    proxy::{Dial, Parts, Proxy, serve_connection},
    queue::Scheduler,
    reap::registry::Registry,
    upstream::BoxError,
    watch::Watched,
};

/// Time between the scripted upstream's frames, unless a script says otherwise.
pub const GAP: Duration = Duration::from_millis(20);
/// A pipe's buffer, each way.
const PIPE: usize = 64 << 10;

/// How the scripted upstream ends an answer after its frames.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Then {
    #[default]
    End,
    /// Sends nothing more and keeps the connection open.
    Hang,
    /// Breaks the connection mid-answer.
    Reset,
    /// Answers 500 at once.
    Fail500,
    /// Answers 200 with one JSON document at once (no stream).
    Json,
}

/// What the scripted upstream does for one request; sent as the request's body.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Script {
    frames: u64,
    gap_ms: u64,
    frame_bytes: usize,
    then: Then,
    /// Time before the answer's head.
    head_ms: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    max_tokens: Option<u64>,
}

impl Script {
    pub fn frames(frames: u64) -> Self {
        Self {
            frames,
            gap_ms: GAP.as_millis() as u64,
            frame_bytes: 0,
            then: Then::End,
            head_ms: 0,
            max_tokens: None,
        }
    }

    /// Waits this long before answering at all.
    pub fn head_after(mut self, delay: Duration) -> Self {
        self.head_ms = delay.as_millis() as u64;
        self
    }

    pub fn gap(mut self, gap: Duration) -> Self {
        self.gap_ms = gap.as_millis() as u64;
        self
    }

    pub fn sized(mut self, bytes: usize) -> Self {
        self.frame_bytes = bytes;
        self
    }

    pub fn then(mut self, then: Then) -> Self {
        self.then = then;
        self
    }

    /// Says how many tokens the request asks for (`max_tokens`), as clients do.
    pub fn tokens(mut self, tokens: u64) -> Self {
        self.max_tokens = Some(tokens);
        self
    }
}

/// The scripted upstream's view: exchanges in flight, connections, and when each began.
#[derive(Default)]
pub struct Upstream {
    open: AtomicUsize,
    peak: AtomicUsize,
    connections: AtomicUsize,
    dials: AtomicUsize,
    starts: Mutex<Vec<Instant>>,
}

/// One connection's exchange state, shared by guard's end and the server's.
#[derive(Default)]
struct Wire {
    in_flight: std::sync::atomic::AtomicBool,
}

impl Upstream {
    pub fn open(&self) -> usize {
        self.open.load(Ordering::SeqCst)
    }

    pub fn peak(&self) -> usize {
        self.peak.load(Ordering::SeqCst)
    }

    pub fn reset_peak(&self) {
        self.peak.store(self.open(), Ordering::SeqCst);
    }

    pub fn starts(&self) -> Vec<Instant> {
        self.starts
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    pub fn started(&self) -> usize {
        self.starts().len()
    }

    /// Connections guard holds to the upstream (idle ones included).
    pub fn connections(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }

    /// Connections guard has opened in all.
    pub fn dials(&self) -> usize {
        self.dials.load(Ordering::SeqCst)
    }

    fn begin(&self, wire: &Wire) {
        if !wire.in_flight.swap(true, Ordering::SeqCst) {
            let open = self.open.fetch_add(1, Ordering::SeqCst) + 1;
            self.peak.fetch_max(open, Ordering::SeqCst);
        }
    }

    fn end(&self, wire: &Wire) {
        if wire.in_flight.swap(false, Ordering::SeqCst) {
            self.open.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Opens a connection for guard, served by the scripted upstream.
    fn connect(self: &Arc<Self>) -> Counted {
        self.connections.fetch_add(1, Ordering::SeqCst);
        self.dials.fetch_add(1, Ordering::SeqCst);
        let (guard_end, server_end) = tokio::io::duplex(PIPE);
        let wire = Arc::new(Wire::default());
        let (upstream, served) = (Arc::clone(self), Arc::clone(&wire));
        tokio::spawn(async move {
            let service = service_fn(move |request| {
                answer(Arc::clone(&upstream), Arc::clone(&served), request)
            });
            let _ = server::Builder::new()
                .serve_connection(TokioIo::new(server_end), service)
                .await;
        });
        Counted {
            inner: guard_end,
            upstream: Arc::clone(self),
            wire,
        }
    }
}

/// guard's end of an upstream connection: dropping it ends any exchange on it at once.
struct Counted {
    inner: DuplexStream,
    upstream: Arc<Upstream>,
    wire: Arc<Wire>,
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.upstream.end(&self.wire);
        self.upstream.connections.fetch_sub(1, Ordering::SeqCst);
    }
}

impl AsyncRead for Counted {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for Counted {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

type UpstreamBody = http_body_util::combinators::BoxBody<Bytes, BoxError>;

/// The scripted upstream answers one request: SSE frames, then as its script says.
async fn answer(
    upstream: Arc<Upstream>,
    wire: Arc<Wire>,
    request: Request<Incoming>,
) -> Result<Response<UpstreamBody>, Infallible> {
    let body = request
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let script: Script = serde_json::from_slice(&body).expect("a script");
    upstream.begin(&wire);
    upstream
        .starts
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .push(Instant::now());
    tokio::time::sleep(Duration::from_millis(script.head_ms)).await;
    if matches!(script.then, Then::Fail500 | Then::Json) {
        let (status, text) = match script.then {
            Then::Fail500 => (
                http::StatusCode::INTERNAL_SERVER_ERROR,
                "{\"error\":\"boom\"}",
            ),
            _ => (http::StatusCode::OK, "{\"content\":\"done\"}"),
        };
        let body = Full::new(Bytes::from_static(text.as_bytes()))
            .map_err(|never| match never {})
            .boxed();
        let mut response = Response::new(body);
        *response.status_mut() = status;
        upstream.end(&wire);
        return Ok(response);
    }
    let (frames, receiver) = mpsc::channel::<Result<Frame<Bytes>, BoxError>>(1);
    tokio::spawn(async move {
        play(script, frames).await;
        upstream.end(&wire);
    });
    let stream = futures_util::stream::unfold(receiver, |mut receiver| async move {
        receiver.recv().await.map(|item| (item, receiver))
    });
    let mut response = Response::new(StreamBody::new(stream).boxed());
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("text/event-stream"),
    );
    Ok(response)
}

async fn play(script: Script, frames: mpsc::Sender<Result<Frame<Bytes>, BoxError>>) {
    let gap = Duration::from_millis(script.gap_ms);
    for index in 0..script.frames {
        tokio::time::sleep(gap).await;
        let mut event = format!("data: {{\"i\":{index}}}");
        if event.len() < script.frame_bytes {
            event.push_str(&" ".repeat(script.frame_bytes - event.len()));
        }
        event.push_str("\n\n");
        if frames
            .send(Ok(Frame::data(Bytes::from(event))))
            .await
            .is_err()
        {
            return;
        }
    }
    match script.then {
        Then::End | Then::Fail500 | Then::Json => {}
        Then::Hang => frames.closed().await,
        Then::Reset => {
            let _ = frames.send(Err("reset by the script".into())).await;
        }
    }
}

/// A client that never reads its answer.
pub struct Stalled {
    pub task: JoinHandle<()>,
    peer: std::net::SocketAddr,
}

/// What a client got.
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub headers: http::HeaderMap,
    pub frames: Vec<String>,
    /// The answer ended cleanly (not cut).
    pub clean_end: bool,
}

impl Answer {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    pub fn body(&self) -> String {
        self.frames.concat()
    }
}

/// A proxy with its scheduler and metrics, in front of the scripted upstream.
pub struct Harness {
    pub proxy: Arc<Proxy>,
    pub metrics: Metrics,
    pub scheduler: Arc<Scheduler>,
    pub upstream: Arc<Upstream>,
    next_port: AtomicU16,
}

impl Harness {
    pub fn new(config: Config) -> Self {
        let metrics = Metrics::new();
        let scheduler = Scheduler::new(&config, metrics.clone());
        let upstream = Arc::new(Upstream::default());
        let connect = {
            let upstream = Arc::clone(&upstream);
            Arc::new(move || Box::new(upstream.connect()) as Box<dyn crate::upstream::exchange::Io>)
        };
        let parts = Parts {
            metrics: metrics.clone(),
            scheduler: Arc::clone(&scheduler),
            connections: Arc::new(Registry::default()),
            tracker: None,
            watched: Arc::new(Watched::default()),
            ttft: Arc::default(),
            tally: Arc::new(crate::classify::Tally::new(&metrics)),
            throughput: Arc::default(),
            resume_kinds: Arc::default(),
        };
        let proxy = Proxy::with_dial(&config, parts, Dial::Memory(connect)).expect("a proxy");
        Self {
            proxy: Arc::new(proxy),
            metrics,
            scheduler,
            upstream,
            next_port: AtomicU16::new(40_000),
        }
    }

    /// A client's end of a new connection, which guard serves as it serves TCP.
    fn client(&self, buffer: usize) -> DuplexStream {
        self.client_at(buffer).0
    }

    fn client_at(&self, buffer: usize) -> (DuplexStream, std::net::SocketAddr) {
        let (client_end, guard_end) = tokio::io::duplex(buffer);
        let port = self.next_port.fetch_add(1, Ordering::Relaxed);
        let peer = std::net::SocketAddr::from(([127, 0, 0, 1], port));
        tokio::spawn(serve_connection(
            Arc::clone(&self.proxy),
            guard_end,
            (peer, std::net::SocketAddr::from(([127, 0, 0, 1], 11434))),
            None,
            None,
        ));
        (client_end, peer)
    }

    fn request(class: &str, script: &Script) -> Request<Full<Bytes>> {
        let body = serde_json::to_vec(script).expect("script");
        Request::post("/v1/chat/completions")
            .header("host", "guard")
            .header("content-type", "application/json")
            .header("x-guard-class", class)
            .body(Full::new(Bytes::from(body)))
            .expect("request")
    }

    /// Sends one request on a connection of its own and reads the whole answer.
    pub async fn send(&self, class: &str, script: Script) -> Answer {
        exchange(self.client(PIPE), Self::request(class, &script)).await
    }

    pub fn spawn(&self, class: &str, script: Script) -> JoinHandle<Answer> {
        let (io, request) = (self.client(PIPE), Self::request(class, &script));
        tokio::spawn(exchange(io, request))
    }

    /// Like `spawn`, for runs that only count outcomes.
    pub fn spawn_any(&self, class: &str, script: Script) -> JoinHandle<()> {
        let answer = self.spawn(class, script);
        tokio::spawn(async move {
            let _ = answer.await;
        })
    }

    /// A client that sends its request and leaves after `after`, wherever it then is.
    pub fn leave_after(&self, class: &str, script: Script, after: Duration) -> JoinHandle<()> {
        let answer = self.spawn(class, script);
        tokio::spawn(async move {
            tokio::time::sleep(after).await;
            answer.abort();
        })
    }

    /// A client that sends its request, takes the response head and never reads the body.
    pub async fn open_stalled(&self, class: &str, script: Script) -> Stalled {
        let (io, peer) = self.client_at(4 << 10);
        let request = Self::request(class, &script);
        let task = tokio::spawn(async move {
            let (mut sender, connection) = client::handshake(TokioIo::new(io))
                .await
                .expect("handshake");
            let mut connection = std::pin::pin!(connection);
            let _held = tokio::select! {
                response = sender.send_request(request) => response,
                _ = &mut connection => return,
            };
            let _ = connection.await;
        });
        Stalled { task, peer }
    }

    /// The client leaves: its pipe closes, and the kernel's event (here, its stand-in) says so.
    pub fn leave(&self, client: &Stalled) {
        client.task.abort();
        if let Some(connection) = self.proxy.connections.find(client.peer) {
            connection.mark_gone(crate::reap::event::monotonic_now());
        }
    }

    /// A client that announces `bytes` of body and sends one byte every `every`.
    pub async fn trickle(&self, class: &str, bytes: usize, every: Duration) -> Answer {
        let io = self.client(PIPE);
        let (mut reader, mut writer) = tokio::io::split(io);
        let head = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: guard\r\nx-guard-class: {class}\r\ncontent-length: {bytes}\r\n\r\n"
        );
        writer.write_all(head.as_bytes()).await.expect("head");
        let trickling = tokio::spawn(async move {
            for _ in 0..bytes {
                if writer.write_all(b" ").await.is_err() {
                    return;
                }
                tokio::time::sleep(every).await;
            }
        });
        let mut seen = Vec::new();
        let mut buffer = [0u8; 1024];
        while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
            match reader.read(&mut buffer).await {
                Ok(0) | Err(_) => break,
                Ok(n) => seen.extend_from_slice(&buffer[..n]),
            }
        }
        trickling.abort();
        let text = String::from_utf8_lossy(&seen).into_owned();
        let status = text
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        Answer {
            status,
            headers: http::HeaderMap::new(),
            frames: vec![text],
            clean_end: true,
        }
    }

    /// Lets the world run, in virtual time, until `condition` holds (at most two minutes).
    pub async fn until(&self, condition: impl Fn() -> bool) {
        let started = Instant::now();
        while !condition() {
            for _ in 0..64 {
                tokio::task::yield_now().await;
                if condition() {
                    return;
                }
            }
            assert!(
                started.elapsed() < Duration::from_secs(120),
                "the condition never held"
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// Waits until nothing waits, runs, or has an exchange at the upstream.
    pub async fn settle(&self) {
        self.until(|| self.scheduler.load() == (0, 0) && self.upstream.open() == 0)
            .await;
        // The owners record their outcome right after they let go.
        for _ in 0..64 {
            tokio::task::yield_now().await;
        }
    }

    /// A counter or gauge by its name without `guard_`, and its label values.
    pub fn count(&self, name: &str, labels: &[&str]) -> u64 {
        let m = &self.metrics;
        match name {
            "requests_total" => m.requests_total.with_label_values(labels).get(),
            "admitted_total" => m.admitted_total.with_label_values(labels).get(),
            "rejected_total" => m.rejected_total.with_label_values(labels).get(),
            "rejected_after_queueing_total" => m
                .rejected_after_queueing_total
                .with_label_values(labels)
                .get(),
            "reaped_total" => m.reaped_total.with_label_values(labels).get(),
            "failed_total" => m.failed_total.with_label_values(labels).get(),
            "timed_out_total" => m.timed_out_total.with_label_values(labels).get(),
            "invalid_requests_total" => m.invalid_requests_total.with_label_values(labels).get(),
            "queue_depth" => m.queue_depth.with_label_values(labels).get() as u64,
            "inflight" => m.inflight.with_label_values(labels).get() as u64,
            other => panic!("no metric {other} in the harness"),
        }
    }

    /// A class's outcomes that happened, with their counts.
    pub fn outcomes(&self, class: &str) -> Vec<(&'static str, u64)> {
        OUTCOMES
            .iter()
            .map(|outcome| (*outcome, self.count("requests_total", &[class, outcome])))
            .filter(|(_, count)| *count > 0)
            .collect()
    }

    /// Accepted = completed + reaped + failed + timed out + rejected after queueing + in
    /// flight + queued, for every class.
    pub fn assert_invariant(&self) {
        for class in ["interactive", "batch"] {
            let outcome = |label: &str| self.count("requests_total", &[class, label]);
            let accounted = outcome("completed")
                + outcome("reaped")
                + outcome("failed")
                + outcome("timed_out")
                + self.count(
                    "rejected_after_queueing_total",
                    &[class, "deadline_expired"],
                )
                + self.count("rejected_after_queueing_total", &[class, "shutting_down"])
                + self.count("inflight", &[class])
                + self.count("queue_depth", &[class]);
            let admitted = self.count("admitted_total", &[class]);
            assert_eq!(admitted, accounted, "{class}: {}", self.metrics.render());
        }
    }
}

/// Sends `request` on `io` and reads the answer frame by frame.
async fn exchange(io: DuplexStream, request: Request<Full<Bytes>>) -> Answer {
    let (mut sender, connection) = client::handshake(TokioIo::new(io))
        .await
        .expect("handshake");
    // Dropped with this future (a client that leaves): the connection goes with it.
    let _driving = AbortOnDrop(tokio::spawn(async move {
        let _ = connection.await;
    }));
    let response = sender.send_request(request).await.expect("a response");
    let (head, mut body) = response.into_parts();
    let mut frames = Vec::new();
    let clean_end = loop {
        match body.frame().await {
            None => break true,
            Some(Err(_)) => break false,
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    frames.push(String::from_utf8_lossy(&data).into_owned());
                }
            }
        }
    };
    Answer {
        status: head.status.as_u16(),
        headers: head.headers,
        frames,
        clean_end,
    }
}

/// Aborts a task when dropped.
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
