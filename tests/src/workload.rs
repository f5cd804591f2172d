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

use guard_testkit::{Polling, until_with};
use tokio::{sync::Barrier, task::JoinSet};

use crate::{
    body::{With as _, chat, completion},
    http::{post, post_streamed},
};

/// How the flood and the chats are shaped.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    /// Batch clients sending back to back: even ones `/completion` extractions of
    /// `batch_tokens`, odd ones (where `unbounded`) streamed chats with no token limit.
    pub batch_clients: usize,
    /// Tokens per bounded batch request.
    pub batch_tokens: u32,
    /// Odd batch clients ask for stories with no token limit (they end at their own stop).
    pub unbounded: bool,
    /// Interactive chats, one after another.
    pub chats: usize,
    /// Tokens per chat.
    pub chat_tokens: u32,
    /// From one chat's start to the next's (at least its own length); with no chats, the
    /// window over which the batch alone is measured.
    pub chat_every: Duration,
}

impl Default for Shape {
    fn default() -> Self {
        Self {
            batch_clients: 6,
            batch_tokens: 160,
            unbounded: false,
            chats: 10,
            chat_tokens: 16,
            chat_every: Duration::ZERO,
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
    /// Batch tokens generated a second while the chats ran: llama-server's own count of its
    /// decode steps over the chats' window (one a generated token on a slot, as they happen),
    /// less the chats' own (their tokens and one prompt step each).
    pub batch_tokens_per_second: f64,
}

/// A batch story's prompt: a passage to build on, as batch jobs read one (long enough that a
/// chat, sharing only the template's system prompt with it, cannot take its cached state).
const STORY: &str = "Here are the notes of a harbour town's lighthouse keeper: the weather, the \
                     ships and the tides, written each night in a ledger; fishermen, traders \
                     and a travelling doctor who passed through each year; a winter storm that \
                     kept the lamp burning for three days. Tell me a story built on these notes.";

/// A bounded batch job: an extraction of exactly `tokens` tokens (llama.cpp's `/completion`).
pub fn extraction(tokens: u32) -> serde_json::Value {
    completion("Extract every name from this text: ...", tokens.into())
}

/// One batch client's request: a bounded extraction, or (odd clients, where the shape says)
/// a streamed story with no token limit.
fn batch_request(shape: Shape, client: usize) -> (&'static str, serde_json::Value) {
    match shape.unbounded && client % 2 == 1 {
        true => ("/v1/chat/completions", chat(STORY).with("stream", true)),
        false => ("/completion", extraction(shape.batch_tokens)),
    }
}

/// Runs the chats against `target` (llama-server at `llama`, or guard in front of it), with
/// the batch flood running alongside when `flood`.
pub async fn run(target: SocketAddr, llama: SocketAddr, shape: Shape, flood: bool) -> Outcome {
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
        for client in 0..shape.batch_clients {
            let (stop, completed, started) = (
                Arc::clone(&stop),
                Arc::clone(&completed),
                Arc::clone(&started),
            );
            workers.spawn(async move {
                let (path, body) = batch_request(shape, client);
                let mut first = true;
                while !stop.load(Ordering::Relaxed) {
                    let request = post(target, path, &[("x-guard-class", "batch")], &body);
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
    let generated_before = generated(llama).await;
    let window = Instant::now();
    // A chat's steps: one for its prompt, one a token.
    let mut chat_steps = 0;
    for n in 0..shape.chats {
        let body = chat("Say hello in five words.")
            .with("max_tokens", shape.chat_tokens)
            .with("stream", true);
        let sent = Instant::now();
        let streamed = post_streamed(target, "/v1/chat/completions", &[], &body).await;
        if streamed.status == 503 {
            outcome.chats_rejected += 1;
        } else {
            let with_text = |data: &bytes::Bytes| {
                let text = String::from_utf8_lossy(data);
                text.contains("\"content\":\"") && !text.contains("\"content\":\"\"")
            };
            if let Some((at, _)) = streamed.frames.iter().find(|(_, data)| with_text(data)) {
                outcome.ttft.push(at.duration_since(sent));
            }
            chat_steps += 1 + streamed.frames.iter().filter(|(_, d)| with_text(d)).count() as u64;
        }
        // The next chat comes at its time (the chats arrive as a person's would).
        tokio::time::sleep_until((window + shape.chat_every * (n as u32 + 1)).into()).await;
    }
    if shape.chats == 0 {
        // Batch alone: the window is one chat period with no chat in it.
        tokio::time::sleep_until((window + shape.chat_every).into()).await;
    }
    let took = window.elapsed();
    let batch = (generated(llama).await - generated_before).saturating_sub(chat_steps);
    outcome.batch_tokens_per_second = batch as f64 / took.as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    workers.abort_all();
    outcome
}

/// llama-server's own count of its decode steps: with one slot, one a generated token (and
/// one a prompt batch), counted as they happen (its generated-token count grows only as
/// requests end, too coarse for a window shorter than a long job).
async fn generated(llama: SocketAddr) -> u64 {
    let Ok(response) = crate::http::get(llama, "/metrics").await else {
        return 0;
    };
    crate::metric(&response.text(), "llamacpp:n_decode_total").unwrap_or(0.0) as u64
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
    let polling = Polling::within(Duration::from_secs(120), Duration::from_millis(100));
    until_with(polling, "llama-server is idle", async || {
        let Ok(response) = crate::http::get(llama, "/metrics").await else {
            return false;
        };
        let text = response.text();
        let busy = crate::metric(&text, "llamacpp:requests_processing").unwrap_or(0.0)
            + crate::metric(&text, "llamacpp:requests_deferred").unwrap_or(0.0);
        busy == 0.0
    })
    .await;
}
