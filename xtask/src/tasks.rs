//! `cargo xtask test | demo | bench`: each sets up first, then runs.

use std::process::Command;

use anyhow::{Context as _, Result, bail};

use crate::setup::{self, Installed, run};

/// The benchmarks, each a bench target of the guard-tests package.
#[derive(Clone, Copy, clap::ValueEnum)]
pub enum Bench {
    /// eBPF close-event delivery latency, sustained rate and CPU per event.
    Ebpf,
    /// One table beside nginx, HAProxy and direct: added latency, req/s and p99 at 1 to 256
    /// clients, NDJSON frame relay, 1 GiB up and down; full-class answer time; TTFT under a
    /// batch flood.
    Proxy,
    /// Four guards behind HAProxy under interactive and batch load: agent-check against round
    /// robin (503s, interactive TTFT p95, batch jobs done).
    Fleet,
    /// Enqueue + dispatch cost and bytes per waiter from 10 to 100,000 waiting; RSS of 10,000
    /// idle keep-alive connections and of 10,000 waiting requests.
    Scale,
    /// Reap latency with eBPF and from user space; tokens not generated for departed clients.
    Reap,
    /// guard's RSS idle and under load, CPU per 1,000 requests, watcher CPU.
    Footprint,
    /// Interactive TTFT and batch throughput with and without cgroup throttling.
    Protect,
    /// Start-prediction error on llama-server; time from a stall to the next request; memory
    /// held by waiting bodies.
    Limits,
    /// Each libFuzzer target for a million inputs.
    Fuzz,
    /// Interactive TTFT idle, under a batch flood, and under it with preemption; batch valid
    /// jobs per hour and tokens regenerated.
    Preempt,
}

impl Bench {
    fn target(self) -> &'static str {
        match self {
            Self::Ebpf => "ebpf",
            Self::Proxy => "proxy",
            Self::Scale => "scale",
            Self::Fleet => "fleet",
            Self::Reap => "reap",
            Self::Footprint => "footprint",
            Self::Protect => "protect",
            Self::Limits => "limits",
            Self::Fuzz => "fuzz",
            Self::Preempt => "preempt",
        }
    }
}

/// Builds everything, then runs all tests in a fresh network namespace of their own (only a
/// loopback), so they neither see nor disturb the host's ports.
pub fn test(args: &[String]) -> Result<()> {
    require_root("the tests load eBPF programs and write cgroups")?;
    let installed = setup::all()?;
    run(cargo().args(["build", "--workspace", "--all-targets"])).context("the build failed")?;
    // What tests/package.rs and tests/container.rs install and run; each is skipped when
    // built from the same inputs before.
    crate::deb::deb()?;
    if let Err(why) = crate::image::image() {
        // Where podman is missing or cannot store images, the container test skips and says
        // so; elsewhere it builds the image itself and fails on what failed here. The
        // package test runs either way.
        println!("image: not built: {why:#}");
    }
    let mut test = Command::new("unshare");
    test.args(["--net", "--", "sh", "-c"])
        .arg(r#"ip link set lo up && exec "$0" test --workspace --offline --no-fail-fast -- "$@""#)
        .arg(cargo_path())
        .args(args);
    export(&mut test, &installed);
    run(&mut test).context("tests failed")
}

/// The main job: SmolLM2 on llama-server behind guard, a mixed workload with and without
/// guard side by side, then guard keeps serving until Ctrl-C.
pub fn demo() -> Result<()> {
    use std::os::unix::process::CommandExt as _;
    let installed = setup::all()?;
    build_guard_and("demo", true)?;
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut demo = Command::new(root.join("target/release/demo"));
    demo.env("GUARD_BIN", release_guard());
    export(&mut demo, &installed);
    // Become the demo, so that Ctrl-C and SIGTERM reach it (and it stops what it started).
    Err(demo.exec()).context("starting the demo")
}

/// Builds the release binary (no setup: a GPU machine may lack the test servers) and checks
/// its GPU readings.
pub fn gpu_check() -> Result<()> {
    run(cargo().args(["build", "--release", "-p", "guard-cli"])).context("the build failed")?;
    crate::gpu::check(&release_guard())
}

pub fn bench(which: Bench, parts: &[String]) -> Result<()> {
    require_root("the benchmarks load eBPF programs")?;
    let installed = setup::all()?;
    run(cargo().args(["build", "--release", "-p", "guard-cli"])).context("the build failed")?;
    let mut bench = cargo();
    bench
        .args([
            "bench",
            "-p",
            "guard-tests",
            "--bench",
            which.target(),
            "--",
        ])
        .args(parts)
        .env("GUARD_BIN", release_guard());
    export(&mut bench, &installed);
    run(&mut bench)
}

/// Tells tests and benchmarks where setup put the real servers.
fn export(command: &mut Command, installed: &Installed) {
    command
        .env("GUARD_LLAMA_SERVER", &installed.llama.server)
        .env("GUARD_LLAMA_MODEL", &installed.llama.model)
        .env("GUARD_KUBE_TOOLS", &installed.kube_tools)
        .env("GUARD_DEBIAN_ROOTFS", &installed.debian_rootfs);
}

/// The release binary, by absolute path: benchmarks run from their package's directory.
fn release_guard() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/release/guard")
}

fn cargo_path() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned())
}

pub fn cargo() -> Command {
    Command::new(cargo_path())
}

/// Builds guard and one of guard-tests' binaries (the demo, the conformance wrapper).
pub fn build_guard_and(bin: &str, release: bool) -> Result<()> {
    let mut build = cargo();
    build.arg("build");
    if release {
        build.arg("--release");
    }
    build.args([
        "-p",
        "guard-cli",
        "-p",
        "guard-tests",
        "--bin",
        "guard",
        "--bin",
        bin,
    ]);
    run(&mut build).context("the build failed")
}

pub fn require_root(why: &str) -> Result<()> {
    let uid = Command::new("id")
        .arg("-u")
        .output()
        .context("running id -u")?;
    if String::from_utf8_lossy(&uid.stdout).trim() != "0" {
        bail!("run this as root: {why}");
    }
    Ok(())
}
