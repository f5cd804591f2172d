//! `guard run` and `guard check-config` as a user meets them: the metrics listener shows
//! `guard_ebpf_attached 1` as root and 0 without privileges (with one line saying why), a bad
//! config exits 64 naming file, line and key, SIGTERM exits 0 and detaches, and several
//! listen addresses (IPv4 and IPv6) each serve and reap, while overlapping ones are refused;
//! idle client connections are parked outside hyper and go on where they stopped.

use std::process::Command;

use guard_testkit::{Mode, Script, Upstream};
use guard_tests::{
    TempDir, free_addr, free_addr_on, guard_bin,
    http::{Answers, get},
    metric, require_root,
    scripted::{hang_then_leave, post_script},
    servers::GuardProcess,
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

#[tokio::test(flavor = "multi_thread")]
async fn each_listen_address_serves_and_its_departed_clients_are_reaped() {
    require_root();
    let upstream = Upstream::start().await;
    let (v4, v6) = (
        free_addr(),
        free_addr_on(std::net::Ipv6Addr::LOCALHOST.into()),
    );
    let extra = format!("[server]\nlisten = [\"{v4}\", \"{v6}\"]\n");
    let guard = GuardProcess::start(upstream.addr(), "openai", &extra);
    assert_eq!(guard.listen, v4);
    for addr in [v4, v6] {
        let answer = post_script(addr, &Script::new(Mode::Complete)).await;
        assert_eq!(answer.status, 200, "through {addr}: {}", answer.text());
    }
    assert_eq!(upstream.started(), 2);
    let text = guard.metrics_text().await;
    assert_eq!(metric(&text, "guard_ebpf_attached"), Some(1.0), "{text}");
    // With the kernel program attached nothing in user space watches a client: a reap on the
    // second listener's port says the program watches that port too.
    hang_then_leave(&upstream, v6).await;
    guard
        .wait_for_metric(
            "guard_reaped_total{class=\"interactive\",stage=\"running\"}",
            1.0,
        )
        .await;
}

#[test]
fn overlapping_listen_addresses_are_refused_naming_the_key() {
    let dir = TempDir::new("guard-overlap");
    let path = dir.0.join("overlap.toml");
    let port = free_addr().port();
    let cases = [
        (
            format!("[server]\nlisten = [\"127.0.0.1:{port}\", \"0.0.0.0:{port}\"]\n"),
            "server.listen",
        ),
        (
            format!("[server]\nlisten = \"[::1]:{port}\"\n[metrics]\nlisten = \"[::]:{port}\"\n"),
            "metrics.listen",
        ),
    ];
    for (text, key) in cases {
        std::fs::write(&path, &text).expect("write");
        let output = Command::new(guard_bin())
            .args(["run", "--config"])
            .arg(&path)
            .output()
            .expect("run guard");
        assert_eq!(output.status.code(), Some(64), "{text}");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains(&format!(": {key}: ")), "{text}: {stderr}");
        assert!(stderr.contains("overlaps"), "{stderr}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn idle_connections_are_parked_and_go_on_where_they_stopped() {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let upstream = guard_tests::http::empty_json_on_get().await;
    let mut guard = GuardProcess::start(
        upstream,
        "ollama",
        // Every idle connection parks, however few there are.
        "[server]\nheader_read_timeout_ms = 1500\nready_connections = 0\n",
    );
    let get = b"GET /api/tags HTTP/1.1\r\nhost: g\r\n\r\n";
    let mut client = Answers::connect(guard.listen).await;
    // A connection that has sent nothing waits outside hyper; so does one between requests.
    guard.wait_for_metric("guard_connections_parked", 1.0).await;
    for _ in 0..3 {
        client.stream.write_all(get).await.expect("send");
        assert!(client.next().await.starts_with("HTTP/1.1 200"));
        guard.wait_for_metric("guard_connections_parked", 1.0).await;
    }
    // Two requests in one write; then one and the start of the next, the rest of it a moment
    // later (hyper had read that start when the connection was parked): each answered once,
    // in order, on the same connection.
    let two = [&get[..], &get[..]].concat();
    client.stream.write_all(&two).await.expect("send");
    assert!(client.next().await.starts_with("HTTP/1.1 200"));
    assert!(client.next().await.starts_with("HTTP/1.1 200"));
    let one_and_a_start = [&get[..], &get[..11]].concat();
    client
        .stream
        .write_all(&one_and_a_start)
        .await
        .expect("send");
    assert!(client.next().await.starts_with("HTTP/1.1 200"));
    // The second head's shape on the wire (two segments), not a wait for a state.
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    client.stream.write_all(&get[11..]).await.expect("send");
    assert!(client.next().await.starts_with("HTTP/1.1 200"));
    assert!(client.seen.is_empty(), "nothing more was answered");

    // A head begun and never finished is cut off once its time is up, counted from the last
    // answer however the wait was spent (hyper, too, closes without an answer then).
    let answered = std::time::Instant::now();
    client.stream.write_all(b"GET /api/ta").await.expect("send");
    let mut rest = Vec::new();
    let _ = client.stream.read_to_end(&mut rest).await;
    let waited = answered.elapsed();
    assert!(rest.is_empty(), "{}", String::from_utf8_lossy(&rest));
    assert!(
        waited > std::time::Duration::from_millis(1000)
            && waited < std::time::Duration::from_secs(5),
        "{waited:?}"
    );

    // A parked connection does not hold guard up at SIGTERM; it is closed.
    let mut parked = Answers::connect(guard.listen).await;
    parked.stream.write_all(get).await.expect("send");
    assert!(parked.next().await.starts_with("HTTP/1.1 200"));
    guard.wait_for_metric("guard_connections_parked", 1.0).await;
    let stopping = std::time::Instant::now();
    assert!(guard.terminate().is_some_and(|s| s.success()));
    assert!(stopping.elapsed() < std::time::Duration::from_secs(5));
    let mut left = Vec::new();
    assert_eq!(
        parked.stream.read_to_end(&mut left).await.expect("closed"),
        0
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn idle_connections_up_to_ready_connections_stay_in_hyper_and_the_rest_park() {
    use tokio::io::AsyncWriteExt as _;
    let upstream = guard_tests::http::empty_json_on_get().await;
    let mut guard = GuardProcess::start(upstream, "ollama", "[server]\nready_connections = 1\n");
    let get = b"GET /api/tags HTTP/1.1\r\nhost: g\r\n\r\n";
    // One after another: the first stays in hyper between requests (one is allowed), each
    // later one parks once answered, as more than one would then be in hyper.
    let mut clients = Vec::new();
    for _ in 0..3 {
        let mut client = Answers::connect(guard.listen).await;
        client.stream.write_all(get).await.expect("send");
        assert!(client.next().await.starts_with("HTTP/1.1 200"));
        clients.push(client);
    }
    guard.wait_for_metric("guard_connections_parked", 2.0).await;
    // Had the first parked too, it would have done so before the others were answered.
    assert_eq!(guard.metric("guard_connections_parked").await, 2.0);
    // The key is read at the start only: a reload says so, and the first stays in hyper.
    guard.edit_config_and_reload("ready_connections = 1", "ready_connections = 0");
    guard.wait_for_log_naming(
        "takes effect at the next start only",
        "server.ready_connections",
    );
    guard.wait_for_log("config reloaded");
    for client in &mut clients {
        client.stream.write_all(get).await.expect("send");
        assert!(client.next().await.starts_with("HTTP/1.1 200"));
    }
    guard.wait_for_metric("guard_connections_parked", 2.0).await;
    assert_eq!(guard.metric("guard_connections_parked").await, 2.0);
}
