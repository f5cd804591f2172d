//! Limits that hold, on real sockets: the concurrency bound is exact against a counting
//! upstream under a seeded random mix and a SIGHUP that lowers it; deadlines are predicted on
//! arrival on the real llama-server; stalls free the slot within their timeout.

use std::time::{Duration, Instant};

use guard_testkit::{Mode, Script, Upstream, trickle, until};
use guard_tests::{
    body::{STORY, With as _, chat, completion},
    http::{self, Leave, leave, post, post_streamed, raw_request},
    metric,
    scripted::{post_script, stalled_reader},
    serial,
    servers::{GuardProcess, Launch, LlamaServer},
};
use tokio::{io::AsyncWriteExt as _, task::JoinSet};

fn class(name: &str) -> [(&str, &str); 1] {
    [("x-guard-class", name)]
}

/// A small deterministic generator (the mix must be the same on every run).
struct Seeded(u64);

impl Seeded {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (self.0 >> 33) % n
    }
}

/// One client of the random mix, sent in the background.
fn mix_client(clients: &mut JoinSet<()>, addr: std::net::SocketAddr, rng: &mut Seeded, id: u64) {
    let name = if rng.below(3) == 0 {
        "interactive"
    } else {
        "batch"
    };
    let gap = 10 + rng.below(60);
    let linger = Duration::from_millis(rng.below(120));
    let ms = Duration::from_millis;
    let script = match rng.below(9) {
        0 | 1 => Script::new(Mode::Complete).head_after(ms(gap)),
        2 | 3 => Script::new(Mode::Stream).frames(2 + rng.below(5), ms(10)),
        4 => Script::new(Mode::Fail500),
        5 => Script::new(Mode::Reset).frames(2, ms(10)),
        6 => Script::new(Mode::Hang).frames(2, ms(10)),
        7 => {
            // Leaves wherever it is: queued, running or done.
            let script = Script::new(Mode::Stream).frames(30, ms(15)).id(id);
            clients.spawn(async move {
                let stream =
                    raw_request(addr, "/v1/chat/completions", &class(name), &script.json()).await;
                tokio::time::sleep(linger).await;
                leave(stream, Leave::Fin);
            });
            return;
        }
        _ => {
            // Reads two frames of a long stream, then leaves mid-stream.
            let script = Script::new(Mode::Stream).frames(40, ms(15)).id(id);
            clients.spawn(async move {
                let _ = http::post_frames(
                    addr,
                    "/v1/chat/completions",
                    &class(name),
                    &script.json(),
                    2,
                )
                .await;
            });
            return;
        }
    };
    let script = script.id(id);
    clients.spawn(async move {
        let _ = http::send(
            addr,
            "POST",
            "/v1/chat/completions",
            &class(name),
            script.json().to_string().into(),
        )
        .await;
    });
}

/// Accepted = every outcome + in flight + queued, per class; and `sent` requests in all.
fn assert_one_outcome_each(text: &str, sent: f64) {
    let m = |series: String| metric(text, &series).unwrap_or(0.0);
    let mut total = 0.0;
    for class in ["interactive", "batch"] {
        let outcome = |o: &str| {
            m(format!(
                "guard_requests_total{{class=\"{class}\",outcome=\"{o}\"}}"
            ))
        };
        let outcomes: f64 = ["completed", "rejected", "reaped", "failed", "timed_out"]
            .iter()
            .map(|o| outcome(o))
            .sum();
        total += outcomes;
        let accounted = outcome("completed")
            + outcome("reaped")
            + outcome("failed")
            + outcome("timed_out")
            + m(format!(
                "guard_rejected_after_queueing_total{{class=\"{class}\",reason=\"deadline_expired\"}}"
            ))
            + m(format!(
                "guard_rejected_after_queueing_total{{class=\"{class}\",reason=\"shutting_down\"}}"
            ))
            + m(format!("guard_inflight{{class=\"{class}\"}}"))
            + m(format!("guard_queue_depth{{class=\"{class}\"}}"));
        let admitted = m(format!("guard_admitted_total{{class=\"{class}\"}}"));
        assert_eq!(admitted, accounted, "{class}\n{text}");
    }
    assert_eq!(total, sent, "every request ended exactly once\n{text}");
}

