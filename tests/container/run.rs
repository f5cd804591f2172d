//! One run of the translated pod under podman beside a real llama-server, and what it must
//! show: eBPF attached, a real client's close reaped, the batch cgroup frozen and restored,
//! /metrics and /status answering, capabilities within the manifest's grant, a clean stop.

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::OnceLock,
    time::{Duration, Instant},
};

use guard_tests::{
    ChildGuard, TempDir, cgroup2_root,
    http::{self, Leave, leave, raw_request, read_until},
    process_cpu_seconds,
    servers::LlamaServer,
};
use serde_json::json;

use crate::pod::{Manifests, PodmanRun, translate};

/// How podman runs here: runc (crun refuses a hybrid cgroup layout), cgroupfs (no systemd
/// manager), no default ulimits (raising them needs CAP_SYS_RESOURCE, which a sandboxed host
/// may lack). The same on a plain Debian 12 host.
const CONTAINERS_CONF: &str = "[containers]\ndefault_ulimits = []\n\n[engine]\nruntime = \"runc\"\ncgroup_manager = \"cgroupfs\"\n";
/// How long guard, llama-server and the kernel may take for each thing waited on.
const BOUND: Duration = Duration::from_secs(60);

fn podman() -> Command {
    static CONF: OnceLock<PathBuf> = OnceLock::new();
    let conf = CONF.get_or_init(|| {
        let path =
            std::env::temp_dir().join(format!("guard-containers-{}.conf", std::process::id()));
        std::fs::write(&path, CONTAINERS_CONF).expect("write containers.conf");
        path
    });
    let mut command = Command::new("podman");
    command
        .args(["--runtime", "runc", "--cgroup-manager", "cgroupfs"])
        .env("CONTAINERS_CONF", conf)
        .stdin(Stdio::null());
    command
}

/// Ok where podman's storage works (`podman info`): it can hold the image; the reason in one
/// line otherwise.
pub fn has_storage() -> Result<(), String> {
    last_error(podman().args(["info", "--format", "{{.Store.GraphDriverName}}"]))
}

/// Ok where podman starts the image (`guard --version`); the reason in one line otherwise.
pub fn can_start_containers(image: &str) -> Result<(), String> {
    last_error(podman().args([
        "run",
        "--rm",
        "--pull=never",
        "--network=none",
        image,
        "--version",
    ]))
}

/// Ok where `command` succeeds, else the last line it wrote to stderr.
fn last_error(command: &mut Command) -> Result<(), String> {
    let out = command.output().map_err(|e| e.to_string())?;
    if out.status.success() {
        return Ok(());
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    Err(stderr
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("no output")
        .to_owned())
}

/// Runs the pod and checks it; Ok with what it saw, Err with the first check that failed.
pub async fn check(manifests: &Manifests) -> Result<String, Failed> {
    let dir = TempDir::new("guard-container");
    let run = translate(manifests, &dir.0)?;
    let node = Node::prepare(&run)?;
    let llama =
        LlamaServer::start_on(([127, 0, 0, 1], node.upstream_port).into(), node.slots).await;
    let container = Container::start(&run)?;
    match checks(&run, &node, &llama, &container).await {
        Ok(seen) => {
            let stopped = container.stop(run.grace_s)?;
            Ok(format!(
                "{seen}; {stopped}\nguard's log:\n{}",
                container.logs()
            ))
        }
        Err(failure) => Err(Failed {
            failure,
            logs: Some(container.logs()),
        }),
    }
}

/// How the privileges check fails where guard's eBPF program is not attached.
pub const EBPF_NOT_ATTACHED: &str = "guard's eBPF program is not attached";

/// The first check that failed, and guard's log then where guard had started.
#[derive(Debug)]
pub struct Failed {
    pub failure: String,
    pub logs: Option<String>,
}

impl From<String> for Failed {
    fn from(failure: String) -> Self {
        Self {
            failure,
            logs: None,
        }
    }
}

impl std::fmt::Display for Failed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.failure)?;
        match &self.logs {
            Some(logs) => write!(f, "\nguard's log (last lines):\n{logs}"),
            None => Ok(()),
        }
    }
}

