//! The queued path end to end in one process: clients and an upstream on in-memory pipes,
//! tokio's paused clock. Every timeout is exact, and no test waits on the machine.

mod harness;

use std::time::Duration;

use guard_testkit::{Mode, Script};
use harness::{GAP, Harness, frames};
use tokio::time::Instant;

use crate::{
    access::Record,
    config::{Api, ClassConfig, Config, Preemptible},
};

const MS: Duration = Duration::from_millis(1);

/// Two classes, one upstream slot, and the timeouts the tests use.
fn config(slots: u32) -> Config {
    let mut config = Config::default();
    config.upstream.max_concurrency = slots;
    config.estimate.initial_service_ms = 100;
    let mut interactive = ClassConfig::new(0, 8, None);
    interactive.upstream_idle_ms = 1_000;
    interactive.client_stall_ms = 2_000;
    interactive.body_read_timeout_ms = 500;
    let mut batch = ClassConfig::new(10, 100, None);
    batch.upstream_idle_ms = 1_000;
    batch.client_stall_ms = 2_000;
    config.class = [
        ("interactive".to_owned(), interactive),
        ("batch".to_owned(), batch),
    ]
    .into();
    config
}

/// `config(slots)` with one class changed.
fn with_class(slots: u32, name: &str, change: impl FnOnce(&mut ClassConfig)) -> Config {
    let mut config = config(slots);
    change(config.class.get_mut(name).expect("a class of config()"));
    config
}

#[tokio::test(start_paused = true)]
async fn a_stream_completes_and_its_slot_returns() {
    let guard = Harness::new(config(1));
    let response = guard.send("interactive", frames(5)).await;
    assert_eq!(response.status, 200);
    assert_eq!(response.frames.len(), 5, "{:?}", response.frames);
    assert!(response.clean_end);
    assert_eq!(response.header("x-guard-class"), Some("interactive"));
    guard.settle().await;
    assert_eq!(guard.outcomes("interactive"), [("completed", 1)]);
    assert_eq!(guard.scheduler.load(), (0, 0), "the permit is back");
    assert_eq!(guard.upstream.open(), 0, "the exchange is closed");
    guard.assert_invariant();
}

#[tokio::test(start_paused = true)]
async fn an_idle_upstream_frees_the_slot_at_its_timeout() {
    let guard = Harness::new(config(1));
    let stuck = guard.spawn("interactive", Script::new(Mode::Hang).frames(2, GAP));
    guard.until(|| guard.upstream.started() == 1).await;
    let next = guard.spawn("interactive", frames(1));
    let stuck = stuck.await.expect("stuck");
    // Two frames, then the API's error event and a clean end.
    assert_eq!(stuck.frames.len(), 3, "{:?}", stuck.frames);
    assert!(
        stuck.frames[2].contains("upstream_idle"),
        "{:?}",
        stuck.frames
    );
    assert!(stuck.clean_end);
    assert_eq!(next.await.expect("next").status, 200);
    let exchanges = guard.upstream.exchanges();
    let last_frame = exchanges[0].started + GAP * 2;
    assert_eq!(
        exchanges[1].started - last_frame,
        Duration::from_secs(1),
        "exactly upstream_idle_ms"
    );
    assert_eq!(
        guard.count("timed_out_total", &["interactive", "upstream_idle"]),
        1
    );
    guard.settle().await;
    guard.assert_invariant();
}

#[tokio::test(start_paused = true)]
async fn a_client_that_stops_reading_frees_the_slot_at_its_timeout() {
    let guard = Harness::new(config(1));
    // 64 KiB frames into a 4 KiB pipe the client never reads.
    let stalled = guard
        .open_stalled(
            "interactive",
            Script::new(Mode::Frames)
                .frames(1_000, Duration::ZERO)
                .sized(64 << 10),
        )
        .await;
    guard.until(|| guard.upstream.started() == 1).await;
    let began = Instant::now();
    let next = guard.send("interactive", frames(1)).await;
    assert_eq!(next.status, 200);
    let freed = guard.upstream.exchanges()[1].started - began;
    // The pipe fills at once (no time passes in memory); then the stall limit runs.
    assert_eq!(freed, Duration::from_secs(2), "exactly client_stall_ms");
    assert_eq!(
        guard.count("timed_out_total", &["interactive", "client_stall"]),
        1
    );
    guard.until(|| guard.proxy.connections.is_empty()).await;
    drop(stalled);
    guard.settle().await;
    guard.assert_invariant();
}

