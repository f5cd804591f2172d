//! The access log end to end: one line per request, queued, passed through or refused by hyper
//! itself, its tokens the server's own, nothing of the conversation or the token in it; a
//! rotation loses and repeats nothing; a full disk never stops serving.

use std::path::Path;

use guard::access::Record;
use guard_testkit::{Mode, Script, Upstream, until};
use guard_tests::{
    TempDir,
    body::{With as _, chat, completion},
    http::{self, post, post_streamed, raw_request},
    serial,
    servers::{GuardProcess, LlamaServer},
};

const TOKEN: &str = "s3cret-nightly-token";
const SEA: &str = "Tell me about the sea and its tides.";
const STORY: &str = "Write a long story about a lighthouse keeper and his ledgers.";

/// Two classes, a preemptible batch, a class that never queues, and a token's rule.
fn config(log: &Path) -> String {
    format!(
        "[log]\naccess = \"{}\"\n\
         [class.interactive]\npriority = 0\nmax_queue = 8\n\
         [class.batch]\npriority = 10\nmax_queue = 8\npreemptible = true\n\
         [class.full]\npriority = 5\nmax_queue = 0\n\
         [[classify.rule]]\nname = \"nightly\"\nclass = \"batch\"\nbearer = \"{TOKEN}\"\n",
        log.display()
    )
}

/// The log's records once it holds `count` lines.
async fn records(log: &Path, count: usize) -> Vec<Record<'static>> {
    let read = || std::fs::read_to_string(log).unwrap_or_default();
    until("the access log's lines", async || {
        read().lines().count() >= count
    })
    .await;
    read()
        .lines()
        .map(|line| serde_json::from_str(line).expect("each line is one record"))
        .collect()
}

/// What the mixed run sent, and what came back that the log must not hold.
struct Run {
    requests: usize,
    answers: Vec<String>,
    ids: Vec<String>,
}

/// A chat, a streamed completion, a batch job preempted by a chat, a 503, a request reaped
/// while it waited, and a pass-through request.
async fn mixed_run(guard: &GuardProcess) -> Run {
    let bearer = format!("Bearer {TOKEN}");
    let nightly = [("authorization", bearer.as_str())];
    let mut run = Run {
        requests: 0,
        answers: Vec::new(),
        ids: Vec::new(),
    };
    let chat_answer = post(guard.listen, "/v1/chat/completions", &[], &sea(12)).await;
    run.note(&chat_answer);
    let streamed = completion(SEA, 9).with("stream", true);
    let streamed = post_streamed(guard.listen, "/completion", &nightly, &streamed).await;
    assert_eq!(streamed.status, 200);
    run.requests += 1;
    let addr = guard.listen;
    let long = chat(STORY).with("max_tokens", 160);
    let header = nightly.map(|(name, value)| (name, value.to_owned()));
    let job = tokio::spawn(async move {
        let headers = [(header[0].0, header[0].1.as_str())];
        post(addr, "/v1/chat/completions", &headers, &long).await
    });
    guard
        .wait_for_metric("guard_inflight{class=\"batch\"}", 1.0)
        .await;
    // While the batch job holds the only slot: a class that never queues is refused, and a
    // batch request whose client leaves before its turn is reaped.
    let full = post(
        guard.listen,
        "/v1/chat/completions",
        &[("x-guard-class", "full")],
        &sea(4),
    )
    .await;
    assert_eq!(full.status, 503, "{}", full.text());
    run.requests += 1;
    let waiting = raw_request(guard.listen, "/v1/chat/completions", &nightly, &sea(4)).await;
    guard
        .wait_for_metric("guard_queue_depth{class=\"batch\"}", 1.0)
        .await;
    drop(waiting);
    guard
        .wait_for_metric("guard_reaped_total{class=\"batch\",stage=\"queued\"}", 1.0)
        .await;
    run.requests += 1;
    // A chat preempts the batch job, which goes on where it stopped.
    let urgent = post(guard.listen, "/v1/chat/completions", &[], &sea(6)).await;
    run.note(&urgent);
    let job = job.await.expect("the batch job");
    run.note(&job);
    let models = http::send(guard.listen, "GET", "/v1/models", &[], Default::default())
        .await
        .expect("passes through");
    assert_eq!(models.status, 200);
    run.requests += 1;
    run
}

fn sea(tokens: u64) -> serde_json::Value {
    chat(SEA).with("max_tokens", tokens)
}

