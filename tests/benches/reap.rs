//! `cargo xtask bench reap`: how fast guard drops work whose client left, with the kernel's
//! close events (eBPF) and with user-space detection only, and the tokens llama-server did not
//! generate for departed clients through guard, against the same workload sent straight to it.

use std::time::Duration;

use guard_tests::{
    body::{With as _, completion, ollama_chat},
    http::{Leave, leave, post, raw_request, read_until, start_pipelined_request},
    servers::{GuardProcess, LlamaServer, OllamaEmulator},
    workload::{percentile, wait_until_idle},
};

const SAMPLES: usize = 300;
const CLASSES: &str = "[class.interactive]\npriority = 0\nmax_queue = 8\n[class.batch]\npriority = 10\nmax_queue = 1000\n";

fn main() {
    let runtime = guard_tests::bench_runtime();
    runtime.block_on(async {
        let us = |d: Duration| d.as_secs_f64() * 1e6;
        println!("1. reap latency, client close() returned -> request dropped in guard, {SAMPLES} queued requests each:");
        println!("   (a plain close races hyper's own end-of-stream check against guard's detector; behind");
        println!("   the start of a pipelined request hyper stops checking, so guard's detector works alone)");
        let mut p99 = std::collections::HashMap::new();
        for ebpf in [true, false] {
            for pipelined in [false, true] {
                let samples = reap_latency(ebpf, pipelined).await;
                println!(
                    "   {:<10} {:<26} p50 {:>7.0} us, p99 {:>7.0} us, max {:>7.0} us",
                    if ebpf { "eBPF" } else { "user space" },
                    if pipelined { "behind pipelined bytes" } else { "plain close" },
                    us(percentile(&samples, 0.5)),
                    us(percentile(&samples, 0.99)),
                    us(percentile(&samples, 1.0))
                );
                p99.insert((ebpf, pipelined), percentile(&samples, 0.99));
            }
        }
        let ebpf_worst = p99[&(true, false)].max(p99[&(true, true)]);
        println!(
            "   eBPF p99 target <= 5000 us: {}; behind pipelined bytes, eBPF p99 / user-space p99 = {:.3}",
            if ebpf_worst <= Duration::from_millis(5) { "met" } else { "missed" },
            p99[&(true, true)].as_secs_f64() / p99[&(false, true)].as_secs_f64()
        );
        wasted_tokens().await;
    });
}

/// Queues one request at a time behind a running one, closes its client, and times the drop
/// from guard's debug log (CLOCK_MONOTONIC, the same clock here). With `pipelined`, each client
/// first sends the start of a second request: hyper then stops watching for the close itself.
async fn reap_latency(ebpf: bool, pipelined: bool) -> Vec<Duration> {
    let ollama = OllamaEmulator::start(&["--tokens", "100000", "--token-delay-ms", "50"]);
    let extra = if ebpf {
        CLASSES.to_owned()
    } else {
        format!("{CLASSES}[ebpf]\nenabled = false\n")
    };
    let mut guard = GuardProcess::start_with(ollama.addr, "ollama", &extra, false, "guard=debug");
    let chat = ollama_chat("hi");
    let _running = guard.running_batch("/api/chat", &chat).await;
    let mut samples = Vec::with_capacity(SAMPLES);
    for i in 0..SAMPLES {
        let mut client = raw_request(
            guard.listen,
            "/api/chat",
            &[("x-guard-class", "batch")],
            &chat,
        )
        .await;
        if pipelined {
            start_pipelined_request(&mut client).await;
        }
        let peer = client.local_addr().expect("addr");
        guard
            .wait_for_metric("guard_admitted_total{class=\"batch\"}", (i + 2) as f64)
            .await;
        let closed = leave(client, Leave::Fin);
        let lines = guard.wait_for_log(&format!("peer={peer}"));
        let line = lines.last().expect("the reap line");
        let dropped_ns: u64 = line
            .split("dropped_at_ns=")
            .nth(1)
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no dropped_at_ns in {line}"));
        samples.push(Duration::from_nanos(dropped_ns).saturating_sub(closed));
    }
    samples
}

/// Tokens llama-server generated for clients that had left: queued ones that left while
/// waiting, and streaming ones that left after their first token.
async fn wasted_tokens() {
    const LEAVERS: usize = 4;
    const TOKENS: u64 = 400;
    let llama = LlamaServer::start(1).await;
    let guard = GuardProcess::start(llama.addr, "openai", CLASSES);
    println!(
        "2. tokens generated for clients that left ({LEAVERS} queued behind a running request, each leaving after 300 ms; {LEAVERS} streaming, each leaving after its first token; {TOKENS} tokens asked each):"
    );
    for (name, target) in [
        ("straight to llama-server", llama.addr),
        ("through guard", guard.listen),
    ] {
        wait_until_idle(llama.addr).await;
        let before = llama.metric("tokens_predicted_total").await;
        let stayer = tokio::spawn(async move {
            post(
                target,
                "/completion",
                &[("x-guard-class", "batch")],
                &completion("Stay.", 300),
            )
            .await
        });
        // Let the stayer take the slot first.
        loop {
            if llama.metric("requests_processing").await >= 1.0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let mut leavers = Vec::new();
        for i in 0..LEAVERS {
            let body = completion(&format!("Leave {i}."), TOKENS);
            leavers.push(
                raw_request(target, "/completion", &[("x-guard-class", "batch")], &body).await,
            );
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        for leaver in leavers {
            leave(leaver, Leave::Fin);
        }
        stayer.await.expect("stayer");
        wait_until_idle(llama.addr).await;
        let queued_waste = llama.metric("tokens_predicted_total").await - before - 300.0;

        let before = llama.metric("tokens_predicted_total").await;
        for i in 0..LEAVERS {
            let body = completion(&format!("Stream {i}."), TOKENS).with("stream", true);
            let mut stream = raw_request(target, "/completion", &[], &body).await;
            // Its first token, or its end.
            let _ = read_until(&mut stream, |seen| seen.contains("data: ")).await;
            leave(stream, Leave::Fin);
            wait_until_idle(llama.addr).await;
        }
        let streaming_waste = llama.metric("tokens_predicted_total").await - before;
        println!(
            "   {name:<25} queued leavers: {queued_waste:>5.0} tokens; streaming leavers: {streaming_waste:>5.0} tokens"
        );
    }
}
