//! Departed clients cost nothing, proven against the real llama-server: queued requests whose
//! clients leave (FIN or reset) never reach it, a streaming client that leaves frees its slot
//! within 2 s, 500 queued clients vanishing at once are all reaped and the counters reconcile,
//! a client that leaves behind a pipelined request is reaped by guard's own detector, a
//! keep-alive connection closed between requests reaps nothing; with eBPF and without.

use std::time::{Duration, Instant};

use guard_testkit::{Polling, until_with};
use guard_tests::{
    body::{With as _, completion, ollama_chat, ollama_generate},
    http::{
        Answers, Leave, leave, post, raw_request, read_until, request_bytes,
        start_pipelined_request,
    },
    serial,
    servers::{GuardProcess, LlamaServer, OllamaEmulator},
};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

const CLASSES: &str = "[class.interactive]\npriority = 0\nmax_queue = 8\n\
                       [class.batch]\npriority = 10\nmax_queue = 1000\n";
const EBPF_OFF: &str = "[ebpf]\nenabled = false\n";

fn config(ebpf: bool) -> String {
    if ebpf {
        CLASSES.to_owned()
    } else {
        format!("{CLASSES}{EBPF_OFF}")
    }
}

async fn queued_clients_that_leave_never_reach_the_server(ebpf: bool) {
    let _serial = serial().await;
    let llama = LlamaServer::start(1).await;
    let guard = GuardProcess::start(llama.addr, "openai", &config(ebpf));
    assert_eq!(
        guard.metric("guard_ebpf_attached").await,
        if ebpf { 1.0 } else { 0.0 }
    );
    let before = llama.metric("tokens_predicted_total").await;
    let (addr, running_tokens) = (guard.listen, 200_u32);
    let running = tokio::spawn(async move {
        post(
            addr,
            "/completion",
            &[("x-guard-class", "batch")],
            &completion("Tell a story.", running_tokens.into()),
        )
        .await
    });
    guard
        .wait_for_metric("guard_inflight{class=\"batch\"}", 1.0)
        .await;
    let fin = raw_request(
        guard.listen,
        "/completion",
        &[("x-guard-class", "batch")],
        &completion("One.", 50),
    )
    .await;
    let reset = raw_request(
        guard.listen,
        "/completion",
        &[("x-guard-class", "batch")],
        &completion("Two.", 50),
    )
    .await;
    guard
        .wait_for_metric("guard_queue_depth{class=\"batch\"}", 2.0)
        .await;
    leave(fin, Leave::Fin);
    leave(reset, Leave::Reset);
    guard
        .wait_for_metric("guard_reaped_total{class=\"batch\",stage=\"queued\"}", 2.0)
        .await;
    assert_eq!(
        guard.metric("guard_queue_depth{class=\"batch\"}").await,
        0.0
    );
    assert_eq!(running.await.expect("running").status, 200);
    let generated = llama.metric("tokens_predicted_total").await - before;
    assert_eq!(
        generated,
        f64::from(running_tokens),
        "llama-server generated only for the client that stayed"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn queued_clients_that_leave_never_reach_the_server_ebpf() {
    queued_clients_that_leave_never_reach_the_server(true).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn queued_clients_that_leave_never_reach_the_server_userspace() {
    queued_clients_that_leave_never_reach_the_server(false).await;
}

async fn a_streaming_client_that_leaves_frees_the_slot(ebpf: bool, how: Leave) {
    let _serial = serial().await;
    let llama = LlamaServer::start(1).await;
    let guard = GuardProcess::start(llama.addr, "openai", &config(ebpf));
    let body = completion("Tell a long story.", 2000).with("stream", true);
    let mut stream = raw_request(guard.listen, "/completion", &[], &body).await;
    // Read until the first token has been relayed: the server is generating.
    read_until(&mut stream, |seen| seen.contains("data: "))
        .await
        .unwrap_or_else(|seen| panic!("stream ended early: {seen}"));
    assert_eq!(llama.metric("requests_processing").await, 1.0);
    let left = Instant::now();
    leave(stream, how);
    let polling = Polling::within(Duration::from_secs(2), Duration::from_millis(20));
    until_with(polling, "the slot is freed", async || {
        llama.metric("requests_processing").await == 0.0
    })
    .await;
    let freed = left.elapsed();
    eprintln!("slot freed {freed:?} after the client left ({how:?}, eBPF {ebpf})");
    guard
        .wait_for_metric(
            "guard_reaped_total{class=\"interactive\",stage=\"running\"}",
            1.0,
        )
        .await;
    let generated = llama.metric("tokens_predicted_total").await;
    assert!(
        generated < 2000.0,
        "generation stopped early: {generated} tokens"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_streaming_client_that_closes_frees_the_slot_ebpf() {
    a_streaming_client_that_leaves_frees_the_slot(true, Leave::Fin).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_streaming_client_that_resets_frees_the_slot_ebpf() {
    a_streaming_client_that_leaves_frees_the_slot(true, Leave::Reset).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_streaming_client_that_closes_frees_the_slot_userspace() {
    a_streaming_client_that_leaves_frees_the_slot(false, Leave::Fin).await;
}

async fn five_hundred_queued_clients_vanish_at_once(ebpf: bool) {
    const CLIENTS: usize = 500;
    let _serial = serial().await;
    let ollama = OllamaEmulator::start(&["--tokens", "500", "--token-delay-ms", "20"]);
    let guard = GuardProcess::start(ollama.addr, "ollama", &config(ebpf));
    let chat = ollama_chat("hi");
    let running = guard.running_batch("/api/chat", &chat).await;
    let mut clients = Vec::new();
    for i in 0..CLIENTS {
        clients.push(
            raw_request(
                guard.listen,
                "/api/chat",
                &[("x-guard-class", "batch")],
                &chat,
            )
            .await,
        );
        if i % 100 == 99 {
            guard
                .wait_for_metric("guard_queue_depth{class=\"batch\"}", (i + 1) as f64)
                .await;
        }
    }
    guard
        .wait_for_metric("guard_queue_depth{class=\"batch\"}", CLIENTS as f64)
        .await;
    for (i, client) in clients.into_iter().enumerate() {
        leave(client, if i % 2 == 0 { Leave::Fin } else { Leave::Reset });
    }
    guard
        .wait_for_metric(
            "guard_reaped_total{class=\"batch\",stage=\"queued\"}",
            CLIENTS as f64,
        )
        .await;
    assert_eq!(
        guard.metric("guard_queue_depth{class=\"batch\"}").await,
        0.0
    );
    leave(running, Leave::Fin);
    guard
        .wait_for_metric("guard_reaped_total{class=\"batch\",stage=\"running\"}", 1.0)
        .await;
    let text = guard.metrics_text().await;
    let m = |s: &str| guard_tests::metric(&text, s).unwrap_or(0.0);
    assert_eq!(
        m("guard_admitted_total{class=\"batch\"}"),
        (CLIENTS + 1) as f64
    );
    assert_eq!(
        m("guard_requests_total{class=\"batch\",outcome=\"reaped\"}"),
        (CLIENTS + 1) as f64
    );
    assert_eq!(m("guard_inflight{class=\"batch\"}"), 0.0);
    let stats = ollama.stats().await;
    assert_eq!(
        stats["requests"]["/api/chat"], 1,
        "only the running chat reached the upstream"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn five_hundred_queued_clients_vanish_at_once_ebpf() {
    five_hundred_queued_clients_vanish_at_once(true).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn five_hundred_queued_clients_vanish_at_once_userspace() {
    five_hundred_queued_clients_vanish_at_once(false).await;
}

async fn keep_alive_close_between_requests_reaps_nothing(ebpf: bool) {
    let _serial = serial().await;
    let ollama = OllamaEmulator::start(&["--tokens", "3", "--token-delay-ms", "1"]);
    let guard = GuardProcess::start(ollama.addr, "ollama", &config(ebpf));
    let request = request_bytes("/api/generate", &[], &ollama_generate("hi"));
    let mut answers = Answers::connect(guard.listen).await;
    for _ in 0..2 {
        answers
            .stream
            .write_all(request.as_bytes())
            .await
            .expect("send");
        // One whole response (Content-Length framed) before the next request.
        let answer = answers.next().await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(
            answer.to_ascii_lowercase().contains("\r\ncontent-length:"),
            "Content-Length framed: {answer}"
        );
    }
    let stream = answers.stream;
    guard
        .wait_for_metric(
            "guard_requests_total{class=\"interactive\",outcome=\"completed\"}",
            2.0,
        )
        .await;
    leave(stream, Leave::Fin);
    // A later request's completion orders the check after the close was handled.
    assert_eq!(
        post(guard.listen, "/api/generate", &[], &ollama_generate("x"))
            .await
            .status,
        200
    );
    let text = guard.metrics_text().await;
    let reaped = guard_tests::metric(
        &text,
        "guard_requests_total{class=\"interactive\",outcome=\"reaped\"}",
    );
    assert_eq!(reaped, Some(0.0), "an idle keep-alive close reaps nothing");
    assert_eq!(
        guard_tests::metric(
            &text,
            "guard_requests_total{class=\"interactive\",outcome=\"completed\"}"
        ),
        Some(3.0)
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn keep_alive_close_between_requests_reaps_nothing_ebpf() {
    keep_alive_close_between_requests_reaps_nothing(true).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn keep_alive_close_between_requests_reaps_nothing_userspace() {
    keep_alive_close_between_requests_reaps_nothing(false).await;
}

async fn half_close(means_gone: bool) -> (usize, f64) {
    let _serial = serial().await;
    let ollama = OllamaEmulator::start(&["--tokens", "20", "--token-delay-ms", "50"]);
    let extra = format!("{CLASSES}[server]\nhalf_close_means_gone = {means_gone}\n");
    let guard = GuardProcess::start(ollama.addr, "ollama", &extra);
    let body = ollama_generate("hi");
    let mut stream = raw_request(guard.listen, "/api/generate", &[], &body).await;
    // Half-close once the request runs (a FIN before hyper has read the request is a client
    // that left before asking anything).
    guard
        .wait_for_metric("guard_inflight{class=\"interactive\"}", 1.0)
        .await;
    stream
        .shutdown()
        .await
        .expect("half-close: shut down the sending side");
    let mut response = Vec::new();
    let _ = stream.read_to_end(&mut response).await;
    let outcome = if means_gone { "reaped" } else { "completed" };
    let series = format!("guard_requests_total{{class=\"interactive\",outcome=\"{outcome}\"}}");
    guard.wait_for_metric(&series, 1.0).await;
    let reaped = guard
        .metric("guard_requests_total{class=\"interactive\",outcome=\"reaped\"}")
        .await;
    (response.len(), reaped)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_half_close_means_gone_by_default() {
    let (answer, reaped) = half_close(true).await;
    assert_eq!((answer, reaped), (0, 1.0), "no answer; reaped");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_half_close_is_answered_when_configured() {
    let (answer, reaped) = half_close(false).await;
    assert!(answer > 0, "the half-closed client got its answer");
    assert_eq!(reaped, 0.0);
}

/// A client that sent the start of a second, pipelined request and then left: only guard's own
/// detector sees it go (the kernel event, or without eBPF the user-space watcher), and either
/// way the reap is timed in `guard_reap_latency_seconds`.
async fn a_client_that_leaves_behind_a_pipelined_request_is_reaped(ebpf: bool) {
    let _serial = serial().await;
    let ollama = OllamaEmulator::start(&["--tokens", "500", "--token-delay-ms", "20"]);
    let guard = GuardProcess::start(ollama.addr, "ollama", &config(ebpf));
    let chat = ollama_chat("hi");
    let batch = [("x-guard-class", "batch")];
    let running = guard.running_batch("/api/chat", &chat).await;
    let mut waiting = raw_request(guard.listen, "/api/chat", &batch, &chat).await;
    start_pipelined_request(&mut waiting).await;
    guard
        .wait_for_metric("guard_queue_depth{class=\"batch\"}", 1.0)
        .await;
    leave(waiting, Leave::Fin);
    guard
        .wait_for_metric("guard_reaped_total{class=\"batch\",stage=\"queued\"}", 1.0)
        .await;
    assert_eq!(
        guard.metric("guard_reap_latency_seconds_count").await,
        1.0,
        "guard's own detector saw the close"
    );
    leave(running, Leave::Fin);
    guard
        .wait_for_metric("guard_reaped_total{class=\"batch\",stage=\"running\"}", 1.0)
        .await;
    let stats = ollama.stats().await;
    assert_eq!(
        stats["requests"]["/api/chat"], 1,
        "only the running chat reached the upstream"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_that_leaves_behind_a_pipelined_request_is_reaped_ebpf() {
    a_client_that_leaves_behind_a_pipelined_request_is_reaped(true).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_that_leaves_behind_a_pipelined_request_is_reaped_userspace() {
    a_client_that_leaves_behind_a_pipelined_request_is_reaped(false).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_that_closes_after_the_last_line_completed() {
    // Clients close as soon as they read a stream's last event (Ollama's `"done":true`, SSE's
    // `[DONE]`), while the server's chunked terminator may still be on its way (llama-server
    // writes it apart): they had the whole answer, so the request completed, not reaped.
    let _serial = serial().await;
    let ollama = OllamaEmulator::start(&[
        "--tokens",
        "3",
        "--token-delay-ms",
        "5",
        "--end-delay-ms",
        "10",
    ]);
    let guard = GuardProcess::start(ollama.addr, "ollama", &config(true));
    let chat = ollama_chat("hi");
    let interactive = [("x-guard-class", "interactive")];
    let mut stream = raw_request(guard.listen, "/api/chat", &interactive, &chat).await;
    let last_line = |text: &str| text.contains("\"done\":true") || text.contains("\"done\": true");
    read_until(&mut stream, last_line)
        .await
        .unwrap_or_else(|_| panic!("the stream ended before its last line"));
    leave(stream, Leave::Fin);
    guard
        .wait_for_metric(
            "guard_requests_total{class=\"interactive\",outcome=\"completed\"}",
            1.0,
        )
        .await;
    assert_eq!(
        guard
            .metric("guard_requests_total{class=\"interactive\",outcome=\"reaped\"}")
            .await,
        0.0
    );
}