impl Run {
    /// A whole chat answer: its text must not reach the log; its id must.
    fn note(&mut self, answer: &http::Response) {
        assert_eq!(answer.status, 200, "{}", answer.text());
        self.requests += 1;
        let text = answer.json()["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        if text.len() >= 12 {
            self.answers.push(text);
        }
        let id = answer
            .header("x-guard-request-id")
            .expect("the request's id");
        self.ids.push(id.to_owned());
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn every_request_is_one_line_with_the_servers_own_tokens_and_nothing_private() {
    let _serial = serial().await;
    let dir = TempDir::new("guard-access-mixed");
    let log = dir.0.join("access.log");
    let llama = LlamaServer::start(1).await;
    let guard = GuardProcess::start(llama.addr, "openai", &config(&log));
    let predicted = llama.metric("tokens_predicted_total").await;
    let run = mixed_run(&guard).await;
    let generated = llama.metric("tokens_predicted_total").await - predicted;
    let lines = records(&log, run.requests).await;
    assert_eq!(lines.len(), run.requests, "one line a request: {lines:#?}");
    let mut ids: Vec<String> = lines.iter().map(|l| l.id.to_string()).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), lines.len(), "each request once");
    for id in &run.ids {
        assert!(ids.contains(id), "the id sent is the line's: {id}");
    }
    let logged: u64 = lines.iter().filter_map(|l| l.tokens.generated).sum();
    let per_line: Vec<_> = lines
        .iter()
        .map(|l| (&l.outcome, &l.class, l.tokens, l.preemptions))
        .collect();
    assert_eq!(
        logged as f64, generated,
        "the log counts what llama-server generated: {per_line:?}"
    );
    assert_outcomes_as_metrics(&guard, &lines).await;
    let by_token: Vec<&Record<'_>> = lines
        .iter()
        .filter(|l| l.identity.token.is_some())
        .collect();
    // The streamed completion, the batch job and the request reaped while it waited.
    assert_eq!(by_token.len(), 3, "the token's rule names its requests");
    assert!(
        by_token
            .iter()
            .all(|l| l.identity.token.as_deref() == Some("nightly"))
    );
    let preempted = lines
        .iter()
        .find(|l| l.preemptions > 0)
        .expect("a preempted job");
    assert_eq!(preempted.outcome, "completed");
    let text = std::fs::read_to_string(&log).expect("the log");
    for secret in [TOKEN, SEA, STORY]
        .iter()
        .copied()
        .chain(run.answers.iter().map(String::as_str))
    {
        assert!(!text.contains(secret), "the log holds {secret:?}");
    }
}