#[tokio::test(start_paused = true)]
async fn a_trickled_body_is_cut_off_at_its_timeout() {
    let guard = Harness::new(config(1));
    let began = Instant::now();
    let response = guard
        .trickle("interactive", 10, Duration::from_secs(1))
        .await;
    assert_eq!(response.status, 408, "{response:?}");
    assert_eq!(began.elapsed(), Duration::from_millis(500));
    assert_eq!(
        guard.count("invalid_requests_total", &["body_read_timeout"]),
        1
    );
    assert_eq!(guard.upstream.started(), 0, "nothing was forwarded");
    // The slot was never taken: the next request is served.
    assert_eq!(guard.send("interactive", frames(1)).await.status, 200);
}

#[tokio::test(start_paused = true)]
async fn max_duration_ends_a_request_waiting_or_running() {
    let guard = Harness::new(with_class(1, "batch", |class| {
        class.max_duration_ms = Some(3_000);
    }));
    let running = guard.spawn("batch", Script::new(Mode::Frames).frames(100, 100 * MS));
    guard.until(|| guard.upstream.started() == 1).await;
    let waiting = guard.send("batch", frames(1)).await;
    assert_eq!(waiting.status, 504, "{waiting:?}");
    assert!(waiting.body().contains("max_duration"), "{waiting:?}");
    let running = running.await.expect("running");
    assert!(
        running
            .frames
            .last()
            .is_some_and(|f| f.contains("max_duration"))
    );
    assert_eq!(
        guard.count("timed_out_total", &["batch", "max_duration"]),
        2
    );
    guard.settle().await;
    assert_eq!(guard.upstream.open(), 0);
    guard.assert_invariant();
}

/// A preemptible class whose client reads nothing, with a stall limit far away.
fn stalled_preemptible(change: impl FnOnce(&mut ClassConfig)) -> Config {
    let mut config = with_class(1, "batch", |class| {
        class.preemptible = Preemptible::Yes;
        class.client_stall_ms = 60_000;
        change(class);
    });
    // Ollama's API: a preemptible chat goes on from its text (no exact resume to prepare).
    config.upstream.api = Api::Ollama;
    config
}

#[tokio::test(start_paused = true)]
async fn a_preemptible_stream_whose_client_stops_reading_is_still_preempted_at_once() {
    let guard = Harness::new(stalled_preemptible(|_| {}));
    let flood = Script::new(Mode::Flood).sized(1_024);
    let stalled = guard.open_stalled_chat("batch", flood).await;
    guard.until(|| guard.upstream.started() == 1).await;
    // Its pipe fills at once (no time passes in memory): by the time the paused clock moves
    // on, every task has run until it waits, and guard holds a frame it cannot hand over.
    tokio::time::sleep(100 * MS).await;
    let arrived = Instant::now();
    let chat = guard.spawn("interactive", frames(2));
    guard.until(|| guard.upstream.started() == 2).await;
    assert!(
        arrived.elapsed() < 10 * MS,
        "the chat reached the upstream {:?} after it came, not at once",
        arrived.elapsed()
    );
    assert_eq!(chat.await.expect("chat").status, 200);
    assert_eq!(
        guard.count("timed_out_total", &["batch", "client_stall"]),
        0
    );
    guard.leave(&stalled);
    guard.settle().await;
    assert_eq!(guard.outcomes("batch"), [("reaped", 1)]);
    guard.assert_invariant();
}

#[tokio::test(start_paused = true)]
async fn a_preemptible_stream_whose_client_stops_reading_ends_at_max_duration() {
    let guard = Harness::new(stalled_preemptible(|class| {
        class.max_duration_ms = Some(5_000);
    }));
    let arrived = Instant::now();
    let flood = Script::new(Mode::Flood).sized(1_024);
    let _stalled = guard.open_stalled_chat("batch", flood).await;
    let timed_out = || guard.count("timed_out_total", &["batch", "max_duration"]) == 1;
    guard.until(timed_out).await;
    assert_eq!(arrived.elapsed(), 5_000 * MS, "exactly max_duration_ms");
    guard.settle().await;
    assert_eq!(guard.upstream.open(), 0, "the exchange is closed");
    assert_eq!(guard.scheduler.load(), (0, 0), "the permit is back");
    guard.assert_invariant();
}