/// The risk detector holds batch back while interactive waits; here that would only slow the
/// mix, so its hold is short.
const MIX_CONFIG: &str = "[upstream]\nmax_concurrency = 3\n[estimate]\ninitial_service_ms = 50\n\
    [risk]\nhold_ms = 50\n\
    [class.interactive]\npriority = 0\nmax_queue = 20\ndeadline_ms = 400\nupstream_idle_ms = 200\n\
    [class.batch]\npriority = 10\nmax_queue = 300\nupstream_idle_ms = 200\nclient_stall_ms = 200\n";

#[tokio::test(flavor = "multi_thread")]
async fn the_concurrency_bound_is_exact_under_a_random_mix_and_a_lowered_limit() {
    const EACH_PHASE: u64 = 90;
    let _serial = serial().await;
    let upstream = Upstream::start().await;
    let launch = Launch {
        cpu: Some(0),
        ..Launch::default()
    };
    let mut guard = GuardProcess::launch(upstream.addr(), "openai", MIX_CONFIG, &launch);
    let mut rng = Seeded(0x1d_5eed);
    let mut clients = JoinSet::new();
    for id in 0..EACH_PHASE {
        mix_client(&mut clients, guard.listen, &mut rng, id);
        // Arrivals spread over about a second: the workload's shape, not a wait.
        tokio::time::sleep(Duration::from_millis(rng.below(20))).await;
    }
    until("three exchanges at once", async || upstream.peak() >= 3).await;
    assert_eq!(upstream.peak(), 3, "the limit is reached, never passed");

    guard.edit_config_and_reload("max_concurrency = 3", "max_concurrency = 2");
    guard.wait_for_log("config reloaded");
    // Running requests finish; from then on the lower limit holds. guard's own count too: a
    // request dispatched just before the reload may not have reached the upstream yet.
    until("two or fewer in flight", async || {
        let text = guard.metrics_text().await;
        let inflight: f64 = ["interactive", "batch"]
            .iter()
            .filter_map(|c| metric(&text, &format!("guard_inflight{{class=\"{c}\"}}")))
            .sum();
        inflight <= 2.0 && upstream.open() <= 2
    })
    .await;
    upstream.reset_peak();
    for id in EACH_PHASE..2 * EACH_PHASE {
        mix_client(&mut clients, guard.listen, &mut rng, id);
        tokio::time::sleep(Duration::from_millis(rng.below(20))).await;
    }
    until("two exchanges at once", async || upstream.peak() >= 2).await;
    while clients.join_next().await.is_some() {}
    until("nothing in flight or queued", async || {
        let text = guard.metrics_text().await;
        ["interactive", "batch"].iter().all(|c| {
            metric(&text, &format!("guard_inflight{{class=\"{c}\"}}")) == Some(0.0)
                && metric(&text, &format!("guard_queue_depth{{class=\"{c}\"}}")) == Some(0.0)
        })
    })
    .await;
    assert_eq!(upstream.peak(), 2, "never more than the lowered limit");
    let mut ids: Vec<u64> = upstream.exchanges().iter().map(|e| e.id).collect();
    let reached = ids.len();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), reached, "no request reached the upstream twice");
    let text = guard.metrics_text().await;
    assert_one_outcome_each(&text, (2 * EACH_PHASE) as f64);
    for class in ["interactive", "batch"] {
        let series =
            format!("guard_failed_total{{class=\"{class}\",kind=\"upstream_unreachable\"}}");
        assert_eq!(
            metric(&text, &series).unwrap_or(0.0),
            0.0,
            "a kept-alive connection failed a request: {series}"
        );
    }
}

