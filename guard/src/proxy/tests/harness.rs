//! The in-process world of the proxy tests: the scripted upstream on in-memory pipes, clients
//! on pipes, metrics read from their handles.

use std::{
    sync::{
        Arc,
        atomic::{AtomicU16, Ordering},
    },
    time::Duration,
};

use bytes::Bytes;
use guard_testkit::{Mode, Polling, Script, Upstream, trickle, until_with};
use http::Request;
use http_body_util::{BodyExt as _, Full};
use hyper::client::conn::http1 as client;
use hyper_util::rt::TokioIo;
use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _, DuplexStream},
    task::JoinHandle,
};

use crate::{
    config::Config,
    metrics::Metrics,
    proxy::outcome::OUTCOMES,
    proxy::{Dial, Parts, Proxy, serve_connection},
    queue::Scheduler,
    reap::registry::Registry,
    watch::Watched,
};

/// Time between the scripted upstream's frames, unless a test says otherwise.
pub const GAP: Duration = Duration::from_millis(20);
/// A client pipe's buffer, each way.
const PIPE: usize = 64 << 10;

/// A plain stream of `count` frames, [`GAP`] apart.
pub fn frames(count: u64) -> Script {
    Script::new(Mode::Frames).frames(count, GAP)
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
    pub upstream: Upstream,
    next_port: AtomicU16,
}

impl Harness {
    pub fn new(config: Config) -> Self {
        let metrics = Metrics::new();
        let scheduler = Scheduler::new(&config, metrics.clone());
        let upstream = Upstream::in_memory();
        let connect = {
            let upstream = upstream.clone();
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
            // As the daemon does: `log.access` names the file.
            access: match &config.log.access {
                Some(path) => {
                    crate::access::AccessLog::open(path, metrics.access_log_dropped_total.clone())
                        .expect("the access log opens")
                }
                None => crate::access::AccessLog::off(),
            },
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
        Self::request_json(class, &script.json())
    }

    /// A request whose body is `body`: a script, with whatever else a client would send.
    fn request_json(class: &str, body: &serde_json::Value) -> Request<Full<Bytes>> {
        let body = serde_json::to_vec(body).expect("a JSON body");
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
        self.open_stalled_json(class, &script.json()).await
    }

    /// A chat client that asks for a stream (so a preemptible class can stop and go on with
    /// it), takes the response head and never reads the body.
    pub async fn open_stalled_chat(&self, class: &str, script: Script) -> Stalled {
        let mut body = script.json();
        body["stream"] = serde_json::json!(true);
        body["messages"] = serde_json::json!([{ "role": "user", "content": "go on" }]);
        self.open_stalled_json(class, &body).await
    }

    async fn open_stalled_json(&self, class: &str, body: &serde_json::Value) -> Stalled {
        let (io, peer) = self.client_at(4 << 10);
        let request = Self::request_json(class, body);
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
        let trickling = trickle(writer, vec![b' '; bytes], every);
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

    /// Lets the world run, in virtual time, until `condition` holds.
    pub async fn until(&self, condition: impl Fn() -> bool) {
        until_with(Polling::PAUSED, "the condition", async || condition()).await;
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
            "requests_total" => m.requests_total.at(labels).get(),
            "admitted_total" => m.admitted_total.at(labels).get(),
            "rejected_total" => m.rejected_total.at(labels).get(),
            "rejected_after_queueing_total" => m.rejected_after_queueing_total.at(labels).get(),
            "reaped_total" => m.reaped_total.at(labels).get(),
            "failed_total" => m.failed_total.at(labels).get(),
            "timed_out_total" => m.timed_out_total.at(labels).get(),
            "invalid_requests_total" => m.invalid_requests_total.at(labels).get(),
            "queue_depth" => m.queue_depth.at(labels).get() as u64,
            "inflight" => m.inflight.at(labels).get() as u64,
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
