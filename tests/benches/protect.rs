//! `cargo xtask bench protect`: a CPU-hungry batch workload (a second llama-server doing
//! extraction, started in the batch class's cgroup by `guard exec`) competes with interactive
//! chats sent through guard to the interactive llama-server. One run each without protection
//! and with it (cgroup v2 freeze, then v1 CPU quota): interactive TTFT p95, and batch tokens
//! completed per hour, so the cost stands beside the gain.

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use guard_testkit::{Polling, until_with};
use guard_tests::{
    ChildGuard, TempDir, TestCgroup,
    body::{With as _, chat, completion},
    cgroup2_root, free_addr, guard_bin,
    http::{get, post, post_streamed},
    servers::{GuardProcess, LlamaServer},
    workload::percentile,
};

const CHATS: usize = 30;
const DEADLINE_MS: u64 = 150;

struct Scenario {
    name: &'static str,
    /// (cgroup parent, throttle mode); None runs without protection.
    throttle: Option<(PathBuf, &'static str)>,
}

fn main() {
    guard_tests::require_root();
    let runtime = guard_tests::bench_runtime();
    runtime.block_on(async {
        println!(
            "interactive chats through guard ({CHATS}, one at a time, deadline {DEADLINE_MS} ms) while a second llama-server extracts in the batch cgroup:"
        );
        println!("{:<34} {:>10} {:>10} {:>14} {:>9}", "", "TTFT p50", "TTFT p95", "batch tok/h", "at risk");
        for scenario in [
            Scenario { name: "no protection", throttle: None },
            Scenario { name: "guard: cgroup v2 freeze", throttle: Some((cgroup2_root(), "freeze")) },
            Scenario { name: "guard: cgroup v1 cpu:10", throttle: Some((PathBuf::from("/sys/fs/cgroup/cpu"), "cpu:10")) },
        ] {
            run(&scenario).await;
        }
    });
}

async fn run(scenario: &Scenario) {
    let state = TempDir::new("guard-bench-protect");
    let parent = scenario
        .throttle
        .as_ref()
        .map_or_else(cgroup2_root, |(p, _)| p.clone());
    let cgroup = TestCgroup::new(&parent, "guard-bench-batch");
    let throttle = scenario
        .throttle
        .as_ref()
        .map(|(_, mode)| {
            format!(
                "cgroup = \"{}\"\nthrottle = \"{mode}\"\n",
                cgroup.path.display()
            )
        })
        .unwrap_or_else(|| format!("cgroup = \"{}\"\n", cgroup.path.display()));
    let config = format!(
        "[risk]\nwait_fraction = 0.5\nttft_min_samples = 3\nhold_ms = 3000\nstate_dir = \"{}\"\n\
         [class.interactive]\npriority = 0\nmax_queue = 8\ndeadline_ms = {DEADLINE_MS}\n\
         [class.batch]\npriority = 10\nmax_queue = 100\n{throttle}",
        state.0.display()
    );
    let interactive = LlamaServer::start(1).await;
    let guard = GuardProcess::start(interactive.addr, "openai", &config);
    let (batch_addr, _batch_server) = batch_server(&guard.config_path, &cgroup.path).await;

    let stop = Arc::new(AtomicBool::new(false));
    let extractor = {
        let stop = Arc::clone(&stop);
        tokio::spawn(async move {
            let body = completion("Extract the names: ...", 64);
            while !stop.load(Ordering::Relaxed) {
                post(batch_addr, "/completion", &[], &body).await;
            }
        })
    };
    // One chat first, so both servers are warm before anything is timed.
    let warm = chat("Say hello.").with("max_tokens", 4);
    post(guard.listen, "/v1/chat/completions", &[], &warm).await;
    let tokens_before = batch_tokens(batch_addr).await;
    let started = Instant::now();
    let mut ttft = Vec::new();
    for _ in 0..CHATS {
        let body = chat("Say hello.")
            .with("max_tokens", 8)
            .with("stream", true);
        let sent = Instant::now();
        let streamed = post_streamed(guard.listen, "/v1/chat/completions", &[], &body).await;
        if let Some((at, _)) = streamed
            .frames
            .iter()
            .find(|(_, d)| String::from_utf8_lossy(d).contains("\"content\":\""))
        {
            ttft.push(at.duration_since(sent));
        }
        // Chats arrive about once a second, as a person types.
        tokio::time::sleep(Duration::from_millis(700)).await;
    }
    let elapsed = started.elapsed();
    // Held batch work must not count: let guard restore before reading the batch counter.
    stop.store(true, Ordering::Relaxed);
    let tokens = batch_tokens(batch_addr).await - tokens_before;
    extractor.abort();
    let episodes = guard
        .log_lines()
        .iter()
        .filter(|l| l.contains("at risk:"))
        .count();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!(
        "{:<34} {:>7.0} ms {:>7.0} ms {:>14.0} {:>9}",
        scenario.name,
        ms(percentile(&ttft, 0.5)),
        ms(percentile(&ttft, 0.95)),
        tokens * 3600.0 / elapsed.as_secs_f64(),
        episodes
    );
}

/// A second llama-server, started by `guard exec` inside the batch class's cgroup.
async fn batch_server(config: &Path, cgroup: &Path) -> (std::net::SocketAddr, ChildGuard) {
    let addr = free_addr();
    let server = std::env::var("GUARD_LLAMA_SERVER").expect("GUARD_LLAMA_SERVER");
    let model = std::env::var("GUARD_LLAMA_MODEL").expect("GUARD_LLAMA_MODEL");
    let child = Command::new(guard_bin())
        .args(["exec", "--config"])
        .arg(config)
        .args([
            "--class",
            "batch",
            "--",
            &server,
            "-m",
            &model,
            "--host",
            "127.0.0.1",
        ])
        .args(["--port", &addr.port().to_string(), "-np", "1", "--metrics"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("guard exec llama-server");
    let child = ChildGuard(child);
    let polling = Polling::within(Duration::from_secs(60), Duration::from_millis(50));
    until_with(polling, "the batch llama-server is ready", async || {
        get(addr, "/health").await.is_ok_and(|r| r.status == 200)
    })
    .await;
    let procs = std::fs::read_to_string(cgroup.join("cgroup.procs")).unwrap_or_default();
    assert!(
        procs.lines().any(|l| l == child.0.id().to_string()),
        "the batch server runs in the cgroup"
    );
    (addr, child)
}

async fn batch_tokens(addr: std::net::SocketAddr) -> f64 {
    let text = get(addr, "/metrics")
        .await
        .map(|r| r.text())
        .unwrap_or_default();
    guard_tests::metric(&text, "llamacpp:tokens_predicted_total").unwrap_or(0.0)
}
