//! `guard run` and `guard check-config` as a user meets them: the metrics listener shows
//! `guard_ebpf_attached 1` as root and 0 without privileges (with one line saying why), a bad
//! config exits 64 naming file, line and key, and SIGTERM exits 0 and detaches.

use std::{
    io::{BufRead as _, BufReader, Read as _, Write as _},
    net::{SocketAddr, TcpStream},
    os::unix::process::CommandExt as _,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use guard_tests::{ChildGuard, TempDir, free_addr, guard_bin, require_root};

/// A running `guard run`, killed on drop; its stderr is read line by line.
struct Guard {
    child: ChildGuard,
    log: BufReader<std::process::ChildStderr>,
    metrics: SocketAddr,
}

fn write_config(dir: &TempDir, upstream: SocketAddr) -> (std::path::PathBuf, SocketAddr) {
    let metrics = free_addr();
    let config = format!(
        "[server]\nlisten = \"{}\"\n[upstream]\nurl = \"http://{upstream}\"\n[metrics]\nlisten = \"{metrics}\"\n",
        free_addr()
    );
    let path = dir.0.join("guard.toml");
    std::fs::write(&path, config).expect("write config");
    (path, metrics)
}

/// Starts guard and reads its log until it serves; returns it and the lines read.
fn start(
    config: &std::path::Path,
    metrics: SocketAddr,
    unprivileged: bool,
) -> (Guard, Vec<String>) {
    let mut command = Command::new(guard_bin());
    command
        .args(["run", "--config"])
        .arg(config)
        .env("NO_COLOR", "1")
        .stderr(Stdio::piped());
    if unprivileged {
        command.uid(65534).gid(65534);
    }
    let mut child = command.spawn().expect("spawn guard");
    let stderr = child.stderr.take().expect("stderr");
    let mut guard = Guard {
        child: ChildGuard(child),
        log: BufReader::new(stderr),
        metrics,
    };
    let startup = guard.wait_for_log("guard is serving");
    (guard, startup)
}

impl Guard {
    /// Reads log lines until one contains `text`; returns every line read.
    fn wait_for_log(&mut self, text: &str) -> Vec<String> {
        let mut lines = Vec::new();
        loop {
            let mut line = String::new();
            let read = self.log.read_line(&mut line).expect("read guard's log");
            assert!(read > 0, "guard exited before logging `{text}`: {lines:#?}");
            let found = line.contains(text);
            lines.push(line);
            if found {
                return lines;
            }
        }
    }

    fn get(&self, path: &str) -> String {
        http_get(self.metrics, path)
    }

    fn child(&mut self) -> &mut Child {
        &mut self.child.0
    }
}

fn http_get(addr: SocketAddr, path: &str) -> String {
    let mut stream = TcpStream::connect(addr).expect("connect to metrics");
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: guard\r\nConnection: close\r\n\r\n"
    )
    .expect("send");
    let mut response = String::new();
    stream.read_to_string(&mut response).expect("read");
    response
}

fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find(|line| line.split(' ').next() == Some(name))
        .and_then(|line| line.split(' ').nth(1))
        .and_then(|value| value.parse().ok())
}

fn terminate_and_wait(guard: &mut Guard) -> std::process::ExitStatus {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(guard.child().id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .expect("SIGTERM");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(status) = guard.child().try_wait().expect("wait") {
            return status;
        }
        assert!(
            Instant::now() < deadline,
            "guard did not exit after SIGTERM"
        );
        // Polling a child's exit: there is no blocking wait with a bound in std.
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn program_attached(pid: u32) -> bool {
    // Our tracepoint program shows as a bpf-prog fd of the guard process.
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|fds| {
            fds.flatten().any(|fd| {
                std::fs::read_link(fd.path())
                    .is_ok_and(|target| target.to_string_lossy().contains("bpf-prog"))
            })
        })
        .unwrap_or(false)
}

#[test]
fn as_root_ebpf_attaches_and_sigterm_detaches() {
    require_root();
    let dir = TempDir::new("guard-daemon-root");
    let (config, metrics) = write_config(&dir, free_addr());
    let (mut guard, _) = start(&config, metrics, false);
    let text = guard.get("/metrics");
    assert_eq!(metric(&text, "guard_ebpf_attached"), Some(1.0), "{text}");
    let status = guard.get("/status");
    assert!(status.contains("\"attached\":true"), "{status}");
    let pid = guard.child().id();
    assert!(program_attached(pid), "guard holds its eBPF program");
    let exit = terminate_and_wait(&mut guard);
    assert!(exit.success(), "SIGTERM exits 0, got {exit}");
}

#[test]
fn without_privileges_guard_runs_on_and_says_why_once() {
    require_root();
    let dir = TempDir::new("guard-daemon-nobody");
    let (config, metrics) = write_config(&dir, free_addr());
    // nobody must be able to read the config.
    std::fs::set_permissions(&dir.0, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .expect("chmod");
    let (mut guard, startup) = start(&config, metrics, true);
    let text = guard.get("/metrics");
    assert_eq!(metric(&text, "guard_ebpf_attached"), Some(0.0), "{text}");
    let status = guard.get("/status");
    assert!(status.contains("CAP_BPF"), "/status says why: {status}");
    let exit = terminate_and_wait(&mut guard);
    assert!(exit.success(), "SIGTERM exits 0, got {exit}");
    let mut rest = String::new();
    guard.log.read_to_string(&mut rest).expect("read log");
    let why: Vec<_> = startup
        .iter()
        .map(String::as_str)
        .chain(rest.lines())
        .filter(|line| line.contains("eBPF is off"))
        .collect();
    assert_eq!(why.len(), 1, "one line says why: {startup:#?} {rest}");
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
