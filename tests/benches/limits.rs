//! `cargo xtask bench limits`: how well guard predicts when a request will start on the real
//! llama-server, and how soon after a stall (an upstream that stops, a client that stops
//! reading) the next request starts, against the goal of the timeout plus 100 ms.

use std::time::Duration;

use guard_testkit::{Mode, Polling, Script, Upstream, until_with};
use guard_tests::{
    body::{With as _, chat, completion},
    http::{post, post_streamed, raw_request},
    metric, rss_bytes,
    scripted::{post_script, stalled_reader},
    servers::{GuardProcess, LlamaServer},
    workload::percentile,
};
use tokio::task::JoinSet;

const ROUNDS: usize = 4;
const PER_ROUND: usize = 8;
const TRIALS: usize = 20;
const STALL_MS: u64 = 300;

#[tokio::main]
async fn main() {
    waiting_bodies().await;
    prediction_error().await;
    println!(
        "2. stall -> next request starts at the upstream, {TRIALS} trials each, limit {STALL_MS} ms:"
    );
    for (name, client_stall) in [
        ("upstream stops mid-stream", false),
        ("client stops reading", true),
    ] {
        let overshoot = stall_overshoot(client_stall).await;
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let p99 = percentile(&overshoot, 0.99);
        println!(
            "   {name:<27} beyond the limit: p50 {:>6.1} ms, p99 {:>6.1} ms, max {:>6.1} ms; goal p99 <= 100 ms: {}",
            ms(percentile(&overshoot, 0.5)),
            ms(p99),
            ms(percentile(&overshoot, 1.0)),
            if p99 <= Duration::from_millis(100) {
                "met"
            } else {
                "missed"
            }
        );
    }
}

