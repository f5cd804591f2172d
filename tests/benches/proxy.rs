//! `cargo xtask bench proxy`: what guard costs and what it buys, each figure measured side by
//! side in one run.
//!
//! 1. Added latency over direct, p50 and p99, against a fast local upstream (targets: at most
//!    100 us at p50 and 1 ms at p99).
//! 2. Streaming relay throughput against direct (target: at least 95 %).
//! 3. Time to answer a request for a full class (target: p99 under 1 ms).
//! 4. Interactive TTFT p95 under a batch flood on the real llama-server, guard against direct
//!    (target: guard within 1.5x the idle p95 plus one batch request's service time).

use std::{
    convert::Infallible,
    net::SocketAddr,
    pin::Pin,
    task::{Context, Poll},
    time::{Duration, Instant},
};

use bytes::Bytes;
use guard_tests::{
    servers::{GuardProcess, LlamaServer},
    workload::{self, Shape, percentile},
};
use http_body_util::{BodyExt as _, Full};
use hyper::{Request, Response, body::Frame, server::conn::http1, service::service_fn};
use hyper_util::rt::TokioIo;

const LATENCY_REQUESTS: usize = 3_000;
const STREAM_BYTES: usize = 256 << 20;
const CHUNK: usize = 64 << 10;
const REJECTIONS: usize = 2_000;
const SMALL_FRAMES: usize = 100_000;
const SMALL_FRAME: usize = 160;

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    // `cargo bench --bench proxy -- relay` runs one part; no argument runs them all.
    let only: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let wanted = |part: &str| only.is_empty() || only.iter().any(|o| o == part);
    runtime.block_on(async {
        let upstream = fake_upstream().await;
        if wanted("latency") {
            added_latency(upstream).await;
        }
        if wanted("relay") {
            relay_throughput(upstream).await;
        }
        if wanted("full") {
            full_class_answer(upstream).await;
        }
        if wanted("flood") {
            flood_ttft().await;
        }
    });
}

/// A body of `remaining` zero bytes in CHUNK-sized frames, produced as fast as it is read.
struct Zeros {
    remaining: usize,
    chunk: Bytes,
}

impl hyper::body::Body for Zeros {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if self.remaining == 0 {
            return Poll::Ready(None);
        }
        let n = self.remaining.min(self.chunk.len());
        self.remaining -= n;
        Poll::Ready(Some(Ok(Frame::data(self.chunk.slice(..n)))))
    }
}

type AnyBody = http_body_util::combinators::BoxBody<Bytes, Infallible>;

/// Answers /v1/chat/completions at once, streams STREAM_BYTES on /completion, and never
/// answers /v1/embeddings (a request that occupies its slot).
async fn fake_upstream() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let _ = stream.set_nodelay(true);
            tokio::spawn(async move {
                let service = service_fn(|request: Request<hyper::body::Incoming>| async move {
                    let path = request.uri().path().to_owned();
                    let _ = request.into_body().collect().await;
                    let body: AnyBody = match path.as_str() {
                        "/completion" => Zeros {
                            remaining: STREAM_BYTES,
                            chunk: Bytes::from(vec![0u8; CHUNK]),
                        }
                        .boxed(),
                        // Token-sized events, as an SSE stream of a chat looks.
                        "/v1/completions" => Zeros {
                            remaining: SMALL_FRAMES * SMALL_FRAME,
                            chunk: Bytes::from(vec![b'x'; SMALL_FRAME]),
                        }
                        .boxed(),
                        "/v1/embeddings" => std::future::pending::<AnyBody>().await,
                        _ => Full::new(Bytes::from_static(b"{\"ok\":true}")).boxed(),
                    };
                    Ok::<_, Infallible>(Response::new(body))
                });
                let _ = http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    addr
}

type Sender = hyper::client::conn::http1::SendRequest<Full<Bytes>>;

async fn client(addr: SocketAddr) -> Sender {
    let stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    stream.set_nodelay(true).expect("nodelay");
    let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .expect("handshake");
    tokio::spawn(connection);
    sender
}

/// Sends one request on a kept-alive connection; returns its status and the time to its end.
async fn timed(sender: &mut Sender, path: &str, class: Option<&str>) -> (u16, Duration, usize) {
    sender.ready().await.expect("ready");
    let mut request = Request::post(path)
        .header("host", "bench")
        .header("content-type", "application/json");
    if let Some(class) = class {
        request = request.header("x-guard-class", class);
    }
    let request = request
        .body(Full::new(Bytes::from_static(
            b"{\"model\":\"m\",\"prompt\":\"x\"}",
        )))
        .expect("request");
    let started = Instant::now();
    let response = sender.send_request(request).await.expect("response");
    let status = response.status().as_u16();
    let mut body = response.into_body();
    let mut bytes = 0;
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.expect("frame").into_data() {
            bytes += data.len();
        }
    }
    (status, started.elapsed(), bytes)
}

