//! `cargo xtask setup`: installs, once, what building and testing guard needs on a fresh
//! Debian 12 machine (docs/design.md §3 and §10). Every step checks before it acts.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, Result, bail};

use crate::llama::{self, Llama};

/// Debian packages, pinned where docs/design.md §3 found a version that works.
const APT_PACKAGES: &[(&str, Option<&str>)] = &[
    ("rustc-web", Some("1.96.0+dfsg1-1~deb12u2")),
    ("cargo-web", Some("1.96.0+dfsg1-1~deb12u2")),
    ("libstd-rust-web-dev-bpf", Some("1.96.0+dfsg1-1~deb12u2")),
    ("llvm-22-dev", Some("1:22.1.8-1~deb12u1")),
    ("cmake", None),
    ("prometheus", None),
    ("iproute2", None),
    // The hostile-client tests: curl is one of the clients that must see a 413; prlimit and
    // taskset (util-linux) bound and pin guard.
    ("curl", None),
    ("util-linux", None),
    // The peers guard is measured against and the balancer it feeds (`bench proxy`, the
    // cluster tests), and the load generator.
    ("nginx", None),
    ("haproxy", None),
    ("wrk", None),
    // `bench proxy flame`: where guard's time goes.
    ("linux-perf", None),
    // `cargo xtask image` and the container test (tests/container.rs): podman builds and runs
    // the image, with runc (crun refuses this host's hybrid cgroup layout).
    ("podman", None),
    ("runc", None),
    // `cargo xtask deb`: dpkg-shlibdeps (dpkg-dev) and strip (binutils); lintian checks the
    // package, and the package test installs it into a fresh Debian 12 root that mmdebstrap
    // makes (tests/package.rs).
    ("dpkg-dev", None),
    ("binutils", None),
    ("lintian", None),
    ("mmdebstrap", None),
    // The logbook report's test opens the page headless and screenshots it.
    ("chromium", None),
];

/// Python clients the end-to-end tests drive guard with.
const PYTHON_PACKAGES: &[(&str, &str)] = &[
    ("ollama", "ollama==0.6.3"),
    ("openai", "openai==3.57.0"),
    ("requests", "requests==2.34.2"),
];

const BPF_LINKER_VERSION: &str = "0.13.0";

/// What the tests and the demo need to find.
pub struct Installed {
    pub llama: Llama,
    /// `checkov` and `kubernetes-validate`, in a virtual environment of their own.
    pub kube_tools: PathBuf,
    /// A fresh Debian 12 root file system (a tarball) to install the package into.
    pub debian_rootfs: PathBuf,
}

/// The Kubernetes manifests' validators, kept apart from the system's Python: checkov pins
/// versions of packages (botocore, boto3) that other tools there need at other versions.
const KUBE_TOOLS: &[&str] = &["checkov==3.3.30", "kubernetes-validate==1.37.0"];

/// Runs every step; fast when all is in place.
pub fn all() -> Result<Installed> {
    step("apt packages", apt_packages)?;
    step("debian toolchain", debian_toolchain)?;
    step("bpf-linker", bpf_linker)?;
    step("python clients", python_clients)?;
    let llama = step("llama-server and model", || llama::ensure(&cache_dir()))?;
    let kube_tools = step("kubernetes validators", kube_tools)?;
    let debian_rootfs = step("debian 12 root file system", debian_rootfs)?;
    Ok(Installed {
        llama,
        kube_tools,
        debian_rootfs,
    })
}

/// Where downloads and builds are kept between runs, outside the clone.
pub fn cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("GUARD_DEV_CACHE") {
        return PathBuf::from(dir);
    }
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("/root"), PathBuf::from);
    home.join(".cache/guard-dev")
}

fn step<T>(name: &str, run: impl FnOnce() -> Result<T>) -> Result<T> {
    let started = std::time::Instant::now();
    let value = run().with_context(|| format!("setup step `{name}` failed"))?;
    eprintln!(
        "setup: {name}: ok ({:.1} s)",
        started.elapsed().as_secs_f64()
    );
    Ok(value)
}

fn apt_packages() -> Result<()> {
    let missing: Vec<String> = APT_PACKAGES
        .iter()
        .filter(|(name, version)| {
            let installed = installed_version(name);
            match version {
                Some(version) => installed.as_deref() != Some(*version),
                None => installed.is_none(),
            }
        })
        .map(|(name, version)| match version {
            Some(version) => format!("{name}={version}"),
            None => (*name).to_owned(),
        })
        .collect();
    apt_install(&missing)
}

/// Installs Debian packages (none: nothing to do), after refreshing the index.
pub fn apt_install(missing: &[String]) -> Result<()> {
    if missing.is_empty() {
        return Ok(());
    }
    eprintln!("setup: apt: installing {}", missing.join(" "));
    run(Command::new("apt-get").args(["update", "-q"])).context(
        "apt-get update failed; fix: check that this machine reaches Debian's package mirror",
    )?;
    run(Command::new("apt-get")
        .args(["install", "-y", "-q", "--no-install-recommends"])
        .args(missing)
        .env("DEBIAN_FRONTEND", "noninteractive"))
    .context("apt-get install failed; fix: run it by hand as root to see which package is missing")
}