/// Each queued line's class and outcome as `guard_requests_total` counted them; the
/// pass-through line as `guard_passthrough_requests_total` did.
async fn assert_outcomes_as_metrics(guard: &GuardProcess, lines: &[Record<'_>]) {
    let metrics = guard.metrics_text().await;
    for class in ["interactive", "batch", "full"] {
        for outcome in ["completed", "rejected", "reaped", "failed", "timed_out"] {
            let series = format!("guard_requests_total{{class=\"{class}\",outcome=\"{outcome}\"}}");
            let counted = guard_tests::metric(&metrics, &series).unwrap_or(0.0);
            let logged = lines
                .iter()
                .filter(|l| l.class.as_deref() == Some(class) && l.outcome == outcome)
                .count();
            assert_eq!(logged as f64, counted, "{series}");
        }
    }
    let passed = lines.iter().filter(|l| l.outcome == "passed").count();
    let counted = guard_tests::metric(&metrics, "guard_passthrough_requests_total{code=\"200\"}");
    assert_eq!(Some(passed as f64), counted);
}

/// Heads hyper refuses and answers itself (a method no token allows, bytes that are not a URI,
/// a head over the 32 KiB buffer, garbage after a good request on one connection): one line
/// each, with hyper's status, counted as `/metrics` counts them. An HTTP/2 preface, which hyper
/// closes without a word, is no request and has no line.
#[tokio::test(flavor = "multi_thread")]
async fn heads_hyper_refuses_are_one_line_each() {
    let _serial = serial().await;
    let dir = TempDir::new("guard-access-heads");
    let log = dir.0.join("access.log");
    let upstream = Upstream::start().await;
    let guard = GuardProcess::start(upstream.addr(), "ollama", &config(&log));
    let huge = format!(
        "GET /api/tags HTTP/1.1\r\nhost: x\r\nx-filler: {}\r\n\r\n",
        "y".repeat(40 << 10)
    );
    let sent: [(&[u8], &[&str]); 5] = [
        (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", &[]),
        (b"FOO\"BAR /api/tags HTTP/1.1\r\nhost: x\r\n\r\n", &["400"]),
        (
            b"GET /api/t\xc3\x28gs HTTP/1.1\r\nhost: x\r\n\r\n",
            &["400"],
        ),
        (huge.as_bytes(), &["431"]),
        (
            b"GET /api/tags HTTP/1.1\r\nhost: x\r\n\r\nGARBAGE\r\n\r\n",
            &["200", "400"],
        ),
    ];
    for (bytes, statuses) in sent {
        let answer = http::raw(guard.listen, bytes).await;
        let seen: Vec<&str> = answer
            .split("HTTP/1.1 ")
            .skip(1)
            .filter_map(|a| a.get(..3))
            .collect();
        assert_eq!(seen, statuses, "{answer:.200}");
    }
    // Counted just before its line is written (hyper closes the socket first): the lines
    // there, the counts are too.
    let lines = records(&log, 5).await;
    let metrics = guard.metrics_text().await;
    let m = |reason: &str| {
        let series = format!("guard_invalid_requests_total{{reason=\"{reason}\"}}");
        guard_tests::metric(&metrics, &series)
    };
    assert_eq!(
        (m("malformed_head"), m("head_too_large")),
        (Some(3.0), Some(1.0))
    );
    let mut refused: Vec<(u16, &str, &str, &str)> = lines
        .iter()
        .filter(|l| l.outcome == "invalid")
        .map(|l| {
            let reason = l.reason.as_deref().unwrap_or_default();
            (l.status, reason, &*l.method, &*l.path)
        })
        .collect();
    refused.sort_unstable();
    let malformed = (400, "malformed_head", "", "");
    assert_eq!(
        refused,
        [
            malformed,
            malformed,
            malformed,
            (431, "head_too_large", "", "")
        ]
    );
    assert_eq!(
        lines.len(),
        5,
        "the good request's line besides: {lines:#?}"
    );
}

/// `mv` then SIGUSR1 (what logrotate does): every line is in one of the two files, once.
#[tokio::test(flavor = "multi_thread")]
async fn a_rotation_loses_and_repeats_no_line() {
    let _serial = serial().await;
    let dir = TempDir::new("guard-access-rotate");
    let log = dir.0.join("access.log");
    let upstream = Upstream::start().await;
    let guard = GuardProcess::start(upstream.addr(), "openai", &config(&log));
    let body = Script::new(Mode::Complete).json();
    let send = async |count: usize| {
        for _ in 0..count {
            let answer = post(guard.listen, "/v1/chat/completions", &[], &body).await;
            assert_eq!(answer.status, 200);
        }
    };
    send(40).await;
    records(&log, 40).await;
    let rotated = dir.0.join("access.log.1");
    std::fs::rename(&log, &rotated).expect("mv");
    // Sent before the signal: each goes to the moved file, which guard still holds, or (if
    // it was still queued when the signal came) to the new one.
    send(10).await;
    reopen(&guard);
    until("the new file", async || log.exists()).await;
    send(30).await;
    let lines = |path: &Path| {
        std::fs::read_to_string(path)
            .unwrap_or_default()
            .lines()
            .count()
    };
    until("every line in one of the files", async || {
        lines(&rotated) + lines(&log) >= 80
    })
    .await;
    let (old, new) = (records(&rotated, 40).await, records(&log, 30).await);
    let mut ids: Vec<_> = old.iter().chain(&new).map(|l| l.id).collect();
    assert_eq!(ids.len(), 80, "{} + {} lines", old.len(), new.len());
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), 80, "no line twice");
    use std::os::unix::fs::PermissionsExt as _;
    let mode = std::fs::metadata(&log)
        .expect("the new log")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o640, "readable by its group only");
}

fn reopen(guard: &GuardProcess) {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(guard.pid() as i32),
        nix::sys::signal::Signal::SIGUSR1,
    )
    .expect("SIGUSR1");
}

/// A log on a full filesystem: every request is served; what could not be written is
/// counted, and what was written plus what was dropped is every request.
#[tokio::test(flavor = "multi_thread")]
async fn a_full_disk_never_stops_serving_and_drops_are_counted() {
    guard_tests::require_root();
    let _serial = serial().await;
    let dir = TempDir::new("guard-access-full");
    let mount = dir.0.join("small");
    std::fs::create_dir_all(&mount).expect("mount point");
    let mounted = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=16k", "tmpfs"])
        .arg(&mount)
        .status()
        .expect("mount");
    assert!(mounted.success(), "mount a 16 KiB tmpfs");
    let _unmount = Unmount(mount.clone());
    let log = mount.join("access.log");
    let upstream = Upstream::start().await;
    let guard = GuardProcess::start(upstream.addr(), "openai", &config(&log));
    let body = Script::new(Mode::Complete).json();
    let requests = 200;
    for _ in 0..requests {
        let answer = post(guard.listen, "/v1/chat/completions", &[], &body).await;
        assert_eq!(answer.status, 200, "served while the log's disk is full");
    }
    let dropped = "guard_access_log_dropped_total";
    let written = || {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .filter(|line| serde_json::from_str::<Record<'_>>(line).is_ok())
            .count()
    };
    until("every line written or counted", async || {
        written() as f64 + guard.metric(dropped).await == f64::from(requests)
    })
    .await;
    assert!(guard.metric(dropped).await > 0.0, "the disk filled");
}

/// Unmounts the test's filesystem, whatever the test did.
struct Unmount(std::path::PathBuf);

impl Drop for Unmount {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(&self.0).status();
    }
}