async fn checks(
    run: &PodmanRun,
    node: &Node,
    llama: &LlamaServer,
    container: &Container,
) -> Result<String, String> {
    let metrics = std::net::SocketAddr::from(([127, 0, 0, 1], node.metrics_port));
    let probe = std::net::SocketAddr::from(([127, 0, 0, 1], run.ready.1));
    poll("the readiness probe answers 200", async || {
        http::get(probe, &run.ready.0)
            .await
            .is_ok_and(|r| r.status == 200)
    })
    .await?;
    let privileges = privileges(run, metrics, container).await?;
    let reaped = reap(node, llama, metrics).await?;
    let frozen = freeze_and_restore(node, metrics).await?;
    Ok(format!("{privileges}; {reaped}; {frozen}"))
}

/// /status and /metrics: eBPF attached, capabilities held within those granted, and the
/// container's bounding set exactly the manifest's.
async fn privileges(
    run: &PodmanRun,
    metrics: std::net::SocketAddr,
    container: &Container,
) -> Result<String, String> {
    let status = http::get(metrics, "/status").await?.json();
    if status["ebpf"]["attached"] != true {
        return Err(format!(
            "{EBPF_NOT_ATTACHED}: {}",
            status["ebpf"]["unavailable_reason"]
        ));
    }
    let text = http::get(metrics, "/metrics").await?.text();
    if guard_tests::metric(&text, "guard_ebpf_attached") != Some(1.0) {
        return Err("/metrics does not say guard_ebpf_attached 1".into());
    }
    let granted: Vec<String> = run
        .capabilities
        .iter()
        .map(|c| format!("CAP_{c}"))
        .collect();
    let held: Vec<String> =
        serde_json::from_value(status["capabilities"].clone()).map_err(|e| e.to_string())?;
    if let Some(extra) = held.iter().find(|c| !granted.contains(c)) {
        return Err(format!(
            "guard holds {extra}, which the manifest does not grant"
        ));
    }
    let mut bounding = container.bounding_set()?;
    let mut expected = granted.clone();
    bounding.sort();
    expected.sort();
    if bounding != expected {
        return Err(format!(
            "the container's bounding set is {bounding:?}, the manifest grants {expected:?}"
        ));
    }
    Ok(format!(
        "eBPF attached; capabilities held {held:?} of the granted {granted:?} (bounding set {bounding:?})"
    ))
}

