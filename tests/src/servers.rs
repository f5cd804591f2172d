//! Real servers for end-to-end tests: llama-server with SmolLM2, the Ollama API emulator, and
//! guard itself, each stopped on drop.

use std::{
    io::{BufRead as _, BufReader},
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Child, ChildStderr, Command, Stdio},
    sync::{Arc, Condvar, Mutex},
    time::{Duration, Instant},
};

use guard_testkit::{Polling, until_with};
use tokio::net::TcpStream;

use crate::{TempDir, free_addr, guard_bin, http};

/// How long a server may take to become ready; reaching it fails the test.
const READY_BOUND: Duration = Duration::from_secs(60);

/// Sends SIGTERM, waits up to `grace`, then SIGKILLs (llama-server stalls on SIGTERM while a
/// stream is open).
fn stop(child: &mut Child, grace: Duration) -> Option<std::process::ExitStatus> {
    // Already reaped: its pid may belong to another process by now.
    if let Ok(Some(status)) = child.try_wait() {
        return Some(status);
    }
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline {
        if let Ok(Some(status)) = child.try_wait() {
            return Some(status);
        }
        // Waiting for a child's exit with a bound: std has no timed wait.
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
    None
}

/// A llama-server on loopback, from `cargo xtask setup`'s cache.
pub struct LlamaServer {
    pub addr: SocketAddr,
    child: Child,
    /// Its slots and the extra arguments it was started with (a restart starts it alike).
    slots: usize,
    extra: Vec<String>,
}

impl LlamaServer {
    /// Starts one with `slots` parallel slots and waits for /health.
    pub async fn start(slots: usize) -> Self {
        Self::start_with(slots, &[]).await
    }

    /// The same, with more of llama-server's own arguments.
    pub async fn start_with(slots: usize, extra: &[&str]) -> Self {
        let extra: Vec<String> = extra.iter().map(|a| (*a).to_owned()).collect();
        Self::start_at(free_addr(), slots, extra).await
    }

    /// One on `addr` (where a config or manifest names its port).
    pub async fn start_on(addr: SocketAddr, slots: usize) -> Self {
        Self::start_at(addr, slots, Vec::new()).await
    }

    async fn start_at(addr: SocketAddr, slots: usize, extra: Vec<String>) -> Self {
        let child = Self::spawn(addr, slots, &extra);
        let server = Self {
            addr,
            child,
            slots,
            extra,
        };
        server.ready().await;
        server
    }

    /// Starts it again on the same address (after `crash` or `kill`), with an empty cache.
    pub async fn restart(&mut self) {
        self.kill();
        self.child = Self::spawn(self.addr, self.slots, &self.extra);
        self.ready().await;
    }

    fn spawn(addr: SocketAddr, slots: usize, extra: &[String]) -> Child {
        let server = env_path("GUARD_LLAMA_SERVER");
        let model = env_path("GUARD_LLAMA_MODEL");
        Command::new(server)
            .arg("-m")
            .arg(model)
            .args(["--host", "127.0.0.1", "--port", &addr.port().to_string()])
            .args([
                "-np",
                &slots.to_string(),
                "--metrics",
                "-c",
                &(2048 * slots).to_string(),
            ])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start llama-server")
    }

    async fn ready(&self) {
        let polling = Polling::within(READY_BOUND, Duration::from_millis(50));
        until_with(polling, "llama-server is ready", async || {
            http::get(self.addr, "/health")
                .await
                .is_ok_and(|response| response.status == 200)
        })
        .await;
    }

    /// A counter or gauge from its own /metrics (`llamacpp:NAME`).
    pub async fn metric(&self, name: &str) -> f64 {
        let text = http::get(self.addr, "/metrics")
            .await
            .expect("llama /metrics")
            .text();
        crate::metric(&text, &format!("llamacpp:{name}")).unwrap_or(0.0)
    }

    pub fn kill(&mut self) {
        stop(&mut self.child, Duration::from_secs(2));
    }

    /// SIGKILL: it stops mid-answer, with no last word.
    pub fn crash(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for LlamaServer {
    fn drop(&mut self) {
        stop(&mut self.child, Duration::from_secs(2));
    }
}

fn env_path(name: &str) -> PathBuf {
    let path = std::env::var_os(name)
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            panic!("{name} is not set: run the tests through `cargo xtask test`, which sets it")
        });
    assert!(path.exists(), "{name}={} does not exist", path.display());
    path
}

/// The Ollama API emulator (tests/support/ollama_emulator.py): Ollama cannot be installed
/// here, so it stands in for the endpoints only Ollama has.
pub struct OllamaEmulator {
    pub addr: SocketAddr,
    child: Child,
}

impl OllamaEmulator {
    pub fn start(args: &[&str]) -> Self {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("support/ollama_emulator.py");
        let mut child = Command::new("python3")
            .arg(script)
            .args(["--port", "0"])
            .args(args)
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the Ollama emulator");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("read READY line");
        let port: u16 = line
            .strip_prefix("READY ")
            .and_then(|p| p.trim().parse().ok())
            .unwrap_or_else(|| panic!("emulator said {line:?}"));
        Self {
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            child,
        }
    }

    pub async fn stats(&self) -> serde_json::Value {
        http::get(self.addr, "/emulator/stats")
            .await
            .expect("stats")
            .json()
    }
}

impl Drop for OllamaEmulator {
    fn drop(&mut self) {
        stop(&mut self.child, Duration::from_secs(2));
    }
}

/// How to start guard.
#[derive(Clone, Debug)]
pub struct Launch {
    /// As nobody, without privileges.
    pub unprivileged: bool,
    /// GUARD_LOG.
    pub log_filter: String,
    /// Pinned to this CPU: every packet guard sends then leaves through one CPU's queue, in
    /// the order guard sent it (a close before the next connect, as a peer sees it).
    pub cpu: Option<usize>,
    /// Its open-file limit, soft and hard (so guard cannot raise it).
    pub nofile: Option<u64>,
}

impl Default for Launch {
    fn default() -> Self {
        Self {
            unprivileged: false,
            log_filter: std::env::var("GUARD_LOG").unwrap_or_else(|_| "info".to_owned()),
            cpu: None,
            nofile: None,
        }
    }
}

/// `guard run` with a config of the test's making, stopped on drop.
pub struct GuardProcess {
    pub listen: SocketAddr,
    pub metrics: SocketAddr,
    pub config_path: PathBuf,
    pub startup_log: Vec<String>,
    child: Child,
    log: Arc<Log>,
    /// How far `wait_for_log` has read.
    cursor: usize,
    _dir: TempDir,
}

/// guard's log lines, read by a thread as they come so its stderr pipe never fills.
#[derive(Default)]
struct Log {
    lines: Mutex<Vec<String>>,
    grew: Condvar,
    closed: std::sync::atomic::AtomicBool,
}

impl Log {
    fn follow(stderr: ChildStderr) -> Arc<Self> {
        let log = Arc::new(Self::default());
        let writer = Arc::clone(&log);
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if std::env::var_os("GUARD_TEST_ECHO").is_some() {
                    eprintln!("guard: {line}");
                }
                writer
                    .lines
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .push(line);
                writer.grew.notify_all();
            }
            writer
                .closed
                .store(true, std::sync::atomic::Ordering::SeqCst);
            writer.grew.notify_all();
        });
        log
    }
}