/// Requests from two real processes in two cgroups, one started by `guard exec --class batch`
/// and one in a scope of its own: `guard usage --by unit` names each with its requests, and
/// the rows sum to the log.
#[tokio::test(flavor = "multi_thread")]
async fn usage_by_unit_names_each_process_and_sums_to_the_log() {
    guard_tests::require_root();
    let _serial = serial().await;
    let root = guard_tests::cgroup2_root();
    let slice = guard_tests::TestCgroup::new(&root, "guard-usage.slice");
    let batch = slice.path.join("batch.scope");
    let scope = guard_tests::TestCgroup::new(&slice.path, "run-u4242.scope");
    let dir = TempDir::new("guard-access-usage");
    let log = dir.0.join("access.log");
    let upstream = Upstream::start().await;
    let config = format!(
        "[log]\naccess = \"{}\"\n[class.interactive]\npriority = 0\n\
         [class.batch]\npriority = 10\ncgroup = \"{}\"\n",
        log.display(),
        batch.display()
    );
    let guard = GuardProcess::start(upstream.addr(), "openai", &config);
    let _batch = guard_tests::TestCgroup {
        path: batch.clone(),
    };
    let curl = curl_command(&guard, &dir.0);
    for _ in 0..3 {
        let exec = format!(
            "exec {} exec --config {} --class batch -- sh -c \"{curl}\"",
            guard_tests::guard_bin().display(),
            guard.config_path.display()
        );
        run_sh(&exec);
    }
    for _ in 0..2 {
        run_sh(&format!(
            "echo $$ > {}/cgroup.procs && {curl}",
            scope.path.display()
        ));
    }
    let lines = records(&log, 5).await;
    let usage = std::process::Command::new(guard_tests::guard_bin())
        .args([
            "usage", "--by", "unit", "--since", "all", "--format", "json", "--log",
        ])
        .arg(&log)
        .output()
        .expect("guard usage");
    assert!(
        usage.status.success(),
        "{}",
        String::from_utf8_lossy(&usage.stderr)
    );
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&usage.stdout).expect("JSON rows");
    let row = |unit: &str| {
        rows.iter()
            .find(|r| r["unit"] == unit)
            .unwrap_or_else(|| panic!("no row {unit}: {rows:#?}"))
            .clone()
    };
    assert_eq!(row("batch.scope")["requests"], 3, "{rows:#?}");
    let scope_unit = scope
        .path
        .file_name()
        .expect("a name")
        .to_string_lossy()
        .into_owned();
    assert_eq!(row(&scope_unit)["requests"], 2, "{rows:#?}");
    let units: Vec<&serde_json::Value> = rows.iter().filter(|r| r["unit"] != "total").collect();
    assert_eq!(units.len(), 2, "two clients: {rows:#?}");
    let sum = |field: &str| {
        units
            .iter()
            .map(|r| r[field].as_u64().unwrap_or(0))
            .sum::<u64>()
    };
    assert_eq!(sum("requests"), lines.len() as u64);
    let logged: u64 = lines.iter().map(|l| l.tokens.generated.unwrap_or(0)).sum();
    assert_eq!(sum("generated_tokens"), logged);
    assert_eq!(row("total")["requests"], lines.len() as u64);
}

/// A curl that posts one chat (the body in a file) to guard and fails unless it is answered
/// 200.
fn curl_command(guard: &GuardProcess, dir: &Path) -> String {
    let body = dir.join("body.json");
    std::fs::write(&body, Script::new(Mode::Complete).json().to_string()).expect("the body");
    format!(
        "curl -sf -o /dev/null -H 'content-type: application/json' --data-binary @{} \
         http://{}/v1/chat/completions",
        body.display(),
        guard.listen
    )
}

fn run_sh(script: &str) {
    let status = std::process::Command::new("sh")
        .args(["-c", script])
        .status()
        .expect("sh");
    assert!(status.success(), "{script}");
}