fn start_guard(upstream: SocketAddr, extra: &str) -> GuardProcess {
    GuardProcess::start(upstream, "openai", extra)
}

const ROOMY: &str = "[upstream]\nmax_concurrency = 64\n[class.interactive]\nmax_queue = 1000\n[class.batch]\npriority = 10\nmax_queue = 1\n";

async fn added_latency(upstream: SocketAddr) {
    let guard = start_guard(upstream, ROOMY);
    let mut direct = client(upstream).await;
    let mut guarded = client(guard.listen).await;
    let (mut d, mut g) = (Vec::new(), Vec::new());
    // Alternate, so drift in the machine's load falls on both alike.
    for _ in 0..LATENCY_REQUESTS {
        d.push(timed(&mut direct, "/v1/chat/completions", None).await.1);
        g.push(timed(&mut guarded, "/v1/chat/completions", None).await.1);
    }
    let us = |x: Duration| x.as_secs_f64() * 1e6;
    let (d50, d99, g50, g99) = (
        percentile(&d, 0.5),
        percentile(&d, 0.99),
        percentile(&g, 0.5),
        percentile(&g, 0.99),
    );
    println!(
        "1. added latency, {LATENCY_REQUESTS} queued-endpoint requests each, kept-alive connections:"
    );
    println!(
        "   direct p50 {:.0} us, p99 {:.0} us; through guard p50 {:.0} us, p99 {:.0} us",
        us(d50),
        us(d99),
        us(g50),
        us(g99)
    );
    println!(
        "   added: p50 {:.0} us (target <= 100), p99 {:.0} us (target <= 1000); ratio p50 {:.2}x",
        us(g50.saturating_sub(d50)),
        us(g99.saturating_sub(d99)),
        g50.as_secs_f64() / d50.as_secs_f64()
    );
}

async fn relay_throughput(upstream: SocketAddr) {
    let guard = start_guard(upstream, ROOMY);
    let mut direct = client(upstream).await;
    let mut guarded = client(guard.listen).await;
    let mut rates = [Vec::new(), Vec::new()];
    for _ in 0..3 {
        for (i, sender) in [&mut direct, &mut guarded].into_iter().enumerate() {
            let (status, took, bytes) = timed(sender, "/completion", None).await;
            assert_eq!((status, bytes), (200, STREAM_BYTES));
            rates[i].push(bytes as f64 / took.as_secs_f64() / (1 << 20) as f64);
        }
    }
    let best = |r: &Vec<f64>| r.iter().copied().fold(0.0, f64::max);
    let (d, g) = (best(&rates[0]), best(&rates[1]));
    println!("2. streaming relay, best of 3:");
    println!(
        "   bulk, {} MiB in {} KiB chunks: direct {d:.0} MiB/s, through guard {g:.0} MiB/s: {:.0} % of direct",
        STREAM_BYTES >> 20,
        CHUNK >> 10,
        g / d * 100.0
    );
    let mut events = [Vec::new(), Vec::new()];
    for _ in 0..3 {
        for (i, sender) in [&mut direct, &mut guarded].into_iter().enumerate() {
            let (status, took, bytes) = timed(sender, "/v1/completions", None).await;
            assert_eq!((status, bytes), (200, SMALL_FRAMES * SMALL_FRAME));
            events[i].push(SMALL_FRAMES as f64 / took.as_secs_f64());
        }
    }
    let (d, g) = (best(&events[0]), best(&events[1]));
    println!(
        "   token-sized, {SMALL_FRAMES} events of {SMALL_FRAME} B as fast as sent: direct {d:.0} events/s, through guard {g:.0} events/s: {:.0} % of direct (target >= 95 %)",
        g / d * 100.0
    );
}