impl GuardProcess {
    /// Starts guard with `extra` TOML appended to a config that sets listen, metrics and
    /// upstream. Returns once it logs that it serves.
    pub fn start(upstream: SocketAddr, api: &str, extra: &str) -> Self {
        Self::start_as(upstream, api, extra, false)
    }

    pub fn start_as(upstream: SocketAddr, api: &str, extra: &str, unprivileged: bool) -> Self {
        let filter = std::env::var("GUARD_LOG").unwrap_or_else(|_| "info".to_owned());
        Self::start_with(upstream, api, extra, unprivileged, &filter)
    }

    /// Starts guard with a log filter of the caller's (GUARD_LOG syntax).
    pub fn start_with(
        upstream: SocketAddr,
        api: &str,
        extra: &str,
        unprivileged: bool,
        log_filter: &str,
    ) -> Self {
        let launch = Launch {
            unprivileged,
            log_filter: log_filter.to_owned(),
            ..Launch::default()
        };
        Self::launch(upstream, api, extra, &launch)
    }

    /// Starts guard as `launch` says.
    pub fn launch(upstream: SocketAddr, api: &str, extra: &str, launch: &Launch) -> Self {
        let Launch {
            unprivileged,
            log_filter,
            cpu,
            nofile,
        } = launch;
        let unprivileged = *unprivileged;
        let dir = TempDir::new(&format!("guard-e2e-{}", free_addr().port()));
        // The test's own settings, with the addresses this harness chose merged in; a test
        // that names its own `server.listen` keeps it (`listen` is then its first address).
        let mut config: toml::Table = extra.parse().expect("the test's config is TOML");
        let listen = own_listen(&config).unwrap_or_else(free_addr);
        // `free_addr` hands each port once, but a test's own listen may be any port.
        let metrics = std::iter::repeat_with(free_addr)
            .find(|addr| *addr != listen)
            .expect("a second free port");
        let own = own_listen(&config).is_some();
        let mut set = |table: &str, key: &str, value: String| {
            config
                .entry(table)
                .or_insert_with(|| toml::Value::Table(toml::Table::new()))
                .as_table_mut()
                .expect("a table")
                .insert(key.to_owned(), toml::Value::String(value));
        };
        if !own {
            set("server", "listen", listen.to_string());
        }
        set("metrics", "listen", metrics.to_string());
        set("upstream", "url", format!("http://{upstream}"));
        set("upstream", "api", api.to_owned());
        let config = config.to_string();
        let config_path = dir.0.join("guard.toml");
        std::fs::write(&config_path, config).expect("write config");
        // prlimit and taskset exec what follows them: the child's pid is guard's.
        let mut wrappers: Vec<String> = Vec::new();
        if let Some(nofile) = nofile {
            wrappers.extend(["prlimit".to_owned(), format!("--nofile={nofile}:{nofile}")]);
        }
        if let Some(cpu) = cpu {
            wrappers.extend(["taskset".to_owned(), "-c".to_owned(), cpu.to_string()]);
        }
        let mut command = match wrappers.split_first() {
            Some((first, rest)) => {
                let mut wrapped = Command::new(first);
                wrapped.args(rest).arg(guard_bin());
                wrapped
            }
            None => Command::new(guard_bin()),
        };
        command
            .args(["run", "--config"])
            .arg(&config_path)
            .env("GUARD_LOG", log_filter)
            .stderr(Stdio::piped());
        if unprivileged {
            use std::os::unix::{fs::PermissionsExt as _, process::CommandExt as _};
            std::fs::set_permissions(&dir.0, std::fs::Permissions::from_mode(0o755))
                .expect("chmod");
            command.uid(65534).gid(65534);
        }
        let mut child = command.spawn().expect("start guard");
        let log = Log::follow(child.stderr.take().expect("stderr"));
        let mut guard = Self {
            listen,
            metrics,
            config_path,
            startup_log: Vec::new(),
            child,
            log,
            cursor: 0,
            _dir: dir,
        };
        guard.startup_log = guard.wait_for_log("guard is serving");
        guard
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits for a log line containing `text` after those already waited for; returns the
    /// lines up to it.
    pub fn wait_for_log(&mut self, text: &str) -> Vec<String> {
        let deadline = Instant::now() + READY_BOUND;
        let mut lines = self
            .log
            .lines
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        loop {
            if let Some(offset) = lines[self.cursor..].iter().position(|l| l.contains(text)) {
                let found = lines[self.cursor..=self.cursor + offset].to_vec();
                self.cursor += offset + 1;
                return found;
            }
            let closed = self.log.closed.load(std::sync::atomic::Ordering::SeqCst);
            assert!(
                !closed,
                "guard exited before logging `{text}`: {:#?}",
                &lines[self.cursor..]
            );
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(!left.is_zero(), "guard never logged `{text}`");
            lines = self
                .log
                .grew
                .wait_timeout(lines, left)
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        }
    }

    /// Every line guard has logged so far.
    pub fn log_lines(&self) -> Vec<String> {
        self.log
            .lines
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// A sample from guard's /metrics, by exact series name (with labels).
    pub async fn metric(&self, series: &str) -> f64 {
        let text = http::get(self.metrics, "/metrics")
            .await
            .expect("guard /metrics")
            .text();
        crate::metric(&text, series).unwrap_or(0.0)
    }

    pub async fn metrics_text(&self) -> String {
        http::get(self.metrics, "/metrics")
            .await
            .expect("guard /metrics")
            .text()
    }

    /// Its `/status` document.
    pub async fn status(&self) -> serde_json::Value {
        http::get(self.metrics, "/status")
            .await
            .expect("guard /status")
            .json()
    }

    /// Sends a batch request on a connection of its own and waits until guard runs it (the
    /// only one running): the connection comes back unread, to leave or to keep.
    pub async fn running_batch(&self, path: &str, body: &serde_json::Value) -> TcpStream {
        let running =
            http::raw_request(self.listen, path, &[("x-guard-class", "batch")], body).await;
        self.wait_for_metric("guard_inflight{class=\"batch\"}", 1.0)
            .await;
        running
    }

    /// Waits until a metric reaches `value` (a state the test waits for, not a time).
    pub async fn wait_for_metric(&self, series: &str, value: f64) {
        let polling = Polling::within(READY_BOUND, Duration::from_millis(10));
        until_with(polling, &format!("{series} reaches {value}"), async || {
            self.metric(series).await >= value
        })
        .await;
    }

    /// Rewrites the config file with `from` replaced by `to`, then SIGHUP.
    pub fn edit_config_and_reload(&self, from: &str, to: &str) {
        let config = std::fs::read_to_string(&self.config_path).expect("read config");
        assert!(config.contains(from), "{from} is not in the config");
        std::fs::write(&self.config_path, config.replace(from, to)).expect("write config");
        self.hangup();
    }

    /// Waits for the next log line with `text`, and asserts that it names `key`.
    pub fn wait_for_log_naming(&mut self, text: &str, key: &str) {
        let lines = self.wait_for_log(text);
        assert!(
            lines.last().is_some_and(|l| l.contains(key)),
            "{key} not named: {lines:?}"
        );
    }

    /// SIGHUP: reload the config file.
    pub fn hangup(&self) {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.pid() as i32),
            nix::sys::signal::Signal::SIGHUP,
        )
        .expect("SIGHUP");
    }

    /// SIGTERM; returns the exit status (None if it had to be killed).
    pub fn terminate(&mut self) -> Option<std::process::ExitStatus> {
        stop(&mut self.child, Duration::from_secs(30))
    }
}

impl Drop for GuardProcess {
    fn drop(&mut self) {
        stop(&mut self.child, Duration::from_secs(10));
    }
}

/// The first of the addresses a test's config names in `server.listen`, if it names any.
fn own_listen(config: &toml::Table) -> Option<SocketAddr> {
    let listen = config.get("server")?.get("listen")?;
    let first = match listen {
        toml::Value::Array(addrs) => addrs.first()?,
        one => one,
    };
    first.as_str()?.parse().ok()
}
