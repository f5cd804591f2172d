//! guard against hostile clients, on the real daemon and real sockets: every spelling of a
//! generation path is queued, bodies are bounded before they are read, listeners and
//! pass-through are bounded, client-chosen labels and hop-by-hop headers go nowhere, and an
//! empty file on SIGHUP keeps the running config.

use std::{path::Path, process::Command, time::Duration};

use guard_testkit::{Mode, Script, Upstream, until};
use guard_tests::{
    http::{self, post, raw},
    metric,
    scripted::post_script,
    serial,
    servers::{GuardProcess, OllamaEmulator},
};
use serde_json::json;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

#[tokio::test(flavor = "multi_thread")]
async fn every_spelling_of_a_generation_path_is_queued() {
    let _serial = serial().await;
    let upstream = Upstream::start().await;
    let config = "[upstream]\nmax_concurrency = 1\n[class.interactive]\nmax_queue = 32\n";
    let guard = GuardProcess::start(upstream.addr(), "openai", config);
    let addr = guard.listen;
    // A busy slot: one stream holds it while every spelling arrives.
    let busy = tokio::spawn(async move {
        http::post_streamed(
            addr,
            "/v1/chat/completions",
            &[],
            &Script::new(Mode::Stream)
                .frames(40, Duration::from_millis(10))
                .json(),
        )
        .await
    });
    until("the slot is busy", async || upstream.open() == 1).await;
    let spellings: [&'static str; 18] = [
        "/api/%67enerate",
        "/%61pi/chat",
        "/api%2Fembed",
        "/api/./embeddings",
        "/%63ompletion",
        "/completions",
        "/chat/completions",
        "/v1/x/../completions",
        "//v1/chat/completions",
        "/v1/responses",
        "/v1/messages",
        "/v1/rerank",
        "/infill",
        "/rerank",
        "/embedding",
        "/embeddings",
        "/v1/embeddings",
        "/v1%2Fchat%2Fcompletions",
    ];
    let mut sent = tokio::task::JoinSet::new();
    for (id, path) in spellings.into_iter().enumerate() {
        let script = Script::new(Mode::Complete).id(id as u64 + 1).json();
        sent.spawn(async move { post(addr, path, &[], &script).await.status });
    }
    until("every spelling waits in the queue", async || {
        guard
            .metric("guard_queue_depth{class=\"interactive\"}")
            .await
            == spellings.len() as f64
    })
    .await;
    assert_eq!(upstream.started(), 1, "none passed the busy slot");
    assert_eq!(busy.await.expect("busy").status, 200);
    while let Some(status) = sent.join_next().await {
        assert_eq!(status.expect("client"), 200);
    }
    assert_eq!(upstream.peak(), 1, "the upstream never saw two at once");
    let undecodable = raw(
        addr,
        b"POST /api/gen%zzerate HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}",
    )
    .await;
    assert!(undecodable.starts_with("HTTP/1.1 400"), "{undecodable}");
}