async fn full_class_answer(upstream: SocketAddr) {
    let guard = start_guard(
        upstream,
        "[class.interactive]\nmax_queue = 8\n[class.batch]\npriority = 10\nmax_queue = 1\n",
    );
    // One request holds the only slot, one waits: the batch class is full.
    let mut holders = Vec::new();
    for _ in 0..2 {
        let mut sender = client(guard.listen).await;
        holders.push(tokio::spawn(async move {
            timed(&mut sender, "/v1/embeddings", Some("batch")).await
        }));
    }
    guard
        .wait_for_metric("guard_queue_depth{class=\"batch\"}", 1.0)
        .await;
    let mut sender = client(guard.listen).await;
    let mut times = Vec::new();
    for _ in 0..REJECTIONS {
        let (status, took, _) = timed(&mut sender, "/v1/embeddings", Some("batch")).await;
        assert_eq!(status, 503);
        times.push(took);
    }
    for holder in holders {
        holder.abort();
    }
    let us = |x: Duration| x.as_secs_f64() * 1e6;
    println!("3. answer to a full class, {REJECTIONS} requests (503 queue_full, Retry-After):");
    println!(
        "   p50 {:.0} us, p99 {:.0} us (target p99 < 1000 us)",
        us(percentile(&times, 0.5)),
        us(percentile(&times, 0.99))
    );
}

async fn flood_ttft() {
    let shape = Shape::default();
    let llama = LlamaServer::start(1).await;
    let guard = GuardProcess::start(
        llama.addr,
        "openai",
        "[class.interactive]\npriority = 0\nmax_queue = 8\n[class.batch]\npriority = 10\nmax_queue = 1000\n",
    );
    let idle = workload::run(llama.addr, shape, false).await;
    let body = serde_json::json!({ "prompt": "Extract every name from this text: ...", "n_predict": shape.batch_tokens, "ignore_eos": true });
    let started = Instant::now();
    guard_tests::http::post(llama.addr, "/completion", &[], &body).await;
    let batch_service = started.elapsed();
    let direct = workload::run(llama.addr, shape, true).await;
    workload::wait_until_idle(llama.addr).await;
    let guarded = workload::run(guard.listen, shape, true).await;
    let ms = |x: Duration| x.as_secs_f64() * 1e3;
    let idle95 = percentile(&idle.ttft, 0.95);
    let target = (idle95 + batch_service).mul_f64(1.5);
    let (d95, g95) = (
        percentile(&direct.ttft, 0.95),
        percentile(&guarded.ttft, 0.95),
    );
    println!(
        "4. interactive TTFT under a batch flood on llama-server (-np 1, SmolLM2-135M; {} batch clients of {} tokens, {} chats):",
        shape.batch_clients, shape.batch_tokens, shape.chats
    );
    println!(
        "   idle p95 {:.0} ms; one batch request alone {:.0} ms",
        ms(idle95),
        ms(batch_service)
    );
    println!(
        "   flood, direct p95 {:.0} ms; flood, through guard p95 {:.0} ms ({:.1}x better); target for guard <= {:.0} ms: {}",
        ms(d95),
        ms(g95),
        d95.as_secs_f64() / g95.as_secs_f64(),
        ms(target),
        if g95 <= target { "met" } else { "missed" }
    );
}
