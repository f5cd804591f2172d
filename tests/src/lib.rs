//! Shared pieces of guard's integration tests: root checks, RAII guards for cgroups, and
//! waiting on event streams without sleeping. The scripted upstream and waiting for a state
//! by polling are guard-testkit's, shared with guard's own tests.

#![forbid(unsafe_code)]

use std::{
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
    time::Duration,
};

use tokio::sync::mpsc;

pub mod body;
pub mod http;
pub mod peers;
pub mod scripted;
pub mod servers;
pub mod workload;

/// How long a test waits for something the kernel should deliver at once; reaching it fails.
pub const DELIVERY_BOUND: Duration = Duration::from_secs(20);

/// Panics unless the test runs as root: these tests load eBPF and write cgroups.
pub fn require_root() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "this test needs root (eBPF, cgroups): run it through `cargo xtask test` as root"
    );
}

/// Receives items until `done` says the collection is complete; panics after
/// [`DELIVERY_BOUND`] with what arrived so far.
pub async fn collect_until<T: std::fmt::Debug>(
    receiver: &mut mpsc::Receiver<T>,
    done: impl FnMut(&[T]) -> bool,
) -> Vec<T> {
    collect_until_within(receiver, DELIVERY_BOUND, done).await
}

/// As [`collect_until`], with a bound of the caller's: a large burst inside an emulated
/// guest (`cargo xtask kernels`) takes minutes where this host takes a second.
pub async fn collect_until_within<T: std::fmt::Debug>(
    receiver: &mut mpsc::Receiver<T>,
    bound: std::time::Duration,
    mut done: impl FnMut(&[T]) -> bool,
) -> Vec<T> {
    let mut seen = Vec::new();
    // `done` sees each new item once: callers may keep state in it.
    let collect = async {
        let mut complete = done(&seen);
        while !complete {
            let Some(item) = receiver.recv().await else {
                break;
            };
            seen.push(item);
            complete = done(&seen);
        }
        complete
    };
    if !tokio::time::timeout(bound, collect).await.unwrap_or(false) {
        let tail: Vec<_> = seen.iter().rev().take(10).collect();
        panic!(
            "not delivered within {bound:?}: {} items arrived, last ones {tail:?}",
            seen.len()
        );
    }
    seen
}

/// The cgroup v2 mount point.
pub fn cgroup2_root() -> PathBuf {
    let mounts = std::fs::read_to_string("/proc/self/mounts").expect("read /proc/self/mounts");
    mounts
        .lines()
        .find(|line| line.split(' ').nth(2) == Some("cgroup2"))
        .and_then(|line| line.split(' ').nth(1))
        .map(PathBuf::from)
        .expect("no cgroup2 filesystem mounted")
}

/// A cgroup made for one test; removed on drop, its processes moved back to the parent.
pub struct TestCgroup {
    pub path: PathBuf,
}

impl TestCgroup {
    /// Makes `<parent>/<name>-<pid>`.
    pub fn new(parent: &Path, name: &str) -> Self {
        let path = parent.join(format!("{name}-{}", std::process::id()));
        std::fs::create_dir_all(&path)
            .unwrap_or_else(|err| panic!("create cgroup {}: {err}", path.display()));
        Self { path }
    }

    /// The cgroup id the kernel reports (`bpf_get_current_cgroup_id`): the directory's inode.
    pub fn id(&self) -> u64 {
        std::fs::metadata(&self.path).expect("stat cgroup").ino()
    }

    /// Moves a process into this cgroup.
    pub fn add(&self, pid: u32) {
        std::fs::write(self.path.join("cgroup.procs"), pid.to_string())
            .unwrap_or_else(|err| panic!("move {pid} into {}: {err}", self.path.display()));
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        // Never leave a test's cgroup held back, whatever the test did.
        let _ = std::fs::write(self.path.join("cgroup.freeze"), "0");
        let _ = std::fs::write(self.path.join("freezer.state"), "THAWED");
        let _ = std::fs::write(self.path.join("cpu.cfs_quota_us"), "-1");
        let parent = self.path.parent().map(|p| p.join("cgroup.procs"));
        if let (Ok(procs), Some(parent)) = (
            std::fs::read_to_string(self.path.join("cgroup.procs")),
            parent,
        ) {
            for pid in procs.lines() {
                let _ = std::fs::write(&parent, pid);
            }
        }
        if let Err(err) = std::fs::remove_dir(&self.path) {
            eprintln!("could not remove cgroup {}: {err}", self.path.display());
        }
    }
}