/// A streaming batch client on the real llama-server closes: guard's eBPF program sees it,
/// guard aborts the generation, the slot frees.
async fn reap(
    node: &Node,
    llama: &LlamaServer,
    metrics: std::net::SocketAddr,
) -> Result<String, String> {
    let listen = std::net::SocketAddr::from(([127, 0, 0, 1], node.listen_port));
    let series = "guard_reaped_total{class=\"batch\",stage=\"running\"}";
    let before = read_metric(metrics, series).await?;
    let body = json!({"messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 2000, "stream": true});
    let mut stream = raw_request(
        listen,
        "/v1/chat/completions",
        &[("x-guard-class", "batch")],
        &body,
    )
    .await;
    read_until(&mut stream, |seen| seen.contains("data: "))
        .await
        .map_err(|seen| format!("the stream ended before its first token: {seen}"))?;
    let events = "guard_ebpf_events_total";
    let events_before = read_metric(metrics, events).await?;
    let left = Instant::now();
    leave(stream, Leave::Fin);
    // Only connections to guard's listener are watched: the next events are this close.
    poll("guard's eBPF program sees the close", async || {
        metric(metrics, events)
            .await
            .is_some_and(|n| n > events_before)
    })
    .await?;
    poll("guard reaps the closed stream", async || {
        metric(metrics, series).await.is_some_and(|n| n > before)
    })
    .await?;
    poll("llama-server's slot frees", async || {
        llama.metric("requests_processing").await == 0.0
    })
    .await?;
    let freed = left.elapsed();
    // The reap is timed from the kernel's event where it came first (hyper or the relay may
    // notice the close a moment before it does).
    let kernel = read_metric(metrics, "guard_reap_latency_seconds_count").await?;
    let timed = match kernel >= 1.0 {
        true => {
            let latency = read_metric(metrics, "guard_reap_latency_seconds_sum").await? / kernel;
            format!("{:.1} ms after the kernel's close event", latency * 1000.0)
        }
        false => "before the kernel's close event reached it".to_owned(),
    };
    Ok(format!(
        "the kernel's close event seen; reaped a closed stream {timed}, llama-server's slot free {} ms after the close",
        freed.as_millis()
    ))
}

/// Batch work fills every slot; an interactive request waits past its risk point: guard
/// freezes the batch cgroup through the mounted class cgroups, records the original in the
/// state hostPath, and thaws it once the batch clients are gone and the hold time is over.
async fn freeze_and_restore(node: &Node, metrics: std::net::SocketAddr) -> Result<String, String> {
    let listen = std::net::SocketAddr::from(([127, 0, 0, 1], node.listen_port));
    let freeze_file = node.batch_cgroup.join("cgroup.freeze");
    let busy = busy_in(&node.batch_cgroup)?;
    let long = json!({"prompt": "Write a long story.", "n_predict": 100_000, "ignore_eos": true});
    let mut batch = Vec::new();
    for _ in 0..node.slots {
        batch.push(raw_request(listen, "/completion", &[("x-guard-class", "batch")], &long).await);
    }
    let inflight = "guard_inflight{class=\"batch\"}";
    poll("batch work fills every slot", async || {
        metric(metrics, inflight)
            .await
            .is_some_and(|n| n >= node.slots as f64)
    })
    .await?;
    let short = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    let interactive = tokio::spawn(async move {
        http::post(
            listen,
            "/v1/chat/completions",
            &[("x-guard-class", "interactive")],
            &short,
        )
        .await
        .status
    });
    poll("guard freezes the batch class", async || {
        metric(metrics, "guard_class_throttled{class=\"batch\"}").await == Some(1.0)
    })
    .await?;
    let frozen = read(&freeze_file);
    if frozen != "1" {
        return Err(format!(
            "guard says batch is throttled, {} reads {frozen:?}",
            freeze_file.display()
        ));
    }
    // The kernel's word that every task in it has stopped.
    let events = node.batch_cgroup.join("cgroup.events");
    poll("the kernel reports the batch cgroup frozen", async || {
        read(&events).lines().any(|line| line == "frozen 1")
    })
    .await?;
    let cpu = cpu_over(busy.0.id(), Duration::from_millis(300));
    if cpu > 0.02 {
        return Err(format!(
            "the frozen batch process used {cpu} CPU s in 0.3 s"
        ));
    }
    let records = records(&node.state_dir);
    if records == 0 {
        return Err(format!(
            "no record of the original value in the state hostPath {}",
            node.state_dir.display()
        ));
    }
    for client in batch {
        leave(client, Leave::Fin);
    }
    let answered = interactive.await.map_err(|e| e.to_string())?;
    if answered != 200 {
        return Err(format!("the interactive request got {answered}"));
    }
    let risk_over = Instant::now();
    poll("guard restores the batch cgroup", async || {
        read(&freeze_file) == "0"
    })
    .await?;
    Ok(format!(
        "froze the batch cgroup (cgroup.freeze 1, {records} record(s) in the state dir), thawed it {:.1} s after the interactive request was answered",
        risk_over.elapsed().as_secs_f64()
    ))
}

/// The node as the pod finds it: the config's ports, the class cgroups a cgroup2 directory,
/// the batch class's cgroup made.
struct Node {
    listen_port: u16,
    metrics_port: u16,
    upstream_port: u16,
    slots: usize,
    batch_cgroup: PathBuf,
    state_dir: PathBuf,
    _classes: ClassCgroups,
}

impl Node {
    fn prepare(run: &PodmanRun) -> Result<Self, String> {
        let config_mount = mount_at(run, Path::new("/etc/guard"))?;
        let text = std::fs::read_to_string(config_mount.host.join("guard.toml"))
            .map_err(|e| format!("guard.toml: {e}"))?;
        let config: toml::Value = toml::from_str(&text).map_err(|e| e.to_string())?;
        let port = |value: &toml::Value| -> Result<u16, String> {
            let text = value.as_str().ok_or("an address")?;
            let port = text.rsplit(':').next().ok_or("a port")?;
            port.trim_end_matches(|c: char| !c.is_ascii_digit())
                .parse()
                .map_err(|_| format!("no port in {text}"))
        };
        let cgroup = config["class"]["batch"]
            .get("cgroup")
            .and_then(toml::Value::as_str)
            .ok_or("the config map gives the batch class no cgroup")?;
        let (host_cgroup, mount) = host_path(run, Path::new(cgroup))?;
        if mount.read_only {
            return Err(format!(
                "the batch cgroup {cgroup} is in the read-only mount {}",
                mount.container.display()
            ));
        }
        let state = config["risk"]
            .get("state_dir")
            .and_then(toml::Value::as_str)
            .unwrap_or("/var/lib/guard");
        let (state_dir, _) = host_path(run, Path::new(state))?;
        let classes = ClassCgroups::prepare(&mount.host)?;
        std::fs::create_dir_all(&host_cgroup)
            .map_err(|e| format!("{}: {e}", host_cgroup.display()))?;
        Ok(Self {
            listen_port: port(&config["server"]["listen"])?,
            metrics_port: port(&config["metrics"]["listen"])?,
            upstream_port: port(&config["upstream"]["url"])?,
            slots: config["upstream"]
                .get("max_concurrency")
                .and_then(toml::Value::as_integer)
                .unwrap_or(1) as usize,
            batch_cgroup: host_cgroup,
            state_dir,
            _classes: classes,
        })
    }
}

/// A CPU-bound process in `cgroup`, as a batch job the node runs there; killed on drop.
fn busy_in(cgroup: &Path) -> Result<ChildGuard, String> {
    let busy = ChildGuard(
        Command::new("sh")
            .args(["-c", "while :; do :; done"])
            .spawn()
            .map_err(|e| e.to_string())?,
    );
    std::fs::write(cgroup.join("cgroup.procs"), busy.0.id().to_string())
        .map_err(|e| format!("moving the busy process into {}: {e}", cgroup.display()))?;
    Ok(busy)
}

/// The mount whose container path is `at`.
fn mount_at<'a>(run: &'a PodmanRun, at: &Path) -> Result<&'a crate::pod::Mount, String> {
    run.mounts
        .iter()
        .find(|m| m.container == at)
        .ok_or_else(|| format!("nothing is mounted at {}", at.display()))
}

