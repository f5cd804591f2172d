//! Holding batch work back on this machine's real cgroups: a real busy process in the batch
//! cgroup (put there by `guard exec`), interactive requests put at risk on the real
//! llama-server behind a long batch generation, cgroup v2 freeze and v1 CPU quota, restore
//! after the hold time, on SIGTERM, after SIGKILL on the next start, by `guard restore` with no
//! config and by a start with a broken one; holds bounded by `risk.max_throttle_ms`; the lock
//! between two guards, and bad cgroup configs.

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use guard_testkit::{Polling, until_with};
use guard_tests::{
    ChildGuard, TempDir, TestCgroup,
    body::{With as _, chat},
    cgroup2_root, guard_bin,
    http::{Leave, leave, post},
    process_cpu_seconds, require_root, serial,
    servers::{GuardProcess, LlamaServer},
};
use serde_json::json;

/// Config for a batch class throttled by `mode` in `cgroup`, and an interactive class whose
/// requests are at risk once they have waited 200 ms (2 % of a 10 s deadline).
fn config(cgroup: &Path, mode: &str, state_dir: &Path) -> String {
    format!(
        "[server]\ndrain_grace_ms = 2000\n[estimate]\ninitial_service_ms = 100\n\
         [risk]\nwait_fraction = 0.02\nhold_ms = 1000\nstate_dir = \"{}\"\n\
         [class.interactive]\npriority = 0\nmax_queue = 8\ndeadline_ms = 10000\n\
         [class.batch]\npriority = 10\nmax_queue = 100\ncgroup = \"{}\"\nthrottle = \"{mode}\"\n",
        state_dir.display(),
        cgroup.display()
    )
}

