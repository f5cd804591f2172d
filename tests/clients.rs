//! guard in front of the Ollama API (the emulator: Ollama cannot be installed here) and of
//! llama-server, driven by raw HTTP and by the real `ollama` and `openai` Python clients.

use std::{net::SocketAddr, process::Command};

use guard_tests::{
    body::{MODEL, ollama_chat},
    http::{post, post_streamed},
    serial,
    servers::{GuardProcess, LlamaServer, OllamaEmulator},
};
use serde_json::{Value, json};

fn python_client(which: &str, guard: SocketAddr) -> Value {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/support/python_clients.py");
    let output = Command::new("python3")
        .args([script, which, &guard.to_string()])
        .output()
        .expect("run python3");
    assert!(
        output.status.success(),
        "{which} client failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).expect("the script prints JSON")
}

const CLASSES: &str = "[class.interactive]\npriority = 0\nmax_queue = 4\n\
                       [class.batch]\npriority = 10\nmax_queue = 1\n";

#[tokio::test(flavor = "multi_thread")]
async fn ollama_paths_stream_ndjson_and_errors_keep_ollama_shape() {
    let _serial = serial().await;
    let ollama = OllamaEmulator::start(&["--tokens", "30", "--token-delay-ms", "30"]);
    let guard = GuardProcess::start(ollama.addr, "ollama", CLASSES);
    let chat = ollama_chat("hi");

    let streamed = post_streamed(guard.listen, "/api/chat", &[], &chat).await;
    assert_eq!(streamed.status, 200);
    assert!(
        streamed.frames.len() >= 10,
        "NDJSON relayed line by line: {} frames",
        streamed.frames.len()
    );
    let text = streamed.text();
    let last: Value = serde_json::from_str(text.lines().last().expect("lines")).expect("json line");
    assert_eq!(last["done"], true);

    // Fill the batch class (one running, one waiting), then one more: Ollama's error shape.
    let flood = |n: usize| {
        let (addr, chat) = (guard.listen, chat.clone());
        (0..n).map(move |_| {
            let chat = chat.clone();
            tokio::spawn(async move {
                post(addr, "/api/chat", &[("x-guard-class", "batch")], &chat).await
            })
        })
    };
    let first: Vec<_> = flood(1).collect();
    guard
        .wait_for_metric("guard_inflight{class=\"batch\"}", 1.0)
        .await;
    let second: Vec<_> = flood(1).collect();
    guard
        .wait_for_metric("guard_queue_depth{class=\"batch\"}", 1.0)
        .await;
    let rejected = post(
        guard.listen,
        "/api/chat",
        &[("x-guard-class", "batch")],
        &chat,
    )
    .await;
    assert_eq!(rejected.status, 503);
    assert!(rejected.header("retry-after").is_some());
    let error = rejected.json()["error"]
        .as_str()
        .expect("Ollama shape: a string")
        .to_owned();
    assert!(
        error.contains("batch") && error.contains("queue_full"),
        "{error}"
    );
    for task in first.into_iter().chain(second) {
        assert_eq!(task.await.expect("task").status, 200);
    }
    let stats = ollama.stats().await;
    assert_eq!(
        stats["max_active"], 1,
        "guard held the upstream to one request at a time"
    );
    assert_eq!(
        stats["requests"]["/api/chat"], 3,
        "the rejected request never arrived"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn the_real_ollama_client_works_through_guard() {
    let _serial = serial().await;
    let ollama = OllamaEmulator::start(&["--load-ms", "200"]);
    let guard = GuardProcess::start(ollama.addr, "ollama", CLASSES);
    let out = tokio::task::spawn_blocking(move || python_client("ollama", guard.listen))
        .await
        .expect("client");
    assert!(out["chat"].as_str().is_some_and(|s| !s.is_empty()), "{out}");
    assert!(
        out["chat_load_duration"]
            .as_u64()
            .is_some_and(|ns| ns >= 200_000_000),
        "cold load passed through: {out}"
    );
    assert!(
        out["chat_stream_chunks"].as_u64().is_some_and(|n| n > 2),
        "{out}"
    );
    assert_eq!(out["chat_stream_done"], true);
    assert!(out["generate"].as_str().is_some_and(|s| !s.is_empty()));
    assert!(
        out["generate_stream_chunks"]
            .as_u64()
            .is_some_and(|n| n > 2)
    );
    assert_eq!(out["embed_dims"], 16);
    assert_eq!(out["ps_models"], json!([MODEL]), "/api/ps passes through");
    assert_eq!(out["unknown_class"]["status"], 400);
    assert!(
        out["unknown_class"]["error"]
            .as_str()
            .is_some_and(|e| e.contains("batch, interactive")),
        "{out}"
    );
    drop(ollama);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_real_openai_client_works_through_guard() {
    let _serial = serial().await;
    let llama = LlamaServer::start(1).await;
    let guard = GuardProcess::start(llama.addr, "openai", CLASSES);
    let listen = guard.listen;
    let out = tokio::task::spawn_blocking(move || python_client("openai", listen))
        .await
        .expect("client");
    assert!(out["chat"].as_str().is_some_and(|s| !s.is_empty()), "{out}");
    assert_eq!(out["class_header"], "interactive");
    assert!(
        out["chat_stream_chunks"].as_u64().is_some_and(|n| n > 2),
        "{out}"
    );
    assert!(
        out["chat_stream_text"]
            .as_str()
            .is_some_and(|s| !s.is_empty())
    );
    assert!(out["completion"].as_str().is_some_and(|s| !s.is_empty()));
    assert_eq!(out["unknown_class"]["status"], 400, "{out}");
    assert_eq!(out["unknown_class"]["code"], "unknown_class", "{out}");
    guard
        .wait_for_metric(
            "guard_requests_total{class=\"interactive\",outcome=\"completed\"}",
            4.0,
        )
        .await;
    assert_eq!(
        guard
            .metric("guard_requests_total{class=\"interactive\",outcome=\"reaped\"}")
            .await,
        0.0,
        "a client that read everything was not reaped"
    );
}