/// Where a path inside the container lies on the node, through the innermost mount.
fn host_path<'a>(
    run: &'a PodmanRun,
    inside: &Path,
) -> Result<(PathBuf, &'a crate::pod::Mount), String> {
    let mount = run
        .mounts
        .iter()
        .filter(|m| inside.starts_with(&m.container))
        .max_by_key(|m| m.container.components().count())
        .ok_or_else(|| format!("{} is in no mount", inside.display()))?;
    let rest = inside
        .strip_prefix(&mount.container)
        .map_err(|e| e.to_string())?;
    Ok((mount.host.join(rest), mount))
}

/// The class cgroups' hostPath as a cgroup2 directory. On a node with the unified layout it
/// is one already; on a hybrid host (cgroup2 under /sys/fs/cgroup/unified) the test binds
/// the cgroup2 directory of the same name there, as such a node would have it, and undoes
/// that on drop.
struct ClassCgroups {
    bound: Option<PathBuf>,
    made: Option<PathBuf>,
}

impl ClassCgroups {
    fn prepare(host: &Path) -> Result<Self, String> {
        if is_cgroup2(host) {
            return Ok(Self {
                bound: None,
                made: None,
            });
        }
        let name = host.file_name().ok_or("a class cgroups path")?;
        let source = cgroup2_root().join(name);
        let made = (!source.exists()).then(|| source.clone());
        std::fs::create_dir_all(&source).map_err(|e| format!("{}: {e}", source.display()))?;
        let status = Command::new("mount")
            .arg("--bind")
            .arg(&source)
            .arg(host)
            .status()
            .map_err(|e| e.to_string())?;
        if !status.success() || !is_cgroup2(host) {
            return Err(format!(
                "cannot bind {} to {}",
                source.display(),
                host.display()
            ));
        }
        Ok(Self {
            bound: Some(host.to_owned()),
            made,
        })
    }
}

impl Drop for ClassCgroups {
    fn drop(&mut self) {
        if let Some(host) = &self.bound {
            let _ = Command::new("umount").arg(host).status();
        }
        if let Some(made) = &self.made {
            let _ = std::fs::remove_dir(made);
        }
    }
}

fn is_cgroup2(path: &Path) -> bool {
    nix::sys::statfs::statfs(path)
        .is_ok_and(|fs| fs.filesystem_type() == nix::sys::statfs::CGROUP2_SUPER_MAGIC)
}

/// The batch cgroup is emptied and removed when the test is done with it.
impl Drop for Node {
    fn drop(&mut self) {
        let _ = std::fs::write(self.batch_cgroup.join("cgroup.freeze"), "0");
        let _ = std::fs::remove_dir(&self.batch_cgroup);
    }
}