#[tokio::test(start_paused = true)]
async fn a_backlog_that_misses_the_deadline_is_refused_on_arrival() {
    let guard = Harness::new(with_class(1, "interactive", |class| {
        class.deadline_ms = Some(1_500);
    }));
    // Teach the estimator: 10 ms a token.
    for tokens in [10, 50, 20] {
        let script = Script::new(Mode::Frames)
            .frames(tokens, 10 * MS)
            .tokens(tokens);
        assert_eq!(guard.send("batch", script).await.status, 200);
    }
    let running = guard.spawn(
        "batch",
        Script::new(Mode::Frames).frames(300, 10 * MS).tokens(300),
    );
    guard.until(|| guard.upstream.started() == 4).await;
    let began = Instant::now();
    let refused = guard.send("interactive", frames(1).tokens(1)).await;
    assert_eq!(refused.status, 503, "{refused:?}");
    assert!(refused.body().contains("deadline_predicted"), "{refused:?}");
    assert!(refused.header("retry-after").is_some());
    assert_eq!(began.elapsed(), Duration::ZERO, "answered on arrival");
    running.await.expect("running");
    // Idle again: a short request meets the deadline.
    let served = guard.send("interactive", frames(1).tokens(1)).await;
    assert_eq!(served.status, 200);
    assert_eq!(
        guard.count("rejected_total", &["interactive", "deadline_predicted"]),
        1
    );
}

#[tokio::test(start_paused = true)]
async fn a_client_that_leaves_is_reaped_queued_or_running() {
    let guard = Harness::new(config(1));
    let running = guard
        .open_stalled("batch", Script::new(Mode::Frames).frames(1_000, 10 * MS))
        .await;
    guard.until(|| guard.upstream.started() == 1).await;
    let queued = guard.open_stalled("batch", frames(1)).await;
    guard
        .until(|| guard.count("queue_depth", &["batch"]) == 1)
        .await;
    guard.leave(&queued);
    guard
        .until(|| guard.count("reaped_total", &["batch", "queued"]) == 1)
        .await;
    guard.leave(&running);
    guard
        .until(|| guard.count("reaped_total", &["batch", "running"]) == 1)
        .await;
    // One that leaves while the upstream has not answered yet was running too.
    let slow = guard
        .open_stalled("batch", frames(1).head_after(Duration::from_secs(5)))
        .await;
    guard.until(|| guard.upstream.started() == 2).await;
    let left = Instant::now();
    guard.leave(&slow);
    guard
        .until(|| guard.count("reaped_total", &["batch", "running"]) == 2)
        .await;
    assert_eq!(
        left.elapsed(),
        Duration::ZERO,
        "reaped at once, not when it answered"
    );
    assert_eq!(
        guard.upstream.started(),
        2,
        "the queued one never reached it"
    );
    assert_eq!(guard.upstream.open(), 0, "the running exchange was closed");
    assert_eq!(guard.scheduler.load(), (0, 0));
    guard.assert_invariant();
}

#[tokio::test(start_paused = true)]
async fn upstream_failures_end_once_each() {
    let guard = Harness::new(config(1));
    let failed = guard.send("batch", Script::new(Mode::Fail500)).await;
    assert_eq!(failed.status, 500, "relayed as it was");
    let reset = guard
        .send("batch", Script::new(Mode::Reset).frames(2, GAP))
        .await;
    assert!(
        reset
            .frames
            .last()
            .is_some_and(|f| f.contains("upstream_reset"))
    );
    guard.settle().await;
    assert_eq!(guard.count("failed_total", &["batch", "upstream_error"]), 1);
    assert_eq!(guard.count("failed_total", &["batch", "upstream_reset"]), 1);
    assert_eq!(guard.outcomes("batch"), [("failed", 2)]);
    guard.assert_invariant();
}

#[tokio::test(start_paused = true)]
async fn the_bound_is_exact_under_a_mixed_run_and_a_lowered_limit() {
    let guard = Harness::new(config(3));
    let mut seed = 0x5eed_u64;
    let mut tasks = Vec::new();
    for round in 0..120_u64 {
        seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
        let pick = (seed >> 33) % 6;
        let script = match pick {
            0 => Script::new(Mode::Hang).frames(3, GAP),
            1 => Script::new(Mode::Reset).frames(2, GAP),
            2 => Script::new(Mode::Fail500),
            _ => frames(1 + round % 7),
        };
        let class = if round % 3 == 0 {
            "interactive"
        } else {
            "batch"
        };
        if pick == 5 {
            tasks.push(guard.leave_after(class, script, Duration::from_millis((seed >> 40) % 200)));
        } else {
            tasks.push(guard.spawn_any(class, script));
        }
        if round == 60 {
            assert_eq!(
                guard.upstream.peak(),
                3,
                "the limit was reached, not passed"
            );
            let mut lower = config(1);
            lower.estimate.initial_service_ms = 100;
            guard.proxy.reload(&lower);
            guard.until(|| guard.upstream.open() <= 1).await;
            guard.upstream.reset_peak();
        }
        tokio::time::sleep(7 * MS).await;
    }
    for task in tasks {
        task.await.expect("client");
    }
    guard.settle().await;
    assert_eq!(
        guard.upstream.peak(),
        1,
        "never more than the lowered limit"
    );
    let total: u64 = ["interactive", "batch"]
        .iter()
        .flat_map(|class| guard.outcomes(class))
        .map(|(_, count)| count)
        .sum();
    assert_eq!(total, 120, "every request ended exactly once");
    let seen: Vec<_> = guard
        .outcomes("batch")
        .into_iter()
        .map(|(o, _)| o)
        .collect();
    assert_eq!(
        seen,
        ["completed", "reaped", "failed", "timed_out"],
        "a real mix"
    );
    guard.assert_invariant();
}