/// A child process killed and reaped on drop.
pub struct ChildGuard(pub std::process::Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The `guard` binary cargo built beside this test binary (target/<profile>/guard).
pub fn guard_bin() -> PathBuf {
    if let Some(path) = std::env::var_os("GUARD_BIN") {
        return PathBuf::from(path);
    }
    let exe = std::env::current_exe().expect("current exe");
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("test binaries live in target/<profile>/deps");
    let bin = profile_dir.join("guard");
    assert!(
        bin.exists(),
        "{} is missing: build it first (`cargo build -p guard-cli`, or `cargo xtask test`)",
        bin.display()
    );
    bin
}

/// The workspace's root directory.
pub fn workspace() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

/// `cargo xtask ARGS` in the workspace, offline (the tests run with only a loopback: what it
/// builds was fetched and cached before); panics unless it succeeds.
pub fn xtask(args: &[&std::ffi::OsStr]) -> std::process::Output {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let output = std::process::Command::new(cargo)
        .arg("xtask")
        .args(args)
        .env("CARGO_NET_OFFLINE", "true")
        .current_dir(workspace())
        .output()
        .expect("start cargo xtask");
    assert!(
        output.status.success(),
        "cargo xtask {args:?} failed ({}):\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

/// Asserts `systemd-analyze verify` succeeded and said nothing of guard's unit.
pub fn assert_unit_verifies(verify: &std::process::Output) {
    let report = String::from_utf8_lossy(&verify.stderr);
    assert!(
        verify.status.success(),
        "systemd-analyze verify failed ({}):\n{report}",
        verify.status
    );
    let about_unit: Vec<&str> = report
        .lines()
        .filter(|line| line.contains("guard.service"))
        .collect();
    assert!(
        about_unit.is_empty(),
        "systemd-analyze verify warns about the unit:\n{}",
        about_unit.join("\n")
    );
}

/// "Overall exposure level for guard.service: 2.4 OK" (`systemd-analyze security`) as
/// tenths (24).
pub fn exposure_tenths(report: &str) -> Option<u32> {
    let level = report
        .lines()
        .find_map(|line| line.split_once("Overall exposure level for guard.service: "))?
        .1
        .split_whitespace()
        .next()?;
    let (whole, tenth) = level.split_once('.')?;
    let tenth: u32 = tenth.parse().ok().filter(|t| *t < 10)?;
    Some(whole.parse::<u32>().ok()? * 10 + tenth)
}

/// A loopback address with a port that was free a moment ago, below the kernel's ephemeral
/// range: a port from that range, once freed, may be handed to any socket's `bind(0)` or
/// outgoing connection (HAProxy's checks, a client's) before the server a test starts binds
/// it. Each call in a process takes the next port; processes start apart.
pub fn free_addr() -> std::net::SocketAddr {
    free_addr_on(std::net::Ipv4Addr::LOCALHOST.into())
}

/// As `free_addr`, on `ip` (IPv6's loopback, say).
pub fn free_addr_on(ip: std::net::IpAddr) -> std::net::SocketAddr {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let low = FIXED_PORTS_FROM;
    let span = EPHEMERAL_LOW.saturating_sub(low);
    let start = std::process::id().wrapping_mul(7_919);
    for _ in 0..span {
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let port = u16::try_from(low + start.wrapping_add(n) % span).expect("a port");
        if let Ok(addr) = std::net::TcpListener::bind((ip, port)).and_then(|l| l.local_addr()) {
            return addr;
        }
    }
    std::net::TcpListener::bind((ip, 0))
        .and_then(|l| l.local_addr())
        .unwrap_or_else(|err| panic!("no free port on {ip}: {err}"))
}

/// The lowest port `free_addr` hands out: above the well-known and most registered ones.
const FIXED_PORTS_FROM: u32 = 10_000;

/// The first port of the kernel's ephemeral range (`ip_local_port_range`), read once; 32768
/// where it cannot be read.
static EPHEMERAL_LOW: std::sync::LazyLock<u32> = std::sync::LazyLock::new(|| {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768)
});

/// A temporary directory removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(name: &str) -> Self {
        let path = std::env::temp_dir().join(format!("{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).expect("create temp dir");
        Self(path)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A sample's value from Prometheus text, by exact series (`name` or `name{labels}`).
pub fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .find_map(|line| {
            let (name, value) = line.rsplit_once(' ')?;
            (name == series).then(|| value.parse().ok())?
        })
}

/// Serialises tests that time real servers: on two cores, parallel ones would disturb them.
pub async fn serial() -> tokio::sync::MutexGuard<'static, ()> {
    static LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    LOCK.lock().await
}

/// A process, for reading its /proc files.
fn process(pid: u32) -> procfs::process::Process {
    procfs::process::Process::new(i32::try_from(pid).expect("a pid")).expect("the process")
}

/// CPU seconds (user + system) a process has used, from /proc/PID/stat.
pub fn process_cpu_seconds(pid: u32) -> f64 {
    let stat = process(pid).stat().expect("stat");
    (stat.utime + stat.stime) as f64 / procfs::ticks_per_second() as f64
}

/// Resident memory of a process, from /proc/PID/status.
pub fn rss_bytes(pid: u32) -> u64 {
    let status = process(pid).status().expect("status");
    status.vmrss.expect("VmRSS") * 1024
}

/// Which parts of a benchmark its command line asks for (`cargo xtask bench NAME PART...`):
/// every part when it names none.
pub fn bench_parts() -> impl Fn(&str) -> bool {
    let only: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    move |part| only.is_empty() || only.iter().any(|o| o == part)
}

/// The runtime a benchmark's `main` runs on: tokio's default multi-threaded one.
pub fn bench_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime")
}