/// A CPU-bound process started in the batch class's cgroup by `guard exec`.
fn busy_in_class(config_path: &Path, cgroup: &Path) -> ChildGuard {
    let child = Command::new(guard_bin())
        .args(["exec", "--config"])
        .arg(config_path)
        .args(["--class", "batch", "--", "sh", "-c", "while :; do :; done"])
        .stdout(Stdio::null())
        .spawn()
        .expect("guard exec");
    let pid = child.id().to_string();
    let child = ChildGuard(child);
    let started = Instant::now();
    while !std::fs::read_to_string(cgroup.join("cgroup.procs"))
        .unwrap_or_default()
        .lines()
        .any(|l| l == pid)
    {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "guard exec did not move the process"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    child
}

/// CPU seconds `pid` used over a measurement interval.
fn cpu_over(pid: u32, interval: Duration) -> f64 {
    let before = process_cpu_seconds(pid);
    // The interval is what is measured, not a wait for something to happen.
    std::thread::sleep(interval);
    process_cpu_seconds(pid) - before
}

/// Puts the interactive class at risk on the real llama-server: a long batch generation takes
/// its only slot, an interactive chat waits behind it. Returns the batch client (leave it to
/// lift the risk) and the waiting chat.
async fn put_at_risk(
    guard: &GuardProcess,
) -> (tokio::net::TcpStream, tokio::task::JoinHandle<u16>) {
    // No token limit: llama-server generates until its context is full (seconds), and guard,
    // which cannot know how long that is, estimates it from what it has seen complete. With a
    // limit it would see the chat cannot start within its deadline and refuse it at once.
    let long = json!({ "prompt": "Write a long story.", "ignore_eos": true });
    let batch = guard.running_batch("/completion", &long).await;
    let addr = guard.listen;
    // A short answer, so that the estimate stays short and the next one is admitted too.
    let short = chat("hi").with("max_tokens", 2);
    let interactive =
        tokio::spawn(async move { post(addr, "/v1/chat/completions", &[], &short).await.status });
    guard
        .wait_for_metric("guard_at_risk{reason=\"wait\"}", 1.0)
        .await;
    guard
        .wait_for_metric("guard_class_throttled{class=\"batch\"}", 1.0)
        .await;
    (batch, interactive)
}

/// SIGKILL: no handler runs, nothing is restored. Returns once the process is gone.
fn kill_hard(guard: &GuardProcess) {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(guard.pid() as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("SIGKILL");
    let stat = format!("/proc/{}/stat", guard.pid());
    let started = Instant::now();
    while Path::new(&stat).exists()
        && !std::fs::read_to_string(&stat)
            .unwrap_or_default()
            .contains(") Z")
    {
        assert!(started.elapsed() < Duration::from_secs(5));
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn read(file: PathBuf) -> String {
    std::fs::read_to_string(&file)
        .unwrap_or_else(|e| panic!("{}: {e}", file.display()))
        .trim()
        .to_owned()
}

#[tokio::test(flavor = "multi_thread")]
async fn cgroup_v2_freeze_holds_batch_and_lets_go_after_the_hold_time() {
    require_root();
    let _serial = serial().await;
    let state = TempDir::new("guard-throttle-v2");
    let cgroup = TestCgroup::new(&cgroup2_root(), "guard-test-batch-v2");
    let llama = LlamaServer::start(1).await;
    let mut guard = GuardProcess::start(
        llama.addr,
        "openai",
        &config(&cgroup.path, "freeze", &state.0),
    );
    let busy = busy_in_class(&guard.config_path, &cgroup.path);
    let pid = busy.0.id();
    assert!(
        cpu_over(pid, Duration::from_millis(500)) > 0.3,
        "the busy process runs"
    );

    let (batch, interactive) = put_at_risk(&guard).await;
    assert_eq!(read(cgroup.path.join("cgroup.freeze")), "1");
    let frozen = cpu_over(pid, Duration::from_millis(500));
    assert!(frozen < 0.02, "frozen: {frozen} CPU s in 0.5 s");

    leave(batch, Leave::Fin);
    assert_eq!(interactive.await.expect("interactive"), 200);
    guard.wait_for_log("risk clear");
    assert_eq!(
        guard.metric("guard_class_throttled{class=\"batch\"}").await,
        0.0
    );
    assert_eq!(read(cgroup.path.join("cgroup.freeze")), "0");
    assert!(
        cpu_over(pid, Duration::from_millis(500)) > 0.3,
        "runs again after the hold time"
    );

    // Frozen again, then SIGTERM: guard restores on the way out.
    let (batch, _interactive) = put_at_risk(&guard).await;
    assert_eq!(read(cgroup.path.join("cgroup.freeze")), "1");
    let status = guard.terminate().expect("exits on SIGTERM");
    assert!(status.success(), "{status}");
    assert_eq!(
        read(cgroup.path.join("cgroup.freeze")),
        "0",
        "SIGTERM restored the cgroup"
    );
    drop(batch);
}

#[tokio::test(flavor = "multi_thread")]
async fn cgroup_v1_cpu_quota_limits_batch_to_its_share() {
    require_root();
    let _serial = serial().await;
    let state = TempDir::new("guard-throttle-v1");
    let cgroup = TestCgroup::new(Path::new("/sys/fs/cgroup/cpu"), "guard-test-batch-v1");
    let original = read(cgroup.path.join("cpu.cfs_quota_us"));
    let llama = LlamaServer::start(1).await;
    let guard = GuardProcess::start(
        llama.addr,
        "openai",
        &config(&cgroup.path, "cpu:10", &state.0),
    );
    let busy = busy_in_class(&guard.config_path, &cgroup.path);
    let pid = busy.0.id();

    let (batch, interactive) = put_at_risk(&guard).await;
    assert_eq!(read(cgroup.path.join("cpu.cfs_quota_us")), "10000");
    let limited = cpu_over(pid, Duration::from_secs(1));
    assert!(
        (0.03..0.2).contains(&limited),
        "about 10 % of a CPU: {limited} CPU s in 1 s"
    );

    leave(batch, Leave::Fin);
    assert_eq!(interactive.await.expect("interactive"), 200);
    guard
        .wait_for_metric("guard_at_risk{reason=\"wait\"}", 0.0)
        .await;
    let polling = Polling::within(Duration::from_secs(10), Duration::from_millis(50));
    until_with(polling, "the quota is restored", async || {
        read(cgroup.path.join("cpu.cfs_quota_us")) == original
    })
    .await;
    assert!(
        cpu_over(pid, Duration::from_millis(500)) > 0.3,
        "full speed again"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn sigkill_while_throttled_is_repaired_by_the_next_start() {
    require_root();
    let _serial = serial().await;
    let state = TempDir::new("guard-throttle-crash");
    let cgroup = TestCgroup::new(&cgroup2_root(), "guard-test-batch-crash");
    let llama = LlamaServer::start(1).await;
    let extra = config(&cgroup.path, "freeze", &state.0);
    let guard = GuardProcess::start(llama.addr, "openai", &extra);
    let _busy = busy_in_class(&guard.config_path, &cgroup.path);
    let (batch, _interactive) = put_at_risk(&guard).await;
    kill_hard(&guard);
    assert_eq!(
        read(cgroup.path.join("cgroup.freeze")),
        "1",
        "a killed guard could not restore"
    );
    drop(batch);
    drop(guard);

    let restarted = GuardProcess::start(llama.addr, "openai", &extra);
    assert_eq!(
        read(cgroup.path.join("cgroup.freeze")),
        "0",
        "the next start restored it"
    );
    assert!(
        restarted
            .startup_log
            .iter()
            .any(|l| l.contains("restored a cgroup value")),
        "{:#?}",
        restarted.startup_log
    );
}

/// After a SIGKILL mid-freeze: `guard restore` thaws the cgroup from the state directory alone
/// (no config exists any more), and `guard run` with a broken config restores first, then
/// exits 64.
#[tokio::test(flavor = "multi_thread")]
async fn a_crash_is_repaired_with_no_config_and_by_a_start_with_a_broken_one() {
    require_root();
    let _serial = serial().await;
    let state = TempDir::new("guard-throttle-restore");
    let cgroup = TestCgroup::new(&cgroup2_root(), "guard-test-batch-restore");
    let llama = LlamaServer::start(1).await;
    let extra = config(&cgroup.path, "freeze", &state.0);
    let freeze = || read(cgroup.path.join("cgroup.freeze"));
    let guard = GuardProcess::start(llama.addr, "openai", &extra);
    let _busy = busy_in_class(&guard.config_path, &cgroup.path);
    let (batch, _interactive) = put_at_risk(&guard).await;
    kill_hard(&guard);
    drop((batch, guard)); // its temporary folder, config included, goes too
    assert_eq!(freeze(), "1", "a killed guard could not restore");
    let restore = Command::new(guard_bin())
        .args(["restore", "--state-dir"])
        .arg(&state.0)
        .output()
        .expect("guard restore");
    let said = String::from_utf8_lossy(&restore.stderr);
    assert!(restore.status.success(), "{said}");
    assert!(said.contains("restored a cgroup value"), "{said}");
    assert_eq!(freeze(), "0", "guard restore thawed it");

    let guard = GuardProcess::start(llama.addr, "openai", &extra);
    let (batch, _interactive) = put_at_risk(&guard).await;
    kill_hard(&guard);
    drop((batch, guard));
    assert_eq!(freeze(), "1");
    let dir = TempDir::new("guard-throttle-broken");
    let broken = dir.0.join("guard.toml");
    std::fs::write(
        &broken,
        extra.replace("[risk]\n", "[risk]\nnot_a_key = 1\n"),
    )
    .expect("write the broken config");
    let run = Command::new(guard_bin())
        .args(["run", "--config"])
        .arg(&broken)
        .output()
        .expect("guard run");
    let said = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(64), "{said}");
    assert!(said.contains("not_a_key"), "{said}");
    assert_eq!(
        freeze(),
        "0",
        "guard run restored before refusing its config"
    );
}

/// Risk that lasts longer than `risk.max_throttle_ms`: each hold ends on time, and the class
/// runs at least `risk.min_release_ms` before the next.
#[tokio::test(flavor = "multi_thread")]
async fn a_hold_never_exceeds_max_throttle_ms() {
    require_root();
    let _serial = serial().await;
    let state = TempDir::new("guard-throttle-max");
    let cgroup = TestCgroup::new(&cgroup2_root(), "guard-test-batch-max");
    let llama = LlamaServer::start(1).await;
    let (max, rest) = (Duration::from_millis(1500), Duration::from_millis(700));
    let extra = config(&cgroup.path, "freeze", &state.0).replace(
        "hold_ms = 1000\n",
        &format!(
            "hold_ms = 1000\nmax_throttle_ms = {}\nmin_release_ms = {}\n",
            max.as_millis(),
            rest.as_millis()
        ),
    );
    let mut guard = GuardProcess::start(llama.addr, "openai", &extra);
    let _busy = busy_in_class(&guard.config_path, &cgroup.path);
    let (batch, interactive) = put_at_risk(&guard).await;
    // The interactive chat waits behind the batch generation: risk stays on for seconds. Follow
    // cgroup.freeze until it has been let go and held again.
    let mut stretches: Vec<(String, Duration)> = Vec::new();
    let (mut value, mut since) = (read(cgroup.path.join("cgroup.freeze")), Instant::now());
    let started = Instant::now();
    while stretches.len() < 3 {
        assert!(started.elapsed() < Duration::from_secs(8), "{stretches:?}");
        std::thread::sleep(Duration::from_millis(5));
        let now = read(cgroup.path.join("cgroup.freeze"));
        if now != value {
            stretches.push((value, since.elapsed()));
            (value, since) = (now, Instant::now());
        }
    }
    // The first stretch was seen from its middle; the next two whole: let go, then held.
    let slack = Duration::from_millis(100);
    assert_eq!(stretches[0].0, "1", "{stretches:?}");
    assert!(stretches[0].1 <= max + slack, "{stretches:?}");
    assert_eq!(stretches[1].0, "0", "{stretches:?}");
    assert!(
        stretches[1].1 + slack >= rest,
        "rests too short: {stretches:?}"
    );
    assert!(stretches[2].1 <= max + slack, "{stretches:?}");
    assert!(
        guard
            .metric("guard_throttle_changes_total{change=\"release\",class=\"batch\",reason=\"max_throttle\"}")
            .await
            >= 2.0
    );
    // The risk detector's own line ("dispatch ... resumes reason=max_throttle") may come
    // first: wait for the cgroup's.
    let log = guard.wait_for_log("restored");
    assert!(
        log.iter()
            .any(|l| l.contains("restored") && l.contains("max_throttle")),
        "{log:#?}"
    );
    leave(batch, Leave::Fin);
    drop(interactive);
}

#[tokio::test(flavor = "multi_thread")]
async fn two_guards_cannot_throttle_one_cgroup() {
    require_root();
    let _serial = serial().await;
    let state = TempDir::new("guard-throttle-lock");
    let cgroup = TestCgroup::new(&cgroup2_root(), "guard-test-batch-lock");
    let llama = LlamaServer::start(1).await;
    let extra = config(&cgroup.path, "freeze", &state.0);
    let first = GuardProcess::start(llama.addr, "openai", &extra);
    let second = Command::new(guard_bin())
        .args(["run", "--config"])
        .arg(&first.config_path)
        .output()
        .expect("second guard");
    assert_eq!(second.status.code(), Some(64));
    let stderr = String::from_utf8_lossy(&second.stderr);
    assert!(
        stderr.contains("already throttled by another guard"),
        "{stderr}"
    );
    assert!(stderr.contains("class.batch.cgroup"), "{stderr}");
}

#[test]
fn unusable_cgroup_configs_are_refused_at_start() {
    require_root();
    let state = TempDir::new("guard-throttle-bad");
    let cases = [
        (
            PathBuf::from("/tmp/guard-not-a-cgroup"),
            "freeze",
            "not inside a cgroup filesystem",
        ),
        (
            cgroup2_root().join("guard-test-no-cpu"),
            "cpu:10",
            "cpu controller",
        ),
        (
            PathBuf::from("/sys/fs/cgroup/cpu/guard-test-no-freezer"),
            "freeze",
            "freezer controller",
        ),
    ];
    for (path, mode, expected) in cases {
        let file = state.0.join("guard.toml");
        let (listen, metrics) = (guard_tests::free_addr(), guard_tests::free_addr());
        let text = config(&path, mode, &state.0).replacen(
            "[server]\n",
            &format!("[server]\nlisten = \"{listen}\"\n"),
            1,
        );
        std::fs::write(&file, format!("[metrics]\nlisten = \"{metrics}\"\n{text}")).expect("write");
        let output = Command::new(guard_bin())
            .args(["run", "--config"])
            .arg(&file)
            .output()
            .expect("guard");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(64), "{stderr}");
        assert!(
            stderr.contains("class.batch.cgroup") && stderr.contains(expected),
            "{mode} at {}: {stderr}",
            path.display()
        );
        let _ = std::fs::remove_dir(&path);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn sighup_changes_risk_thresholds() {
    require_root();
    let _serial = serial().await;
    let state = TempDir::new("guard-throttle-reload");
    let cgroup = TestCgroup::new(&cgroup2_root(), "guard-test-batch-reload");
    let llama = LlamaServer::start(1).await;
    // At first waiting never puts a protected request at risk: it would have to wait longer
    // than its deadline, and it leaves the queue at the deadline.
    let strict = config(&cgroup.path, "freeze", &state.0);
    let lax = strict.replace("wait_fraction = 0.02", "wait_fraction = 1.0");
    let mut guard = GuardProcess::start(llama.addr, "openai", &lax);
    let contents = std::fs::read_to_string(&guard.config_path).expect("read config");
    std::fs::write(
        &guard.config_path,
        contents.replace("wait_fraction = 1.0", "wait_fraction = 0.02"),
    )
    .expect("write config");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(guard.pid() as i32),
        nix::sys::signal::Signal::SIGHUP,
    )
    .expect("SIGHUP");
    guard.wait_for_log("config reloaded");
    // Now 200 ms of waiting is enough.
    let (batch, interactive) = put_at_risk(&guard).await;
    assert_eq!(read(cgroup.path.join("cgroup.freeze")), "1");
    leave(batch, Leave::Fin);
    assert_eq!(interactive.await.expect("interactive"), 200);
}