/// The running container; removed on drop.
struct Container {
    name: String,
}

impl Container {
    fn start(run: &PodmanRun) -> Result<Self, String> {
        let name = format!("guard-test-{}", std::process::id());
        let _ = podman().args(["rm", "--force", &name]).output();
        let out = podman()
            .args(["run", "--detach", "--name", &name])
            .args(&run.options)
            .arg(&run.image)
            .args(&run.args)
            .output()
            .map_err(|e| e.to_string())?;
        if !out.status.success() {
            return Err(format!(
                "podman run failed: {}",
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        Ok(Self { name })
    }

    fn inspect(&self, format: &str) -> Result<String, String> {
        let out = podman()
            .args(["inspect", "--format", format, &self.name])
            .output()
            .map_err(|e| e.to_string())?;
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    }

    /// CapBnd of the container's process, by name (`CAP_BPF`).
    fn bounding_set(&self) -> Result<Vec<String>, String> {
        let pid = self.inspect("{{.State.Pid}}")?;
        let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
            .map_err(|e| format!("guard's /proc/{pid}/status: {e}"))?;
        let mask = status
            .lines()
            .find_map(|l| l.strip_prefix("CapBnd:"))
            .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
            .ok_or("no CapBnd")?;
        Ok(caps::all()
            .into_iter()
            .filter(|cap| mask & cap.bitmask() != 0)
            .map(|cap| cap.to_string())
            .collect())
    }

    fn logs(&self) -> String {
        let out = podman().args(["logs", "--tail", "40", &self.name]).output();
        out.map(|o| {
            format!(
                "{}{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            )
        })
        .unwrap_or_default()
    }

    /// `podman stop` with the pod's grace period: guard drains and exits 0.
    fn stop(&self, grace_s: u64) -> Result<String, String> {
        let started = Instant::now();
        let out = podman()
            .args(["stop", "--time", &grace_s.to_string(), &self.name])
            .output()
            .map_err(|e| e.to_string())?;
        if !out.status.success() {
            return Err(format!(
                "podman stop: {}",
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        let code = self.inspect("{{.State.ExitCode}}")?;
        if code != "0" {
            return Err(format!(
                "guard exited with {code} on SIGTERM\n{}",
                self.logs()
            ));
        }
        Ok(format!(
            "stopped cleanly in {:.1} s",
            started.elapsed().as_secs_f64()
        ))
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        let _ = podman()
            .args(["rm", "--force", "--time", "0", &self.name])
            .output();
    }
}

/// One of guard's series: 0 where guard has not written it yet (a labelled series before its
/// first count), None where /metrics does not answer.
async fn metric(addr: std::net::SocketAddr, series: &str) -> Option<f64> {
    let response = http::get(addr, "/metrics").await.ok()?;
    Some(guard_tests::metric(&response.text(), series).unwrap_or(0.0))
}

/// `metric`, where /metrics not answering is a failure.
async fn read_metric(addr: std::net::SocketAddr, series: &str) -> Result<f64, String> {
    metric(addr, series)
        .await
        .ok_or_else(|| format!("guard's /metrics does not answer (reading {series})"))
}

/// Polls `done` every 50 ms until it holds; Err after [`BOUND`].
async fn poll(what: &str, done: impl AsyncFnMut() -> bool) -> Result<(), String> {
    let polling = guard_testkit::Polling::within(BOUND, Duration::from_millis(50));
    guard_testkit::try_until_with(polling, what, done).await
}

fn read(file: &Path) -> String {
    std::fs::read_to_string(file)
        .map(|s| s.trim().to_owned())
        .unwrap_or_default()
}

/// Record files (`*.orig`) with an outstanding original value.
fn records(dir: &Path) -> usize {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .filter(|e| e.path().to_string_lossy().ends_with(".orig"))
                .filter(|e| e.metadata().is_ok_and(|m| m.len() > 0))
                .count()
        })
        .unwrap_or(0)
}

/// CPU seconds `pid` used over a measurement interval.
fn cpu_over(pid: u32, interval: Duration) -> f64 {
    let before = process_cpu_seconds(pid);
    // The interval is what is measured, not a wait for something to happen.
    std::thread::sleep(interval);
    process_cpu_seconds(pid) - before
}