/// 1,000 requests of 1 MiB each wait behind a busy slot: guard's memory against the bytes it
/// holds, and after the clients leave, against idle.
async fn waiting_bodies() {
    const CLIENTS: usize = 1_000;
    const MIB: usize = 1 << 20;
    let upstream = Upstream::start().await;
    let config = "[server]\nbody_limit_bytes = 2097152\nmax_body_bytes_in_flight = 2147483648\n\
                  [class.interactive]\nmax_queue = 2000\n";
    let guard = GuardProcess::start(upstream.addr(), "openai", config);
    // Idle after a first request: what any serving guard has touched.
    let mut body = Script::new(Mode::Complete).json();
    body["pad"] = serde_json::Value::String(" ".repeat(MIB - 64));
    assert_eq!(
        post(guard.listen, "/v1/chat/completions", &[], &body)
            .await
            .status,
        200
    );
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let idle = rss_bytes(guard.pid());
    let _busy = raw_request(
        guard.listen,
        "/v1/chat/completions",
        &[],
        &Script::new(Mode::Hang).frames(1, Duration::ZERO).json(),
    )
    .await;
    let mut clients = Vec::with_capacity(CLIENTS);
    for _ in 0..CLIENTS {
        clients.push(raw_request(guard.listen, "/v1/chat/completions", &[], &body).await);
    }
    let held = loop {
        let text = guard.metrics_text().await;
        let depth = metric(&text, "guard_queue_depth{class=\"interactive\"}").unwrap_or(0.0);
        if depth as usize >= CLIENTS {
            break metric(&text, "guard_body_bytes_in_flight").unwrap_or(0.0);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let loaded = rss_bytes(guard.pid());
    drop(clients);
    loop {
        let text = guard.metrics_text().await;
        if metric(&text, "guard_body_bytes_in_flight") == Some(0.0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The watchers hand freed memory back once a tick (a second).
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let after = rss_bytes(guard.pid());
    let mib = |b: f64| b / MIB as f64;
    let grown = loaded.saturating_sub(idle) as f64;
    println!("0. memory for {CLIENTS} requests of 1 MiB waiting behind a busy slot:");
    println!(
        "   idle {:.0} MiB; waiting {:.0} MiB for {:.0} MiB of bodies held: {:.2}x the bytes held (goal <= 1.1x); after they left {:.0} MiB: {:+.1} % of idle (goal within 10 %)",
        mib(idle as f64),
        mib(loaded as f64),
        mib(held),
        grown / held,
        mib(after as f64),
        (after as f64 - idle as f64) / idle as f64 * 100.0
    );
}

/// Rounds of mixed work on one llama-server slot; guard's debug log says, for each dispatched
/// request, when it predicted on arrival that the request would start and when it did.
async fn prediction_error() {
    let llama = LlamaServer::start(1).await;
    let config = "[class.interactive]\npriority = 0\nmax_queue = 8\n[class.batch]\npriority = 10\nmax_queue = 64\n";
    let guard = GuardProcess::start_with(llama.addr, "openai", config, false, "guard=debug");
    let addr = guard.listen;
    let mut work = JoinSet::new();
    for round in 0..ROUNDS {
        for (i, tokens) in [16u64, 96, 32, 160, 48, 64].into_iter().enumerate() {
            let stream = (round + i) % 2 == 0;
            work.spawn(async move {
                let body =
                    completion(&format!("Story {round}.{i}."), tokens).with("stream", stream);
                let _ =
                    post_streamed(addr, "/completion", &[("x-guard-class", "batch")], &body).await;
            });
        }
        for i in 0..2 {
            work.spawn(async move {
                let body = chat(&format!("Hi {round}.{i}")).with("max_tokens", 12);
                let _ = post(addr, "/v1/chat/completions", &[], &body).await;
            });
        }
        while work.join_next().await.is_some() {}
    }
    let lines = guard.log_lines();
    let dispatched: Vec<Dispatch> = lines.iter().filter_map(|l| Dispatch::parse(l)).collect();
    if std::env::var_os("GUARD_BENCH_DETAIL").is_some() {
        for d in &dispatched {
            println!("   {d:?}");
        }
    }
    // Rounds run one after another: each one's requests are dispatched before the next's.
    let (first, learned) = dispatched.split_at(dispatched.len().min(PER_ROUND));
    let interactive: Vec<Dispatch> = learned.iter().filter(|d| d.interactive).cloned().collect();
    println!(
        "1. start prediction on llama-server (one slot; {ROUNDS} rounds of 6 batch completions, 12 to 160 tokens, and 2 interactive chats, sent at once):"
    );
    for (name, set) in [
        ("round 1, before any completion (the prior)", first),
        ("rounds 2+, learned", learned),
        ("rounds 2+, interactive only", &interactive[..]),
    ] {
        let errors: Vec<Duration> = set.iter().map(Dispatch::error).collect();
        let later = set.iter().filter(|d| d.waited > d.predicted).count();
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        println!(
            "   {name:<44} {:>2} requests: |actual - predicted| p50 {:>5.0} ms, p95 {:>5.0} ms; later than predicted: {later}",
            set.len(),
            ms(percentile(&errors, 0.5)),
            ms(percentile(&errors, 0.95)),
        );
    }
}

/// A `dispatched` line of guard's debug log.
#[derive(Clone, Debug)]
struct Dispatch {
    interactive: bool,
    predicted: f64,
    waited: f64,
}

impl Dispatch {
    fn parse(line: &str) -> Option<Self> {
        if !line.contains(" dispatched") {
            return None;
        }
        let field = |name: &str| -> Option<f64> {
            line.split(&format!("{name}="))
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        };
        Some(Self {
            interactive: line.contains("class=\"interactive\""),
            predicted: field("predicted_ms")?,
            waited: field("waited_ms")?,
        })
    }

    fn error(&self) -> Duration {
        Duration::from_secs_f64((self.waited - self.predicted).abs() / 1e3)
    }
}

/// Time from a stall's start to the next request's start at the upstream, minus the limit.
async fn stall_overshoot(client_stall: bool) -> Vec<Duration> {
    let upstream = Upstream::start().await;
    let config = format!(
        "[class.interactive]\npriority = 0\nmax_queue = 4\nupstream_idle_ms = {STALL_MS}\nclient_stall_ms = {STALL_MS}\n[class.batch]\npriority = 10\n"
    );
    let guard = GuardProcess::start(upstream.addr(), "openai", &config);
    let mut samples = Vec::with_capacity(TRIALS);
    for trial in 0..TRIALS {
        let before = upstream.started();
        let _stalled = if client_stall {
            Some(stalled_reader(guard.listen).await)
        } else {
            let addr = guard.listen;
            tokio::spawn(async move {
                let script = Script::new(Mode::Hang).frames(2, Duration::from_millis(5));
                post_streamed(addr, "/v1/chat/completions", &[], &script.json()).await
            });
            None
        };
        let polling = Polling::within(Duration::from_secs(10), Duration::from_millis(1));
        until_with(
            polling,
            &format!("trial {trial}: the stall starts"),
            async || upstream.started() != before,
        )
        .await;
        let next = post_script(guard.listen, &Script::new(Mode::Complete)).await;
        assert_eq!(next.status, 200);
        let exchanges = upstream.exchanges();
        let (stalled, next) = (&exchanges[before], &exchanges[before + 1]);
        let onset = stalled.last_write.unwrap_or(stalled.started);
        let freed = next.started.saturating_duration_since(onset);
        samples.push(freed.saturating_sub(Duration::from_millis(STALL_MS)));
    }
    samples
}
