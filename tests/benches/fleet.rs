//! `cargo xtask bench fleet`: four guards, each before its own one-slot fake upstream, behind
//! HAProxy from Debian; interactive and batch clients load the whole fleet through HAProxy.
//! Round robin against agent-check (guard's `cluster.agent_listen`, asked every 200 ms), side
//! by side in one run: 503s per class, interactive TTFT p95, batch jobs done.

use std::{
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use bytes::Bytes;
use guard_testkit::{Mode, Script, Upstream};
use guard_tests::{free_addr, peers::Peer, servers::GuardProcess, workload::percentile};
use http_body_util::{BodyExt as _, Full};
use hyper_util::rt::TokioIo;

const BOXES: usize = 4;
const RUN: Duration = Duration::from_secs(10);
const BATCH_CLIENTS: usize = 14;
const CHATS: usize = 4;
const BOX: &str = "[upstream]\nmax_concurrency = 1\n\
                   [class.interactive]\nmax_queue = 2\ndeadline_ms = 3000\n\
                   [class.batch]\npriority = 10\nmax_queue = 3\n";

fn main() {
    let runtime = guard_tests::bench_runtime();
    runtime.block_on(async {
        println!("fleet: {BOXES} guards (one slot, 3 batch places each) behind HAProxy; {BATCH_CLIENTS} batch clients (jobs of 0.1 to 1.2 s), {CHATS} chat clients, {} s per mode", RUN.as_secs());
        println!("   {:<14} {:>12} {:>12} {:>16} {:>16}", "mode", "batch 503", "chat 503", "chat TTFT p95", "batch jobs done");
        for agent in [false, true] {
            let result = run(agent).await;
            println!(
                "   {:<14} {:>12} {:>12} {:>13} ms {:>16}",
                if agent { "agent-check" } else { "round robin" },
                result.batch_refused,
                result.chat_refused,
                result.chat_ttft_p95.as_millis(),
                result.batch_done
            );
        }
    });
}

/// What one mode measured.
struct Run {
    batch_refused: u64,
    chat_refused: u64,
    chat_ttft_p95: Duration,
    batch_done: u64,
}

async fn run(agent: bool) -> Run {
    let mut boxes = Vec::new();
    for _ in 0..BOXES {
        let upstream = Upstream::start().await;
        let agent_addr = free_addr();
        let config = format!("{BOX}[cluster]\nagent_listen = \"{agent_addr}\"\n");
        let guard = GuardProcess::start(upstream.addr(), "openai", &config);
        boxes.push((upstream, guard, agent_addr));
    }
    let servers: Vec<(SocketAddr, Option<SocketAddr>)> = boxes
        .iter()
        .map(|(_, guard, a)| (guard.listen, agent.then_some(*a)))
        .collect();
    let haproxy = Peer::haproxy_balancer(&servers, free_addr());
    let front = haproxy.addr;
    let until = Instant::now() + RUN;
    let (batch_refused, chat_refused, batch_done) = (
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
    );
    let mut tasks = Vec::new();
    for client in 0..BATCH_CLIENTS {
        let (refused, done) = (Arc::clone(&batch_refused), Arc::clone(&batch_done));
        tasks.push(tokio::spawn(async move {
            // Jobs of uneven length (the same sequence in both modes): some boxes fill first.
            let mut seed = 0x9e37_79b9_u64.wrapping_mul(client as u64 + 1);
            while Instant::now() < until {
                seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                let frames = 5 + (seed >> 33) % 56;
                let stream = Script::new(Mode::Stream).frames(frames, Duration::from_millis(20));
                match request(front, "batch", &stream).await {
                    Some((200, _)) => done.fetch_add(1, Ordering::Relaxed),
                    Some((503, _)) => {
                        refused.fetch_add(1, Ordering::Relaxed);
                        // A refused client waits a moment, as Retry-After asks.
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        0
                    }
                    _ => 0,
                };
            }
            Vec::new()
        }));
    }
    for _ in 0..CHATS {
        let refused = Arc::clone(&chat_refused);
        tasks.push(tokio::spawn(async move {
            let mut ttfts = Vec::new();
            while Instant::now() < until {
                let stream = Script::new(Mode::Stream).frames(5, Duration::from_millis(10));
                match request(front, "interactive", &stream).await {
                    Some((200, ttft)) => ttfts.push(ttft),
                    Some((503, _)) => {
                        refused.fetch_add(1, Ordering::Relaxed);
                    }
                    _ => {}
                }
                // A person reads the answer before asking again.
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
            ttfts
        }));
    }
    let mut ttfts = Vec::new();
    for task in tasks {
        ttfts.extend(task.await.expect("client"));
    }
    drop(haproxy);
    Run {
        batch_refused: batch_refused.load(Ordering::Relaxed),
        chat_refused: chat_refused.load(Ordering::Relaxed),
        chat_ttft_p95: percentile(&ttfts, 0.95),
        batch_done: batch_done.load(Ordering::Relaxed),
    }
}

/// One request of `class` through the front; its status and its time to the first byte of
/// the answer's body (the whole answer is read). None: the connection failed.
async fn request(front: SocketAddr, class: &str, script: &Script) -> Option<(u16, Duration)> {
    let stream = tokio::net::TcpStream::connect(front).await.ok()?;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .ok()?;
    tokio::spawn(connection);
    let request = hyper::Request::post("/v1/chat/completions")
        .header("host", "fleet")
        .header("content-type", "application/json")
        .header("x-guard-class", class)
        .body(Full::new(Bytes::from(script.json().to_string())))
        .ok()?;
    let started = Instant::now();
    let response = sender.send_request(request).await.ok()?;
    let status = response.status().as_u16();
    let mut body = response.into_body();
    let mut first = None;
    while let Some(frame) = body.frame().await {
        if frame.ok()?.is_data() && first.is_none() {
            first = Some(started.elapsed());
        }
    }
    Some((status, first.unwrap_or_else(|| started.elapsed())))
}
