//! The request path end to end: guard in front of the real llama-server (SmolLM2): priority
//! order, deadline rejection on arrival and in the queue, a full class, streaming, bad input,
//! reload, and the outcome counters reconciling after a mixed run.

use std::time::{Duration, Instant};

use guard_testkit::trickle;
use guard_tests::{
    body::{self, STORY, With as _},
    http::{self, post, post_streamed},
    metric, rss_bytes, serial,
    servers::{GuardProcess, LlamaServer},
};
use serde_json::{Value, json};
use tokio::task::JoinHandle;

/// A generation of exactly `tokens` tokens (llama.cpp's /completion, end-of-text ignored).
fn completion(tokens: u32) -> Value {
    body::completion(STORY, tokens.into())
}

fn chat(max_tokens: u32, stream: bool) -> Value {
    body::chat("Say hello.")
        .with("max_tokens", max_tokens)
        .with("stream", stream)
}

/// A /completion in the background: its response and when it ended.
type Completion = JoinHandle<(http::Response, Instant)>;

/// Sends a /completion in `class` in the background.
fn spawn_completion(guard: &GuardProcess, class: &str, tokens: u32) -> Completion {
    let (addr, class) = (guard.listen, class.to_owned());
    tokio::spawn(async move {
        let response = post(
            addr,
            "/completion",
            &[("x-guard-class", &class)],
            &completion(tokens),
        )
        .await;
        (response, Instant::now())
    })
}

/// A batch /completion of `tokens` in the background, once guard runs it.
async fn running_completion(guard: &GuardProcess, tokens: u32) -> Completion {
    let running = spawn_completion(guard, "batch", tokens);
    guard
        .wait_for_metric("guard_inflight{class=\"batch\"}", 1.0)
        .await;
    running
}

/// Fills the batch class (max_queue 2): one request of `tokens` running, two short ones
/// waiting.
async fn fill_batch(guard: &GuardProcess, tokens: u32) -> (Completion, Vec<Completion>) {
    let running = running_completion(guard, tokens).await;
    let queued = vec![
        spawn_completion(guard, "batch", 4),
        spawn_completion(guard, "batch", 4),
    ];
    guard
        .wait_for_metric("guard_queue_depth{class=\"batch\"}", 2.0)
        .await;
    (running, queued)
}

const TWO_CLASSES: &str = "[class.interactive]\npriority = 0\nmax_queue = 4\n\
                           [class.batch]\npriority = 10\nmax_queue = 2\n";

