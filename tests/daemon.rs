//! `guard run` and `guard check-config` as a user meets them: the metrics listener shows
//! `guard_ebpf_attached 1` as root and 0 without privileges (with one line saying why), a bad
//! config exits 64 naming file, line and key, and SIGTERM exits 0 and detaches.

use std::process::Command;

use guard_tests::{
    TempDir, free_addr, guard_bin, http::get, metric, require_root, servers::GuardProcess,
};

/// Whether a process holds a BPF program (an fd whose link says bpf-prog).
fn holds_bpf_program(pid: u32) -> bool {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|fds| {
            fds.flatten().any(|fd| {
                std::fs::read_link(fd.path())
                    .is_ok_and(|target| target.to_string_lossy().contains("bpf-prog"))
            })
        })
        .unwrap_or(false)
}

#[tokio::test(flavor = "multi_thread")]
async fn as_root_ebpf_attaches_and_sigterm_detaches() {
    require_root();
    let mut guard = GuardProcess::start(free_addr(), "ollama", "");
    let text = guard.metrics_text().await;
    assert_eq!(metric(&text, "guard_ebpf_attached"), Some(1.0), "{text}");
    let status = get(guard.metrics, "/status").await.expect("status").text();
    assert!(status.contains("\"attached\":true"), "{status}");
    assert!(
        holds_bpf_program(guard.pid()),
        "guard holds its eBPF program"
    );
    let exit = guard.terminate().expect("exits on SIGTERM");
    assert!(exit.success(), "SIGTERM exits 0, got {exit}");
}

#[tokio::test(flavor = "multi_thread")]
async fn without_privileges_guard_runs_on_and_says_why_once() {
    require_root();
    let mut guard = GuardProcess::start_as(free_addr(), "ollama", "", true);
    let text = guard.metrics_text().await;
    assert_eq!(metric(&text, "guard_ebpf_attached"), Some(0.0), "{text}");
    let status = get(guard.metrics, "/status").await.expect("status").text();
    assert!(status.contains("CAP_BPF"), "/status says why: {status}");
    let exit = guard.terminate().expect("exits on SIGTERM");
    assert!(exit.success(), "SIGTERM exits 0, got {exit}");
    let why: Vec<String> = guard
        .log_lines()
        .into_iter()
        .filter(|l| l.contains("eBPF is off"))
        .collect();
    assert_eq!(why.len(), 1, "one line says why: {why:#?}");
    assert!(why[0].contains("CAP_BPF and CAP_PERFMON"), "{}", why[0]);
}

#[test]
fn bad_config_exits_64_naming_file_line_and_key() {
    let dir = TempDir::new("guard-bad-config");
    let path = dir.0.join("bad.toml");
    std::fs::write(
        &path,
        "[upstream]\nurl = \"http://127.0.0.1:1\"\nmax_concurrency = 0\n",
    )
    .expect("write");
    for command in ["check-config", "run"] {
        let output = Command::new(guard_bin())
            .args([command, "--config"])
            .arg(&path)
            .output()
            .expect("run guard");
        assert_eq!(output.status.code(), Some(64), "{command}");
        let stderr = String::from_utf8_lossy(&output.stderr);
        let expected = format!("{}:3: upstream.max_concurrency", path.display());
        assert!(stderr.contains(&expected), "{command}: {stderr}");
    }
    let good = Command::new(guard_bin())
        .args(["check-config", "--config"])
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../deploy/guard.example.toml"
        ))
        .output()
        .expect("run guard");
    assert!(
        good.status.success(),
        "{}",
        String::from_utf8_lossy(&good.stderr)
    );
}