#[tokio::test(flavor = "multi_thread")]
async fn bodies_over_the_limit_are_refused_before_they_are_read() {
    let _serial = serial().await;
    let ollama = OllamaEmulator::start(&[]);
    let guard = GuardProcess::start(
        ollama.addr,
        "ollama",
        "[server]\nbody_limit_bytes = 1048576\n",
    );
    // Expect: 100-continue for 20 MB: the 413 comes instead of 100 Continue.
    let answer = raw(
        guard.listen,
        b"POST /api/generate HTTP/1.1\r\nhost: x\r\ncontent-length: 20000000\r\nexpect: 100-continue\r\n\r\n",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(!answer.contains("100 Continue"), "{answer}");
    // A request head over guard's 32 KiB buffer: 431.
    let huge_head = format!(
        "GET /api/tags HTTP/1.1\r\nhost: x\r\nx-filler: {}\r\n\r\n",
        "y".repeat(40 << 10)
    );
    let answer = raw(guard.listen, huge_head.as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.1 431"), "{answer}");
    // Two lengths: 400. A length beside chunked encoding is read by the encoding alone and the
    // connection closes after its answer (RFC 9112 §6.1): a request smuggled in its body is
    // never served.
    let answer = raw(
        guard.listen,
        b"POST /api/generate HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\n{}",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    let smuggling = b"POST /api/generate HTTP/1.1\r\nhost: x\r\ncontent-length: 4\r\n\
        transfer-encoding: chunked\r\n\r\n0\r\n\r\nGET /api/tags HTTP/1.1\r\nhost: x\r\n\r\n";
    let answer = raw(guard.listen, smuggling).await;
    assert_eq!(
        answer.matches("HTTP/1.1 ").count(),
        1,
        "one answer, then closed: {answer}"
    );
    // 200 MiB with four real clients: each sees the 413.
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("support/big_body.py");
    let out = Command::new("python3")
        .arg(script)
        .arg(guard.listen.to_string())
        .arg("200")
        .output()
        .expect("run big_body.py");
    let seen: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|_| panic!("{}", String::from_utf8_lossy(&out.stderr)));
    for client in ["curl", "requests", "http.client", "ollama"] {
        assert_eq!(seen[client], 413, "{client}: {seen}");
    }
    let stats = ollama.stats().await;
    let generated = stats["requests"]["/api/generate"].as_u64().unwrap_or(0);
    assert!(
        generated <= 1,
        "only the chunked body reached the upstream: {stats}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn made_up_model_names_never_become_labels() {
    let _serial = serial().await;
    let ollama = OllamaEmulator::start(&["--tokens", "2"]);
    let config = "[upstream]\nrefuse_remote_models = true\n[watch]\ninterval_ms = 200\n";
    let guard = GuardProcess::start(ollama.addr, "ollama", config);
    // The upstream's own model has its series once the watcher has asked about it.
    until("the upstream's models are known", async || {
        let text = guard.metrics_text().await;
        guard.metric("guard_upstream_up").await == 1.0
            && text.contains("guard_model_remote{model=\"smollm2:135m\"}")
            && text.contains("guard_model_cold_loads_total{model=\"smollm2:135m\"}")
    })
    .await;
    let refuse = async |n: usize| {
        let body = json!({ "model": format!("made-up-{n}-cloud"), "prompt": "hi" });
        let refused = post(guard.listen, "/api/generate", &[], &body).await;
        assert_eq!(refused.status, 403, "{}", refused.text());
    };
    // The first refusal may create its series; 299 more names must add none.
    refuse(0).await;
    let series = |text: &str| -> std::collections::BTreeSet<String> {
        text.lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| l.rsplit_once(' ').map(|(name, _)| name.to_owned()))
            .collect()
    };
    let before = series(&guard.metrics_text().await);
    for n in 1..300 {
        refuse(n).await;
    }
    let text = guard.metrics_text().await;
    assert!(
        !text.contains("made-up"),
        "a client-chosen name became a label"
    );
    let after = series(&text);
    assert_eq!(
        after.difference(&before).collect::<Vec<_>>(),
        Vec::<&String>::new(),
        "new series after 299 more made-up names"
    );
    assert_eq!(
        metric(
            &text,
            "guard_remote_refused_total{class=\"interactive\",model=\"other\"}"
        ),
        Some(300.0)
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn headers_named_in_connection_never_reach_the_upstream() {
    let _serial = serial().await;
    let upstream = Upstream::start().await;
    let guard = GuardProcess::start(upstream.addr(), "openai", "");
    let hop = [
        ("connection", "x-secret, keep-alive"),
        ("x-secret", "do not forward"),
    ];
    let queued = post(
        guard.listen,
        "/v1/chat/completions",
        &hop,
        &Script::new(Mode::Complete).json(),
    )
    .await;
    assert_eq!(queued.status, 200);
    let passed = http::send(guard.listen, "GET", "/v1/models", &hop, Default::default())
        .await
        .expect("passes through");
    assert_eq!(passed.status, 200);
    let heads = upstream.heads();
    assert!(heads.len() >= 2, "{heads:?}");
    for head in heads {
        assert!(
            !head.to_ascii_lowercase().contains("x-secret"),
            "forwarded: {head}"
        );
    }
}

/// `CONNECT` asks for a tunnel and `TRACE` echoes credentials: guard answers both itself (405
/// with `Allow`, in the API's error shape, the connection closed), never the upstream, in any
/// of the forms a request target can take, and counts each as invalid.
#[tokio::test(flavor = "multi_thread")]
async fn connect_and_trace_are_answered_by_guard_never_forwarded() {
    let _serial = serial().await;
    let upstream = Upstream::start().await;
    let guard = GuardProcess::start(upstream.addr(), "openai", "");
    let upstream_host = upstream.addr().to_string();
    let requests = [
        format!("CONNECT {upstream_host} HTTP/1.1\r\nHost: {upstream_host}\r\n\r\n"),
        "CONNECT /v1/chat/completions HTTP/1.1\r\nHost: guard\r\n\r\n".to_owned(),
        "TRACE /v1/models HTTP/1.1\r\nHost: guard\r\nAuthorization: Bearer s3cret\r\n\r\n"
            .to_owned(),
    ];
    for request in &requests {
        let answer = http::raw(guard.listen, request.as_bytes()).await;
        let lower = answer.to_ascii_lowercase();
        assert!(
            answer.starts_with("HTTP/1.1 405"),
            "{request:?} -> {answer}"
        );
        assert!(lower.contains("\r\nallow: get, head, post"), "{answer}");
        assert!(lower.contains("\r\nconnection: close"), "{answer}");
        assert!(answer.contains("method_not_allowed"), "{answer}");
        assert!(
            !answer.contains("s3cret"),
            "nothing of the request echoed: {answer}"
        );
    }
    assert!(
        upstream.heads().is_empty(),
        "forwarded: {:?}",
        upstream.heads()
    );
    let invalid = "guard_invalid_requests_total{reason=\"method\"}";
    assert_eq!(guard.metric(invalid).await, requests.len() as f64);
    // The listener serves on: an ordinary request still goes through.
    let passed = http::send(guard.listen, "GET", "/v1/models", &[], Default::default())
        .await
        .expect("passes through");
    assert_eq!(passed.status, 200);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_empty_file_on_sighup_keeps_the_rules() {
    let _serial = serial().await;
    let ollama = OllamaEmulator::start(&["--tokens", "2"]);
    let config = "[class.interactive]\n[class.batch]\npriority = 10\n\
                  [[classify.rule]]\nclass = \"batch\"\npath_prefix = \"/api/generate\"\n";
    let mut guard = GuardProcess::start(ollama.addr, "ollama", config);
    std::fs::write(&guard.config_path, "").expect("truncate");
    guard.hangup();
    let refused = guard.wait_for_log("config refused");
    assert!(
        refused.last().is_some_and(|l| l.contains("sets no key")),
        "{refused:?}"
    );
    let response = post(
        guard.listen,
        "/api/generate",
        &[],
        &json!({ "model": "m", "prompt": "hi" }),
    )
    .await;
    assert_eq!(
        response.header("x-guard-class"),
        Some("batch"),
        "the rule still holds"
    );
    assert_eq!(
        guard
            .metric("guard_config_reloads_total{result=\"refused\"}")
            .await,
        1.0
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn pass_through_is_bounded() {
    let _serial = serial().await;
    let upstream = Upstream::start().await;
    let guard = GuardProcess::start(
        upstream.addr(),
        "openai",
        "[upstream]\nmax_passthrough = 8\n",
    );
    // An endpoint guard does not queue, streaming for a while: 40 at once against 8.
    let mut clients = tokio::task::JoinSet::new();
    for id in 0..40 {
        let addr = guard.listen;
        let script = Script::new(Mode::Stream)
            .frames(20, Duration::from_millis(10))
            .id(id)
            .json();
        clients.spawn(async move { post(addr, "/api/pull", &[], &script).await.status });
    }
    let mut statuses = Vec::new();
    while let Some(status) = clients.join_next().await {
        statuses.push(status.expect("client"));
    }
    let refused = statuses.iter().filter(|s| **s == 503).count();
    assert!(refused >= 40 - 8, "{statuses:?}");
    assert!(
        statuses.iter().all(|s| *s == 200 || *s == 503),
        "{statuses:?}"
    );
    assert!(
        upstream.peak() <= 8,
        "upstream requests at once: {}",
        upstream.peak()
    );
    let text = guard.metrics_text().await;
    assert_eq!(
        metric(&text, "guard_passthrough_requests_total{code=\"503\"}"),
        Some(refused as f64)
    );
}

/// Raises this test process's own open-file limit to what it needs for many sockets.
fn allow_files(count: u64) {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).expect("getrlimit");
    let wanted = count.max(hard);
    setrlimit(Resource::RLIMIT_NOFILE, wanted, wanted).expect("setrlimit (root)");
}

#[tokio::test(flavor = "multi_thread")]
async fn stalled_large_bodies_hold_at_most_the_cap_and_give_it_back() {
    const MIB: usize = 1 << 20;
    let _serial = serial().await;
    let ollama = OllamaEmulator::start(&[]);
    let config = "[server]\nbody_limit_bytes = 16777216\nmax_body_bytes_in_flight = 67108864\n\
                  [class.interactive]\nbody_read_timeout_ms = 60000\n";
    let guard = GuardProcess::start(ollama.addr, "ollama", config);
    let idle = guard_tests::rss_bytes(guard.pid());
    let head = format!(
        "POST /api/generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        16 * MIB
    );
    let mut stalled = Vec::new();
    for _ in 0..40 {
        let mut stream = tokio::net::TcpStream::connect(guard.listen)
            .await
            .expect("connect");
        stream.write_all(head.as_bytes()).await.expect("head");
        stalled.push(stream);
    }
    // Most of each body, then nothing more: those guard took hold 15 MiB each.
    let chunk = vec![b' '; MIB];
    let mut writes = tokio::task::JoinSet::new();
    for mut stream in stalled {
        let chunk = chunk.clone();
        writes.spawn(async move {
            for _ in 0..15 {
                if stream.write_all(&chunk).await.is_err() {
                    break;
                }
            }
            stream
        });
    }
    let mut stalled = Vec::new();
    while let Some(stream) = writes.join_next().await {
        stalled.push(stream.expect("writer"));
    }
    until("the bodies guard took are in", async || {
        guard.metric("guard_body_bytes_in_flight").await >= (64 * MIB) as f64
    })
    .await;
    let loaded = guard_tests::rss_bytes(guard.pid());
    assert!(
        loaded < idle + (64 + 32) as u64 * MIB as u64,
        "RSS {} MiB with 40 stalled bodies (idle {} MiB, cap 64 MiB)",
        loaded >> 20,
        idle >> 20
    );
    let text = guard.metrics_text().await;
    let refused = metric(
        &text,
        "guard_rejected_total{class=\"interactive\",reason=\"body_bytes_full\"}",
    );
    assert_eq!(refused, Some(36.0), "the rest were told 503 at once");
    drop(stalled);
    until("the bodies are given back", async || {
        guard.metric("guard_body_bytes_in_flight").await == 0.0
    })
    .await;
    let after = guard_tests::rss_bytes(guard.pid());
    assert!(
        after < idle + 16 * MIB as u64,
        "RSS {} MiB after they closed (idle {} MiB)",
        after >> 20,
        idle >> 20
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_flood_of_connections_is_refused_past_the_cap() {
    let _serial = serial().await;
    allow_files(16_384);
    let upstream = Upstream::start().await;
    let guard = GuardProcess::start(
        upstream.addr(),
        "openai",
        "[server]\nmax_connections = 1000\n",
    );
    let idle = guard_tests::rss_bytes(guard.pid());
    let mut open = Vec::new();
    for _ in 0..5_000 {
        open.push(
            tokio::net::TcpStream::connect(guard.listen)
                .await
                .expect("connect"),
        );
    }
    until("4000 refused", async || {
        guard
            .metric("guard_connections_refused_total{listener=\"proxy\"}")
            .await
            >= 4_000.0
    })
    .await;
    let loaded = guard_tests::rss_bytes(guard.pid());
    assert!(
        loaded < idle + (64 << 20),
        "RSS {} MiB (idle {} MiB)",
        loaded >> 20,
        idle >> 20
    );
    // The refused ones read a 503.
    let mut told = 0;
    for stream in open.iter_mut().rev().take(100) {
        let mut answer = [0u8; 64];
        if let Ok(Ok(n)) =
            tokio::time::timeout(Duration::from_secs(1), stream.read(&mut answer)).await
            && answer[..n].starts_with(b"HTTP/1.1 503")
        {
            told += 1;
        }
    }
    assert!(told >= 90, "{told} of the last 100 read a 503");
    drop(open);
    until("guard serves again", async || {
        post_script(guard.listen, &Script::new(Mode::Complete))
            .await
            .status
            == 200
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn out_of_descriptors_the_proxy_serves_and_the_log_stays_small() {
    let _serial = serial().await;
    let upstream = Upstream::start().await;
    let launch = guard_tests::servers::Launch {
        nofile: Some(256),
        ..Default::default()
    };
    let guard = GuardProcess::launch(
        upstream.addr(),
        "openai",
        "[ebpf]\nenabled = false\n",
        &launch,
    );
    let mut idle = Vec::new();
    for _ in 0..400 {
        idle.push(
            tokio::net::TcpStream::connect(guard.metrics)
                .await
                .expect("connect"),
        );
    }
    for _ in 0..5 {
        let response = post_script(guard.listen, &Script::new(Mode::Complete)).await;
        assert_eq!(
            response.status, 200,
            "the proxy serves while the metrics port is flooded"
        );
    }
    // Now the descriptors run out for real: idle proxy connections past 256.
    for _ in 0..300 {
        idle.push(
            tokio::net::TcpStream::connect(guard.listen)
                .await
                .expect("connect"),
        );
    }
    // Two seconds at the limit is the measurement: a spinning accept loop would log
    // thousands of lines in it.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let lines = guard.log_lines().len();
    assert!(lines < 60, "{lines} log lines at the descriptor limit");
    assert!(
        guard
            .log_lines()
            .iter()
            .any(|l| l.contains("accept failed")),
        "the limit was reached and said"
    );
    drop(idle);
    until("/metrics answers again", async || {
        http::get(guard.metrics, "/metrics")
            .await
            .is_ok_and(|r| r.status == 200)
    })
    .await;
    let response = post_script(guard.listen, &Script::new(Mode::Complete)).await;
    assert_eq!(response.status, 200, "the proxy serves once they go");
}
