//! The mixed workload of the demo and of `cargo xtask bench proxy`: interactive chats while a
//! batch flood runs, against guard or straight against llama-server.

use std::{
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use serde_json::json;
use tokio::{sync::Barrier, task::JoinSet};

use crate::http::{post, post_streamed};

/// How the flood and the chats are shaped.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    /// Batch clients sending back to back.
    pub batch_clients: usize,
    /// Tokens per batch request.
    pub batch_tokens: u32,
    /// Interactive chats, one after another.
    pub chats: usize,
    /// Tokens per chat.
    pub chat_tokens: u32,
}

impl Default for Shape {
    fn default() -> Self {
        Self {
            batch_clients: 6,
            batch_tokens: 160,
            chats: 10,
            chat_tokens: 16,
        }
    }
}

/// What one run measured.
#[derive(Debug, Default)]
pub struct Outcome {
    /// Time to the first generated token of each interactive chat that was answered.
    pub ttft: Vec<Duration>,
    /// Chats answered 503 (guard said no at once).
    pub chats_rejected: usize,
    /// Batch requests completed while the chats ran.
    pub batch_completed: usize,
}

/// Runs the chats against `target`, with the batch flood running alongside when `flood`.
pub async fn run(target: SocketAddr, shape: Shape, flood: bool) -> Outcome {
    let stop = Arc::new(AtomicBool::new(false));
    let completed = Arc::new(AtomicUsize::new(0));
    let started = Arc::new(Barrier::new(if flood {
        shape.batch_clients + 1
    } else {
        1
    }));
    // A set, so that the flood ends with this run even when the run itself is dropped midway.
    let mut workers = JoinSet::new();
    if flood {
        for _ in 0..shape.batch_clients {
            let (stop, completed, started) = (
                Arc::clone(&stop),
                Arc::clone(&completed),
                Arc::clone(&started),
            );
            workers.spawn(async move {
                let body = json!({ "prompt": "Extract every name from this text: ...", "n_predict": shape.batch_tokens, "ignore_eos": true });
                let mut first = true;
                while !stop.load(Ordering::Relaxed) {
                    let request = post(target, "/completion", &[("x-guard-class", "batch")], &body);
                    if first {
                        first = false;
                        // The first request is on its way: the flood is under way.
                        let (response, ()) = tokio::join!(request, async {
                            started.wait().await;
                        });
                        count(&completed, &response);
                    } else {
                        count(&completed, &request.await);
                    }
                }
            });
        }
    }
    started.wait().await;
    // Give the flood's requests time to reach the server's (or guard's) queue.
    if flood {
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let mut outcome = Outcome::default();
    let completed_before = completed.load(Ordering::Relaxed);
    for _ in 0..shape.chats {
        let body = json!({
            "messages": [{ "role": "user", "content": "Say hello in five words." }],
            "max_tokens": shape.chat_tokens,
            "stream": true,
        });
        let sent = Instant::now();
        let streamed = post_streamed(target, "/v1/chat/completions", &[], &body).await;
        if streamed.status == 503 {
            outcome.chats_rejected += 1;
            continue;
        }
        let first_token = streamed.frames.iter().find(|(_, data)| {
            let text = String::from_utf8_lossy(data);
            text.contains("\"content\":\"") && !text.contains("\"content\":\"\"")
        });
        if let Some((at, _)) = first_token {
            outcome.ttft.push(at.duration_since(sent));
        }
    }
    outcome.batch_completed = completed.load(Ordering::Relaxed) - completed_before;
    stop.store(true, Ordering::Relaxed);
    workers.abort_all();
    outcome
}

fn count(completed: &AtomicUsize, response: &crate::http::Response) {
    if response.status == 200 {
        completed.fetch_add(1, Ordering::Relaxed);
    }
}

/// The value at quantile `q` (0..=1) of `samples`.
pub fn percentile(samples: &[Duration], q: f64) -> Duration {
    if samples.is_empty() {
        return Duration::ZERO;
    }
    let mut sorted = samples.to_vec();
    sorted.sort();
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

/// Waits until llama-server has nothing running or waiting (after a flood's clients left).
pub async fn wait_until_idle(llama: SocketAddr) {
    let started = Instant::now();
    loop {
        if let Ok(response) = crate::http::get(llama, "/metrics").await {
            let text = response.text();
            let busy = crate::metric(&text, "llamacpp:requests_processing").unwrap_or(0.0)
                + crate::metric(&text, "llamacpp:requests_deferred").unwrap_or(0.0);
            if busy == 0.0 {
                return;
            }
        }
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "llama-server stays busy"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
