//! `cargo xtask bench proxy`: what guard costs on the request path, side by side in one run
//! with the proxies people would otherwise put there, then what it buys.
//!
//! 1. One table, columns direct, nginx `proxy_pass` (upstream keepalive, no buffering),
//!    HAProxy, guard's queued path and guard's pass-through path: added latency for one
//!    client; req/s and p99 at 1, 16, 64 and 256 kept-alive clients (`wrk`) against nginx
//!    answering a fixed Ollama-style JSON; the relay of 10,000 small NDJSON frames; 1 GiB
//!    upload and download. Its last column is guard's ratio to nginx (queued / pass-through).
//!    Goals: added p50 <= 1.5x nginx's, p99 <= 500 us; req/s at 64 and 256 >= nginx's;
//!    upload and download >= 95 % of direct; per-frame cost <= nginx's.
//! 2. Time to answer a request for a full class (target: p99 under 1 ms).
//! 3. Interactive TTFT p95 under a batch flood on the real llama-server, guard against direct
//!    (target: guard within 1.5x the idle p95 plus one batch request's service time).
//!
//! 4. Where guard's time goes: a flame graph per path under 64 clients (target/flame/).
//!
//! 5. What the access log costs: CPU per request of three guards loaded side by side by paced
//!    `wrk`s (log off, log on, a second with it off for the noise floor), and nginx's own JSON
//!    access log measured the same way (`access`; the table has the same rows). Goal: on
//!    within 5 % of off.
//!
//! `cargo xtask bench proxy table` (or `full`, `flood`, `access`, `flame`) runs one part;
//! GUARD_BENCH_SECONDS sets each load's length (default 3).

#[path = "proxy/flame.rs"]
mod flame;
#[path = "proxy/table.rs"]
mod table;

use std::time::{Duration, Instant};

use guard_tests::{
    servers::{GuardProcess, LlamaServer},
    workload::{self, Shape, percentile},
};
use table::{client, timed};

const REJECTIONS: usize = 2_000;

fn main() {
    let runtime = guard_tests::bench_runtime();
    let wanted = guard_tests::bench_parts();
    runtime.block_on(async {
        if wanted("table") {
            table::run().await;
        }
        if wanted("full") {
            full_class_answer().await;
        }
        if wanted("flood") {
            flood_ttft().await;
        }
        if wanted("access") {
            table::access().await;
        }
        if wanted("flame") {
            flame::run();
        }
    });
}

async fn full_class_answer() {
    let upstream = table::stream_upstream().await;
    let guard = GuardProcess::start(
        upstream,
        "openai",
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
    println!("2. answer to a full class, {REJECTIONS} requests (503 queue_full, Retry-After):");
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
    let idle = workload::run(llama.addr, llama.addr, shape, false).await;
    let body = workload::extraction(shape.batch_tokens);
    let started = Instant::now();
    guard_tests::http::post(llama.addr, "/completion", &[], &body).await;
    let batch_service = started.elapsed();
    let direct = workload::run(llama.addr, llama.addr, shape, true).await;
    workload::wait_until_idle(llama.addr).await;
    let guarded = workload::run(guard.listen, llama.addr, shape, true).await;
    let ms = |x: Duration| x.as_secs_f64() * 1e3;
    let idle95 = percentile(&idle.ttft, 0.95);
    let target = (idle95 + batch_service).mul_f64(1.5);
    let (d95, g95) = (
        percentile(&direct.ttft, 0.95),
        percentile(&guarded.ttft, 0.95),
    );
    println!(
        "3. interactive TTFT under a batch flood on llama-server (-np 1, SmolLM2-135M; {} batch clients of {} tokens, {} chats):",
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