#[tokio::test(flavor = "multi_thread")]
async fn interactive_is_served_before_earlier_batch() {
    let _serial = serial().await;
    let llama = LlamaServer::start(1).await;
    let guard = GuardProcess::start(llama.addr, "openai", TWO_CLASSES);
    let running = running_completion(&guard, 200).await;
    let batch = spawn_completion(&guard, "batch", 8);
    guard
        .wait_for_metric("guard_queue_depth{class=\"batch\"}", 1.0)
        .await;
    let interactive = spawn_completion(&guard, "interactive", 8);
    guard
        .wait_for_metric("guard_queue_depth{class=\"interactive\"}", 1.0)
        .await;

    let (batch, batch_done) = batch.await.expect("batch");
    let (interactive, interactive_done) = interactive.await.expect("interactive");
    running.await.expect("running");
    assert_eq!((batch.status, interactive.status), (200, 200));
    assert!(interactive_done < batch_done, "interactive finished first");
    assert_eq!(interactive.header("x-guard-class"), Some("interactive"));
    let queue_ms = |r: &http::Response| {
        r.header("x-guard-queue-ms")
            .and_then(|v| v.parse::<u64>().ok())
            .expect("queue ms")
    };
    assert!(
        queue_ms(&batch) > queue_ms(&interactive),
        "the earlier batch request waited longer"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_deadline_that_cannot_be_met_is_refused_at_once() {
    let _serial = serial().await;
    let llama = LlamaServer::start(1).await;
    let config = "[estimate]\ninitial_service_ms = 10000\n\
                  [class.interactive]\npriority = 0\nmax_queue = 4\ndeadline_ms = 1500\n\
                  [class.batch]\npriority = 10\nmax_queue = 4\n";
    let guard = GuardProcess::start(llama.addr, "openai", config);
    let running = running_completion(&guard, 300).await;
    let prompt_tokens = llama.metric("prompt_tokens_total").await;

    let response = post(guard.listen, "/v1/chat/completions", &[], &chat(8, false)).await;
    assert_eq!(response.status, 503, "{}", response.text());
    let retry_after: u64 = response
        .header("retry-after")
        .and_then(|v| v.parse().ok())
        .expect("Retry-After");
    assert!(retry_after >= 1);
    assert_eq!(response.header("x-guard-class"), Some("interactive"));
    let body = response.json();
    assert_eq!(body["error"]["code"], "deadline_predicted");
    let message = body["error"]["message"].as_str().expect("message");
    assert!(
        message.contains("interactive") && message.contains("deadline"),
        "{message}"
    );
    assert_eq!(
        guard
            .metric("guard_rejected_total{class=\"interactive\",reason=\"deadline_predicted\"}")
            .await,
        1.0
    );
    running.await.expect("running");
    let after = llama.metric("prompt_tokens_total").await;
    assert!(
        after - prompt_tokens < 50.0,
        "the refused chat never reached llama-server"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_waiting_request_past_its_deadline_is_taken_out_with_503() {
    let _serial = serial().await;
    let llama = LlamaServer::start(1).await;
    // The prior says requests are quick, so it is admitted; the running one takes seconds.
    let config = "[estimate]\ninitial_service_ms = 100\n\
                  [class.interactive]\npriority = 0\nmax_queue = 4\ndeadline_ms = 800\n\
                  [class.batch]\npriority = 10\nmax_queue = 4\n";
    let guard = GuardProcess::start(llama.addr, "openai", config);
    let running = running_completion(&guard, 600).await;
    let response = post(guard.listen, "/v1/chat/completions", &[], &chat(8, false)).await;
    assert_eq!(response.status, 503, "{}", response.text());
    assert_eq!(response.json()["error"]["code"], "deadline_expired");
    let waited: u64 = response
        .header("x-guard-queue-ms")
        .and_then(|v| v.parse().ok())
        .expect("queue ms");
    assert!(waited >= 800, "it waited its deadline out: {waited} ms");
    assert_eq!(
        guard
            .metric(
                "guard_rejected_after_queueing_total{class=\"interactive\",reason=\"deadline_expired\"}"
            )
            .await,
        1.0
    );
    assert_eq!(
        guard
            .metric("guard_queue_depth{class=\"interactive\"}")
            .await,
        0.0
    );
    running.await.expect("running");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_full_class_gets_503_with_retry_after_and_others_still_pass() {
    let _serial = serial().await;
    let llama = LlamaServer::start(1).await;
    let guard = GuardProcess::start(llama.addr, "openai", TWO_CLASSES);
    let (running, queued) = fill_batch(&guard, 200).await;

    let full = post(
        guard.listen,
        "/completion",
        &[("x-guard-class", "batch")],
        &completion(4),
    )
    .await;
    assert_eq!(full.status, 503);
    assert!(
        full.header("retry-after")
            .and_then(|v| v.parse::<u64>().ok())
            .is_some_and(|s| s >= 1)
    );
    let body = full.json();
    assert_eq!(
        body["error"]["code"], "queue_full",
        "OpenAI shape on llama.cpp's path: {body}"
    );
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("batch"))
    );

    let interactive = post(guard.listen, "/completion", &[], &completion(4)).await;
    assert_eq!(interactive.status, 200, "another class is not full");
    for task in queued {
        assert_eq!(task.await.expect("queued").0.status, 200);
    }
    running.await.expect("running");
}

#[tokio::test(flavor = "multi_thread")]
async fn streams_are_relayed_chunk_by_chunk() {
    let _serial = serial().await;
    let llama = LlamaServer::start(1).await;
    let guard = GuardProcess::start(llama.addr, "openai", TWO_CLASSES);
    // All 48 tokens (llama-server's ignore_eos): a reply the model ends after a few tokens
    // would leave too few frames to tell streaming from buffering.
    let body = chat(48, true).with("ignore_eos", true);
    let streamed = post_streamed(guard.listen, "/v1/chat/completions", &[], &body).await;
    assert_eq!(streamed.status, 200);
    assert_eq!(
        streamed.headers.get("x-guard-class").map(|v| v.as_bytes()),
        Some(&b"interactive"[..])
    );
    assert!(
        streamed.frames.len() >= 10,
        "{} frames: not relayed as they came",
        streamed.frames.len()
    );
    let text = streamed.text();
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    let (first, last) = (
        streamed.frames[0].0,
        streamed.frames[streamed.frames.len() - 1].0,
    );
    assert!(last > first, "frames arrived over time");
    assert_eq!(
        guard
            .metric("guard_ttft_seconds_count{class=\"interactive\"}")
            .await,
        1.0
    );
    assert_eq!(
        guard
            .metric("guard_requests_total{class=\"interactive\",outcome=\"completed\"}")
            .await,
        1.0
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_request_right_after_a_stream_is_answered() {
    // llama-server shuts its side of a connection after each streamed response although it
    // advertises keep-alive; the request guard sends next on that pooled connection must still
    // be answered, not turned into a 502.
    let _serial = serial().await;
    let llama = LlamaServer::start(1).await;
    let guard = GuardProcess::start(llama.addr, "openai", TWO_CLASSES);
    for round in 0..40 {
        let streamed =
            post_streamed(guard.listen, "/v1/chat/completions", &[], &chat(2, true)).await;
        assert_eq!(streamed.status, 200, "round {round}");
        // Queued and passed-through requests alike.
        let next = if round % 2 == 0 {
            post(guard.listen, "/completion", &[], &completion(1)).await
        } else {
            http::get(guard.listen, "/v1/models")
                .await
                .expect("GET /v1/models")
        };
        assert_eq!(next.status, 200, "round {round}: {}", next.text());
    }
    let text = guard.metrics_text().await;
    for class in ["interactive", "batch"] {
        let series = format!("guard_requests_total{{class=\"{class}\",outcome=\"failed\"}}");
        assert_eq!(metric(&text, &series), Some(0.0), "{series}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_input_is_answered_and_never_forwarded() {
    let _serial = serial().await;
    let llama = LlamaServer::start(1).await;
    let guard = GuardProcess::start(llama.addr, "openai", "[server]\n");
    let before = llama.metric("prompt_tokens_total").await;

    let huge = json!({ "prompt": "x".repeat(17 << 20) });
    let too_large = post(guard.listen, "/completion", &[], &huge).await;
    assert_eq!(too_large.status, 413, "{}", too_large.text());

    let unknown = post(
        guard.listen,
        "/api/chat",
        &[("x-guard-class", "vip")],
        &chat(4, false),
    )
    .await;
    assert_eq!(unknown.status, 400);
    let message = unknown.json()["error"]
        .as_str()
        .expect("Ollama shape on /api paths")
        .to_owned();
    assert!(
        message.contains("vip") && message.contains("batch, interactive"),
        "{message}"
    );
    // Long, but within the request-head buffer (32 KiB; a longer head is 431).
    let long_class = "v".repeat(10_000);
    let echoed = post(
        guard.listen,
        "/api/chat",
        &[("x-guard-class", &long_class)],
        &chat(4, false),
    )
    .await;
    assert_eq!(echoed.status, 400);
    assert!(
        echoed.body.len() < 400,
        "{} bytes echoed",
        echoed.body.len()
    );

    assert_eq!(
        llama.metric("prompt_tokens_total").await,
        before,
        "nothing reached llama-server"
    );
    for reason in ["body_too_large", "unknown_class"] {
        let series = format!("guard_invalid_requests_total{{reason=\"{reason}\"}}");
        assert!(guard.metric(&series).await >= 1.0, "{series}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn outcomes_reconcile_after_a_mixed_run() {
    let _serial = serial().await;
    let mut llama = LlamaServer::start(1).await;
    let guard = GuardProcess::start(llama.addr, "openai", TWO_CLASSES);
    for _ in 0..3 {
        assert_eq!(
            post(guard.listen, "/completion", &[], &completion(4))
                .await
                .status,
            200
        );
    }
    let (running, queued) = fill_batch(&guard, 300).await;
    let rejected = post(
        guard.listen,
        "/completion",
        &[("x-guard-class", "batch")],
        &completion(4),
    )
    .await;
    assert_eq!(rejected.status, 503);
    // The upstream dies: the running request and those queued behind it fail.
    llama.kill();
    let mut statuses = vec![running.await.expect("running").0.status];
    for task in queued {
        statuses.push(task.await.expect("queued").0.status);
    }
    assert!(statuses[1..].iter().all(|s| *s == 502), "{statuses:?}");

    let text = guard.metrics_text().await;
    for class in ["interactive", "batch"] {
        let m = |series: &str| {
            guard_tests::metric(&text, &series.replace("CLASS", class)).unwrap_or(0.0)
        };
        let accepted = m("guard_admitted_total{class=\"CLASS\"}");
        let accounted = m("guard_requests_total{class=\"CLASS\",outcome=\"completed\"}")
            + m("guard_requests_total{class=\"CLASS\",outcome=\"reaped\"}")
            + m("guard_requests_total{class=\"CLASS\",outcome=\"failed\"}")
            + m("guard_requests_total{class=\"CLASS\",outcome=\"timed_out\"}")
            + m("guard_rejected_after_queueing_total{class=\"CLASS\",reason=\"deadline_expired\"}")
            + m("guard_rejected_after_queueing_total{class=\"CLASS\",reason=\"shutting_down\"}")
            + m("guard_inflight{class=\"CLASS\"}")
            + m("guard_queue_depth{class=\"CLASS\"}");
        assert_eq!(
            accepted, accounted,
            "{class}: accepted {accepted} != accounted {accounted}\n{text}"
        );
    }
    let m = |series: &str| guard_tests::metric(&text, series).unwrap_or(0.0);
    assert_eq!(
        m("guard_requests_total{class=\"interactive\",outcome=\"completed\"}"),
        3.0
    );
    assert_eq!(
        m("guard_requests_total{class=\"batch\",outcome=\"rejected\"}"),
        1.0
    );
    assert!(m("guard_requests_total{class=\"batch\",outcome=\"failed\"}") >= 2.0);
}

#[tokio::test(flavor = "multi_thread")]
async fn sighup_reloads_limits_and_a_bad_file_keeps_the_old_config() {
    let _serial = serial().await;
    let llama = LlamaServer::start(1).await;
    let mut guard = GuardProcess::start(llama.addr, "openai", TWO_CLASSES);
    let (running, mut queued) = fill_batch(&guard, 300).await;
    let full = post(
        guard.listen,
        "/completion",
        &[("x-guard-class", "batch")],
        &completion(4),
    )
    .await;
    assert_eq!(full.status, 503);

    guard.edit_config_and_reload("max_queue = 2", "max_queue = 3");
    guard.wait_for_log("config reloaded");
    assert_eq!(
        guard.metric("guard_queue_depth{class=\"batch\"}").await,
        2.0,
        "queued requests kept"
    );
    queued.push(spawn_completion(&guard, "batch", 4));
    guard
        .wait_for_metric("guard_queue_depth{class=\"batch\"}", 3.0)
        .await;

    std::fs::write(&guard.config_path, "[class.batch]\nmax_queue = \"lots\"\n").expect("write");
    guard.hangup();
    guard.wait_for_log_naming("config refused", "class.batch.max_queue");
    assert_eq!(
        guard
            .metric("guard_config_reloads_total{result=\"refused\"}")
            .await,
        1.0
    );
    let still_full = post(
        guard.listen,
        "/completion",
        &[("x-guard-class", "batch")],
        &completion(4),
    )
    .await;
    assert_eq!(still_full.status, 503, "the old limit (3) still holds");
    for task in queued {
        assert_eq!(task.await.expect("queued").0.status, 200);
    }
    running.await.expect("running");
}

#[tokio::test(flavor = "multi_thread")]
async fn slow_headers_are_cut_off() {
    use tokio::io::AsyncReadExt as _;
    let _serial = serial().await;
    let llama = LlamaServer::start(1).await;
    let guard = GuardProcess::start(
        llama.addr,
        "openai",
        "[server]\nheader_read_timeout_ms = 500\n",
    );
    let stream = tokio::net::TcpStream::connect(guard.listen)
        .await
        .expect("connect");
    let (mut reader, writer) = stream.into_split();
    let started = Instant::now();
    // A client that sends its request head one byte at a time, slowly (the behaviour under
    // test, not a wait for synchronisation).
    let head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n\r\n".to_vec();
    let trickle = trickle(writer, head, Duration::from_millis(200));
    let mut buffer = Vec::new();
    let _ = reader.read_to_end(&mut buffer).await;
    let elapsed = started.elapsed();
    trickle.abort();
    // guard's clock may start a little before ours (its accept can run before our connect()
    // returns to this task), so allow some of the 500 ms to have passed already.
    assert!(
        elapsed >= Duration::from_millis(400),
        "closed too early: {elapsed:?}"
    );
    assert!(elapsed < Duration::from_secs(5), "not cut off: {elapsed:?}");
    let answer = String::from_utf8_lossy(&buffer);
    assert!(
        answer.is_empty() || answer.starts_with("HTTP/1.1 408"),
        "{answer}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn two_thousand_waiting_clients_keep_memory_bounded() {
    const CLIENTS: usize = 2_000;
    let _serial = serial().await;
    let ollama =
        guard_tests::servers::OllamaEmulator::start(&["--tokens", "400", "--token-delay-ms", "20"]);
    let guard = GuardProcess::start(
        ollama.addr,
        "ollama",
        "[class.interactive]\nmax_queue = 8\n[class.batch]\npriority = 10\nmax_queue = 5000\n",
    );
    let idle = rss_bytes(guard.pid());
    let chat = body::ollama_chat("hi");
    let clients: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let (addr, chat) = (guard.listen, chat.clone());
            tokio::spawn(async move {
                post(addr, "/api/chat", &[("x-guard-class", "batch")], &chat).await
            })
        })
        .collect();
    guard
        .wait_for_metric("guard_queue_depth{class=\"batch\"}", (CLIENTS - 1) as f64)
        .await;
    let loaded = rss_bytes(guard.pid());
    let per_client = (loaded.saturating_sub(idle)) / CLIENTS as u64;
    eprintln!(
        "guard RSS: {} KiB idle, {} KiB with {CLIENTS} waiting ({per_client} B each)",
        idle / 1024,
        loaded / 1024
    );
    assert!(
        loaded < idle + (64 << 20),
        "RSS grew by more than 64 MiB: {idle} -> {loaded}"
    );
    // Still serving others while 2,000 wait: the interactive chat goes first once the slot
    // frees (the one running batch chat completes meanwhile).
    let interactive = post(guard.listen, "/api/chat", &[], &chat).await;
    assert_eq!(interactive.status, 200);
    for client in clients {
        client.abort();
    }
    let completed = guard
        .metric("guard_requests_total{class=\"batch\",outcome=\"completed\"}")
        .await;
    guard
        .wait_for_metric(
            "guard_requests_total{class=\"batch\",outcome=\"reaped\"}",
            CLIENTS as f64 - completed,
        )
        .await;
    assert_eq!(
        guard.metric("guard_queue_depth{class=\"batch\"}").await,
        0.0
    );
    let text = guard.metrics_text().await;
    let queued = guard_tests::metric(
        &text,
        "guard_reaped_total{class=\"batch\",stage=\"queued\"}",
    )
    .unwrap_or(0.0);
    let stats = ollama.stats().await;
    let reached = stats["requests"]["/api/chat"].as_u64().unwrap_or(0);
    eprintln!("reaped while queued: {queued}; chats that reached the upstream: {reached}");
    // Two batch chats ran and one interactive chat went through; a burst of closes may let a
    // few more start before their own close is seen, never many. A request counts as running
    // from the moment guard starts sending it, whether or not the upstream read it.
    assert!(reached <= 12, "{reached} chats reached the upstream");
    // The freed slot runs along the test's loop of closes: each client it reaches before its
    // own close counts as running (reaped/running) though its chat never reached the
    // upstream (above). Seen: 6 to 40 of 2,000.
    assert!(
        queued >= (CLIENTS - 60) as f64,
        "{queued} reaped while queued"
    );
}

/// An upstream that spells a header name its own way, `X-custom-SPELLING` (which Title-Case
/// would not make): on a stream for POSTs, on a small JSON answer for GETs.
async fn spelling_upstream() -> std::net::SocketAddr {
    http::scripted_upstream(|head| {
        let answer = if head.starts_with(b"POST") {
            let event = "data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\n";
            let done = "data: [DONE]\n\n";
            format!(
                "HTTP/1.1 200 OK\r\nX-custom-SPELLING: Kept\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n{:x}\r\n{event}\r\n{:x}\r\n{done}\r\n0\r\n\r\n",
                event.len(),
                done.len()
            )
        } else {
            "HTTP/1.1 200 OK\r\nX-custom-SPELLING: Kept\r\nContent-Type: application/json\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}".to_owned()
        };
        Some(answer.into_bytes())
    })
    .await
}

/// The response head guard sends for `request`, as bytes on the wire.
async fn raw_head(addr: std::net::SocketAddr, request: &str) -> String {
    let answer = http::raw(addr, request.as_bytes()).await;
    answer
        .split("\r\n\r\n")
        .next()
        .unwrap_or_default()
        .to_owned()
}

#[tokio::test(flavor = "multi_thread")]
async fn header_names_reach_the_client_as_the_upstream_spelled_them() {
    let upstream = spelling_upstream().await;
    let guard = GuardProcess::start(upstream, "openai", "");
    let request = http::request_bytes(
        "/v1/chat/completions",
        &[("Connection", "close")],
        &body::chat("hi").with("stream", true),
    );
    let queued = raw_head(guard.listen, &request).await;
    assert!(queued.starts_with("HTTP/1.1 200"), "{queued}");
    assert!(
        queued.contains("\r\nX-custom-SPELLING: Kept"),
        "queued stream:\n{queued}"
    );
    // guard's own header in the spelling the ecosystem uses.
    assert!(
        queued.contains("\r\nX-Guard-Class: interactive"),
        "{queued}"
    );
    let passed = raw_head(
        guard.listen,
        "GET /props HTTP/1.1\r\nHost: g\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(passed.starts_with("HTTP/1.1 200"), "{passed}");
    assert!(
        passed.contains("\r\nX-custom-SPELLING: Kept"),
        "pass-through:\n{passed}"
    );
}

/// A body guard cannot read (not JSON) is classified without a model, queued and forwarded:
/// the client gets llama-server's own answer, its API-key check first, as it would straight
/// (docs/design.md §6).
#[tokio::test(flavor = "multi_thread")]
async fn a_body_guard_cannot_read_gets_the_upstreams_own_answer() {
    let _serial = serial().await;
    let llama = LlamaServer::start_with(1, &["--api-key", "sesame"]).await;
    let guard = GuardProcess::start(llama.addr, "openai", "");
    let not_json = bytes::Bytes::from_static(b"this is not JSON {");
    let send = async |addr, key: Option<&str>| {
        let auth = key.map(|k| format!("Bearer {k}"));
        let mut headers = vec![("content-type", "application/json")];
        if let Some(auth) = &auth {
            headers.push(("authorization", auth.as_str()));
        }
        http::send(
            addr,
            "POST",
            "/v1/chat/completions",
            &headers,
            not_json.clone(),
        )
        .await
        .expect("an answer")
    };
    for (key, expected) in [(None, 401), (Some("sesame"), 0)] {
        let straight = send(llama.addr, key).await;
        let through = send(guard.listen, key).await;
        if expected != 0 {
            assert_eq!(straight.status, expected, "{}", straight.text());
        }
        assert_eq!(
            (through.status, through.text()),
            (straight.status, straight.text()),
            "key {key:?}: through guard as straight"
        );
        assert_eq!(through.header("x-guard-class"), Some("interactive"));
    }
    let admitted = guard
        .metric("guard_admitted_total{class=\"interactive\"}")
        .await;
    assert_eq!(admitted, 2.0, "both were queued");
}