pub fn installed_version(package: &str) -> Option<String> {
    let output = Command::new("dpkg-query")
        .args(["-W", "-f=${Status}|${Version}", package])
        .output()
        .ok()?;
    let text = String::from_utf8(output.stdout).ok()?;
    let (status, version) = text.split_once('|')?;
    status.ends_with(" installed").then(|| version.to_owned())
}

/// `rustup toolchain link debian /usr`: Debian's rustc with its prebuilt BPF `core`.
fn debian_toolchain() -> Result<()> {
    let list = output(Command::new("rustup").args(["toolchain", "list"]))?;
    if !list.lines().any(|line| line.starts_with("debian")) {
        run(Command::new("rustup").args(["toolchain", "link", "debian", "/usr"]))
            .context("fix: install rustup, or run `rustup toolchain link debian /usr` by hand")?;
    }
    let version = output(Command::new("rustup").args(["run", "debian", "rustc", "--version"]))?;
    if !Path::new("/usr/lib/rustlib/bpfel-unknown-none").is_dir() {
        bail!(
            "Debian's rustc ({}) has no bpfel-unknown-none core; fix: apt-get install libstd-rust-web-dev-bpf",
            version.trim()
        );
    }
    Ok(())
}

fn bpf_linker() -> Result<()> {
    let current = Command::new("bpf-linker").arg("--version").output();
    if let Ok(current) = current
        && String::from_utf8_lossy(&current.stdout).contains(BPF_LINKER_VERSION)
    {
        return Ok(());
    }
    eprintln!("setup: bpf-linker: building {BPF_LINKER_VERSION} against llvm-22 (about a minute)");
    run(Command::new("cargo")
        .args([
            "install",
            "bpf-linker",
            "--version",
            BPF_LINKER_VERSION,
            "--locked",
        ])
        .args(["--no-default-features", "--features", "llvm-22"])
        .env("LLVM_PREFIX", "/usr/lib/llvm-22"))
    .context("fix: check that llvm-22-dev is installed (the apt step) and crates can be fetched")
}

fn python_clients() -> Result<()> {
    let missing: Vec<&str> = PYTHON_PACKAGES
        .iter()
        .filter(|(module, _)| {
            !Command::new("python3")
                .args(["-c", &format!("import {module}")])
                .output()
                .is_ok_and(|out| out.status.success())
        })
        .map(|(_, requirement)| *requirement)
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    run(Command::new("python3")
        .args(["-m", "pip", "install", "-q", "--disable-pip-version-check"])
        .args(&missing))
    .context(
        "pip install failed; fix: check that python3 -m pip works and reaches the package index",
    )
}

/// A virtual environment with `KUBE_TOOLS`; returns its `bin`.
fn kube_tools() -> Result<PathBuf> {
    let venv = cache_dir().join("kube-tools");
    let bin = venv.join("bin");
    if ["checkov", "kubernetes-validate"]
        .iter()
        .all(|tool| bin.join(tool).exists())
    {
        return Ok(bin);
    }
    run(Command::new("python3").args(["-m", "venv"]).arg(&venv))
        .context("fix: apt-get install python3-venv")?;
    run(Command::new(bin.join("pip"))
        .args(["install", "-q", "--disable-pip-version-check"])
        .args(KUBE_TOOLS))
    .context("pip install of the Kubernetes validators failed; fix: check that pip reaches the package index")?;
    Ok(bin)
}

/// Debian 12 (minbase, with systemd for `systemctl` and `systemd-analyze`, and procps, whose
/// /bin/kill the unit's ExecReload= runs, as any standard install has), made once by
/// mmdebstrap from this host's own apt sources; the package test unpacks a copy per run.
fn debian_rootfs() -> Result<PathBuf> {
    let tarball = cache_dir().join("debian-12-systemd-procps.tar");
    if tarball.exists() {
        return Ok(tarball);
    }
    let sources = [
        "/etc/apt/sources.list.d/debian.sources",
        "/etc/apt/sources.list",
    ]
    .into_iter()
    .find(|path| Path::new(path).exists())
    .context("no apt sources (/etc/apt/sources.list.d/debian.sources or sources.list)")?;
    std::fs::create_dir_all(cache_dir())?;
    let partial = tarball.with_extension("tar.partial");
    eprintln!(
        "setup: mmdebstrap: Debian 12 into {} (about 2 minutes)",
        tarball.display()
    );
    run(Command::new("mmdebstrap")
        .args([
            "--variant=minbase",
            "--include=systemd,procps",
            "--format=tar",
            "bookworm",
        ])
        .arg(&partial)
        .arg(sources))
    .context("mmdebstrap failed; fix: check that this machine reaches Debian's package mirror")?;
    std::fs::rename(&partial, &tarball)?;
    Ok(tarball)
}

/// Runs a command with its output shown; fails on a non-zero exit.
pub fn run(command: &mut Command) -> Result<()> {
    let status = command
        .status()
        .with_context(|| format!("cannot start {command:?}"))?;
    if !status.success() {
        bail!("{command:?} exited with {status}");
    }
    Ok(())
}

fn output(command: &mut Command) -> Result<String> {
    let out = command
        .output()
        .with_context(|| format!("cannot start {command:?}"))?;
    if !out.status.success() {
        bail!(
            "{command:?} exited with {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