/// One llama-server slot; interactive has a 1.5 s deadline.
const LLAMA_CONFIG: &str = "[class.interactive]\npriority = 0\nmax_queue = 4\ndeadline_ms = 1500\n\
                            [class.batch]\npriority = 10\nmax_queue = 8\n";

/// A story of exactly `tokens` tokens, whole or streamed.
fn story(tokens: u64, stream: bool) -> serde_json::Value {
    completion(STORY, tokens).with("stream", stream)
}

/// A chat that asks for `tokens` tokens at most.
fn hello(tokens: u64) -> serde_json::Value {
    chat("Say hello.").with("max_tokens", tokens)
}

#[tokio::test(flavor = "multi_thread")]
async fn on_llama_server_an_impossible_deadline_is_refused_on_arrival_and_a_possible_one_met() {
    let _serial = serial().await;
    let llama = LlamaServer::start(1).await;
    let guard = GuardProcess::start(llama.addr, "openai", LLAMA_CONFIG);
    // Teach the estimator what a token costs here.
    for tokens in [16, 64, 32] {
        let response = post(
            guard.listen,
            "/completion",
            &class("batch"),
            &story(tokens, false),
        )
        .await;
        assert_eq!(response.status, 200);
    }
    // A backlog: a 400-token stream (seconds on this machine) holds the only slot.
    let addr = guard.listen;
    let long = tokio::spawn(async move {
        post_streamed(addr, "/completion", &class("batch"), &story(400, true)).await
    });
    guard
        .wait_for_metric("guard_inflight{class=\"batch\"}", 1.0)
        .await;
    let sent = Instant::now();
    let refused = post(guard.listen, "/v1/chat/completions", &[], &hello(8)).await;
    let answered = sent.elapsed();
    assert_eq!(refused.status, 503, "{}", refused.text());
    assert_eq!(refused.json()["error"]["code"], "deadline_predicted");
    assert!(refused.header("retry-after").is_some());
    assert!(
        answered < Duration::from_millis(50),
        "answered {answered:?} after arrival"
    );
    assert_eq!(long.await.expect("long").status, 200);

    // A short backlog: the deadline can be met, so the request is admitted and meets it.
    let short =
        tokio::spawn(
            async move { post(addr, "/completion", &class("batch"), &story(24, false)).await },
        );
    guard
        .wait_for_metric("guard_inflight{class=\"batch\"}", 1.0)
        .await;
    let sent = Instant::now();
    let streamed = post_streamed(
        guard.listen,
        "/v1/chat/completions",
        &[],
        &hello(8).with("stream", true),
    )
    .await;
    assert_eq!(streamed.status, 200);
    let ttft = streamed
        .frames
        .first()
        .map(|(at, _)| *at - sent)
        .expect("a frame");
    assert!(
        ttft < Duration::from_millis(1_500),
        "TTFT {ttft:?} missed the deadline"
    );
    assert_eq!(short.await.expect("short").status, 200);
    let text = guard.metrics_text().await;
    assert_eq!(
        metric(
            &text,
            "guard_rejected_total{class=\"interactive\",reason=\"deadline_predicted\"}"
        ),
        Some(1.0)
    );
    assert_eq!(
        metric(
            &text,
            "guard_start_prediction_error_seconds_count{class=\"interactive\"}"
        ),
        Some(1.0),
        "the admitted request's prediction was scored"
    );
}

const STALL_CONFIG: &str = "[class.interactive]\npriority = 0\nmax_queue = 4\n\
    body_read_timeout_ms = 1000\nupstream_idle_ms = 500\nclient_stall_ms = 500\n\
    [class.batch]\npriority = 10\nmax_queue = 4\n";

/// The next exchange's start, after the first.
fn second_start(upstream: &Upstream) -> tokio::time::Instant {
    upstream.exchanges()[1].started
}