#[tokio::test(start_paused = true)]
async fn only_a_connection_whose_answer_was_one_document_is_used_again() {
    let guard = Harness::new(config(1));
    for _ in 0..3 {
        let answer = guard.send("batch", Script::new(Mode::Complete)).await;
        assert_eq!(answer.status, 200);
    }
    assert_eq!(
        guard.upstream.dials(),
        1,
        "one keep-alive connection served all three"
    );
    assert_eq!(guard.upstream.connections(), 1, "and is kept, idle");
    assert_eq!(guard.send("batch", frames(2)).await.status, 200);
    assert_eq!(
        guard.upstream.dials(),
        1,
        "the stream took the idle connection"
    );
    guard.until(|| guard.upstream.connections() == 0).await;
    assert_eq!(
        guard.upstream.connections(),
        0,
        "a stream's connection is not kept"
    );
    // An idle connection is used again only while young.
    assert_eq!(
        guard
            .send("batch", Script::new(Mode::Complete))
            .await
            .status,
        200
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        guard
            .send("batch", Script::new(Mode::Complete))
            .await
            .status,
        200
    );
    assert_eq!(guard.upstream.dials(), 3);
}

/// A fresh path for a test's access log.
fn access_log_path(test: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("guard-access-{}-{test}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a temp dir");
    dir.join("access.log")
}

/// The log's lines once there are `count` of them (the writer is a thread of its own).
async fn access_lines(
    guard: &Harness,
    path: &std::path::Path,
    count: usize,
) -> Vec<Record<'static>> {
    let read = || std::fs::read_to_string(path).unwrap_or_default();
    guard.until(|| read().lines().count() >= count).await;
    read()
        .lines()
        .map(|line| serde_json::from_str(line).expect("a line is one JSON record"))
        .collect()
}

#[tokio::test(start_paused = true)]
async fn every_request_is_one_access_log_line_with_its_outcome() {
    let path = access_log_path("outcomes");
    let mut config = config(1);
    config.log.access = Some(path.display().to_string());
    let guard = Harness::new(config);
    let completed = guard.send("interactive", frames(3)).await;
    let stuck = guard
        .send("interactive", Script::new(Mode::Hang).frames(1, GAP))
        .await;
    let unknown = guard.send("nope", frames(1)).await;
    let stalled = guard.open_stalled("batch", frames(1_000)).await;
    guard.until(|| guard.upstream.started() == 3).await;
    guard.leave(&stalled);
    guard.settle().await;
    let lines = access_lines(&guard, &path, 4).await;
    assert_eq!(lines.len(), 4, "one line a request: {lines:#?}");
    let line = |answer: &harness::Answer| {
        let id = answer.header("x-guard-request-id").expect("the id is sent");
        let mut with_id = lines.iter().filter(|l| l.id.to_string() == id);
        let line = with_id.next().expect("its line");
        assert!(with_id.next().is_none(), "once");
        line.clone()
    };
    let done = line(&completed);
    assert_eq!(
        (&*done.outcome, done.status, done.class.as_deref()),
        ("completed", 200, Some("interactive"))
    );
    assert_eq!(
        done.bytes_out,
        completed.body().len() as u64,
        "every byte sent"
    );
    // The header names the default class: the default decided it.
    assert_eq!(done.decided_by.as_deref(), Some("default"));
    assert_eq!(done.slot_ms, Some(60.0), "three frames, 20 ms before each");
    assert_eq!(done.path, "/v1/chat/completions");
    let idle = line(&stuck);
    assert_eq!(
        (
            &*idle.outcome,
            idle.reason.as_deref(),
            idle.stage.as_deref()
        ),
        ("timed_out", Some("upstream_idle"), Some("running"))
    );
    let refused = line(&unknown);
    assert_eq!(
        (&*refused.outcome, refused.reason.as_deref(), refused.status),
        ("invalid", Some("unknown_class"), 400)
    );
    let reaped = lines
        .iter()
        .find(|l| l.outcome == "reaped")
        .expect("the reaped one");
    assert_eq!(reaped.stage.as_deref(), Some("running"));
    guard.assert_invariant();
}