#[tokio::test(flavor = "multi_thread")]
async fn an_upstream_that_stops_mid_stream_frees_the_slot_within_its_timeout() {
    let _serial = serial().await;
    let upstream = Upstream::start().await;
    let guard = GuardProcess::start(upstream.addr(), "openai", STALL_CONFIG);
    let addr = guard.listen;
    let stuck = tokio::spawn(async move {
        let script = Script::new(Mode::Hang).frames(3, Duration::from_millis(10));
        post_streamed(addr, "/v1/chat/completions", &[], &script.json()).await
    });
    until("the stuck exchange runs", async || upstream.open() == 1).await;
    let next = post_script(guard.listen, &Script::new(Mode::Complete)).await;
    assert_eq!(next.status, 200, "the next request is served");
    let stuck = stuck.await.expect("stuck");
    let text = stuck.text();
    assert!(
        text.contains("upstream_idle"),
        "the API's error event ends it: {text}"
    );
    let exchanges = upstream.exchanges();
    let stalled_at = exchanges[0].last_write.expect("frames");
    let freed = second_start(&upstream) - stalled_at;
    assert!(
        freed >= Duration::from_millis(500) && freed <= Duration::from_millis(600),
        "the next request started {freed:?} after the upstream stopped (limit 500 ms)"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_that_stops_reading_frees_the_slot_within_its_timeout() {
    let _serial = serial().await;
    let upstream = Upstream::start().await;
    let guard = GuardProcess::start(upstream.addr(), "openai", STALL_CONFIG);
    // A small receive buffer, and never a read: the upstream floods until guard stops.
    let _reader = stalled_reader(guard.listen).await;
    until("the flood runs", async || upstream.open() == 1).await;
    let next = post_script(guard.listen, &Script::new(Mode::Complete)).await;
    assert_eq!(next.status, 200, "the next request is served");
    let exchanges = upstream.exchanges();
    let last_write = exchanges[0].last_write.expect("flooded");
    let freed = second_start(&upstream) - last_write;
    assert!(
        freed <= Duration::from_millis(600),
        "the next request started {freed:?} after the flood last moved (limit 500 ms)"
    );
    assert!(
        second_start(&upstream) - exchanges[0].started >= Duration::from_millis(500),
        "not before the stall limit"
    );
    assert_eq!(
        guard
            .metric("guard_timed_out_total{class=\"interactive\",which=\"client_stall\"}")
            .await,
        1.0
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_body_sent_one_byte_a_second_is_cut_off_within_its_timeout() {
    use tokio::io::AsyncReadExt as _;
    let _serial = serial().await;
    let upstream = Upstream::start().await;
    let guard = GuardProcess::start(upstream.addr(), "openai", STALL_CONFIG);
    let stream = tokio::net::TcpStream::connect(guard.listen)
        .await
        .expect("connect");
    let (mut reader, mut writer) = stream.into_split();
    writer
        .write_all(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: guard\r\ncontent-length: 100\r\n\r\n",
        )
        .await
        .expect("head");
    let sent = Instant::now();
    // The client under test: one byte a second (its behaviour, not a wait).
    let trickle = trickle(writer, vec![b' '; 100], Duration::from_secs(1));
    let mut answer = vec![0u8; 512];
    let read = reader.read(&mut answer).await.expect("an answer");
    let after = sent.elapsed();
    trickle.abort();
    let answer = String::from_utf8_lossy(&answer[..read]);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(
        after >= Duration::from_millis(900) && after <= Duration::from_millis(1_100),
        "cut off after {after:?} (limit 1000 ms)"
    );
    let next = post_script(guard.listen, &Script::new(Mode::Complete)).await;
    assert_eq!(next.status, 200, "the next request is served");
    assert_eq!(
        upstream.started(),
        1,
        "the trickled body never reached the upstream"
    );
    assert_eq!(
        guard
            .metric("guard_invalid_requests_total{reason=\"body_read_timeout\"}")
            .await,
        1.0
    );
}
