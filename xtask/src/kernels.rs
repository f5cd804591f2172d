//! `cargo xtask kernels` groundwork: fetches real Debian kernels (downloaded and unpacked, never
//! installed) and boots each in QEMU with virtme-ng, sharing this machine's root read-only, to
//! run one command inside and bring back its exit code and output.
//!
//! Everything lives under `<cache>/kernels` (`cache` is `setup::cache_dir()`): `venv/` holds
//! virtme-ng, `apt/` a private APT configuration whose index adds the suites the kernels come
//! from without touching the system's sources, `<package>/` each unpacked kernel.

use std::{
    fs,
    io::Read as _,
    os::unix::process::CommandExt as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

use crate::setup::run;

/// One Debian kernel to boot.
pub struct Kernel {
    /// The upstream series, e.g. "5.10".
    pub series: &'static str,
    /// The suite the pinned package comes from (all suites are in the private index).
    pub suite: &'static str,
    /// The package holding the vmlinuz; pinned so that runs are repeatable.
    pub image: &'static str,
    /// Debian's 7.x packages split the kernel into `linux-binary-*` (the vmlinuz) and
    /// `linux-modules-*`; the guest needs the modules too (9p and virtio are modules).
    pub split_modules: bool,
    /// An `apt-cache search --names-only` pattern for the newest of the series, used when the
    /// pinned package has left the mirror (security uploads replace the ABI name).
    pub newest: &'static str,
}

pub const KERNELS: &[Kernel] = &[
    Kernel {
        series: "5.10",
        suite: "bullseye-security",
        image: "linux-image-5.10.0-46-amd64",
        split_modules: false,
        newest: r"^linux-image-5\.10\.0-[0-9]+-amd64$",
    },
    Kernel {
        series: "6.1",
        suite: "bookworm-security",
        image: "linux-image-6.1.0-57-amd64",
        split_modules: false,
        newest: r"^linux-image-6\.1\.0-[0-9]+-amd64$",
    },
    Kernel {
        series: "6.12",
        suite: "trixie-security",
        image: "linux-image-6.12.118+deb13-amd64",
        split_modules: false,
        newest: r"^linux-image-6\.12\.[0-9]+\+deb13-amd64$",
    },
    Kernel {
        series: "7.x",
        suite: "trixie-backports",
        image: "linux-binary-7.3.4+deb13-amd64",
        split_modules: true,
        newest: r"^linux-binary-7\.[0-9]+\.[0-9]+\+deb13-amd64$",
    },
];

/// What one boot gave back.
pub struct Boot {
    /// The guest command's exit code (virtme-ng passes it through).
    pub exit_code: i32,
    pub seconds: f64,
    /// The guest's stdout and stderr, with vng's own messages, interleaved.
    pub output: String,
}

/// Host packages: QEMU itself; kmod for the depmod virtme-ng runs on the unpacked modules;
/// busybox-static for the initramfs virtme-ng builds (without it: "initramfs is needed, and no
/// busybox was found"); udev, without which the guest's output was seen to be lost.
const HOST_PACKAGES: &[&str] = &["qemu-system-x86", "kmod", "udev", "busybox-static"];

const VIRTME_NG: &str = "virtme-ng==1.42";

/// One vCPU and 512 MiB: boots take 25-50 s under software emulation, and a 2-core machine
/// must keep a core for the host.
const GUEST_CPUS: &str = "1";
const GUEST_MEMORY: &str = "512M";

/// Installs what booting needs, once; returns the path to `vng`. Fast when all is present.
pub fn ensure_tools(cache: &Path) -> Result<PathBuf> {
    let missing: Vec<String> = HOST_PACKAGES
        .iter()
        .copied()
        .filter(|package| crate::setup::installed_version(package).is_none())
        .map(str::to_owned)
        .collect();
    crate::setup::apt_install(&missing)?;
    ensure_venv(&cache.join("kernels/venv"))
}

/// virtme-ng in a virtual environment of its own, kept apart from the system's Python.
fn ensure_venv(venv: &Path) -> Result<PathBuf> {
    let vng = venv.join("bin/vng");
    let wanted = VIRTME_NG.trim_start_matches("virtme-ng==");
    let version = Command::new(&vng).arg("--version").output();
    if version.is_ok_and(|out| String::from_utf8_lossy(&out.stdout).contains(wanted)) {
        return Ok(vng);
    }
    run(Command::new("python3").args(["-m", "venv"]).arg(venv))
        .context("fix: apt-get install python3-venv")?;
    run(Command::new(venv.join("bin/pip")).args([
        "install",
        "-q",
        "--disable-pip-version-check",
        VIRTME_NG,
    ]))
    .context("pip install of virtme-ng failed; fix: check that pip reaches the package index")?;
    Ok(vng)
}

/// Returns the kernel's vmlinuz, downloading and unpacking its packages the first time; later
/// calls only look (unless the pinned package left the mirror: then each call refreshes the
/// index to find the newest). virtme-ng writes `modules.dep` into the unpacked tree on the
/// first boot, so the cache must stay writable.
pub fn ensure_kernel(cache: &Path, kernel: &Kernel) -> Result<PathBuf> {
    let root = cache.join("kernels");
    if let Ok(vmlinuz) = find_vmlinuz(&root.join(kernel.image)) {
        return Ok(vmlinuz);
    }
    let apt = PrivateApt::create(&root.join("apt"))?;
    // Always refresh: a stale index names .debs the mirror has already dropped.
    run(&mut apt.command("apt-get", &["update", "-q"])).context(
        "apt-get update (private index) failed; fix: check that this machine reaches the mirrors named in /etc/apt/sources.list*",
    )?;
    let image = apt.resolve(kernel)?;
    let dir = root.join(&image);
    if let Ok(vmlinuz) = find_vmlinuz(&dir) {
        return Ok(vmlinuz);
    }
    let mut packages = vec![image.clone()];
    if kernel.split_modules {
        packages.push(image.replacen("linux-binary-", "linux-modules-", 1));
    }
    unpack(&apt, &packages, &dir)?;
    find_vmlinuz(&dir)
}

/// Downloads `packages` and unpacks them into `dir`, through a scratch directory renamed at
/// the end, so that an interrupted run never leaves a tree that looks complete.
fn unpack(apt: &PrivateApt, packages: &[String], dir: &Path) -> Result<()> {
    // Not `with_extension`: package names hold dots ("6.12.118").
    let mut partial = dir.as_os_str().to_owned();
    partial.push(".partial");
    let partial = PathBuf::from(partial);
    let debs = partial.join("debs");
    let _ = fs::remove_dir_all(&partial);
    fs::create_dir_all(&debs).with_context(|| format!("creating {}", debs.display()))?;
    eprintln!("kernels: downloading {}", packages.join(" "));
    let mut download = apt.command("apt-get", &["download", "-q"]);
    run(download.args(packages).current_dir(&debs))
        .context("apt-get download failed; fix: check the package names with `apt-cache policy` under the private APT_CONFIG")?;
    for deb in fs::read_dir(&debs)? {
        let deb = deb?.path();
        run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&partial))
            .context("fix: check that dpkg-deb works and the disk has about 500 MB free")?;
    }
    fs::remove_dir_all(&debs)?;
    fs::rename(&partial, dir).with_context(|| format!("renaming to {}", dir.display()))
}

/// The vmlinuz in an unpacked tree: `boot/vmlinuz-*` up to 6.12, `usr/lib/modules/*/vmlinuz`
/// in the split 7.x packages.
fn find_vmlinuz(dir: &Path) -> Result<PathBuf> {
    let boot = dir.join("boot");
    if let Ok(entries) = fs::read_dir(&boot) {
        for entry in entries.flatten() {
            if entry.file_name().to_string_lossy().starts_with("vmlinuz-") {
                return Ok(entry.path());
            }
        }
    }
    for modules in ["usr/lib/modules", "lib/modules"] {
        for entry in fs::read_dir(dir.join(modules))
            .into_iter()
            .flatten()
            .flatten()
        {
            let vmlinuz = entry.path().join("vmlinuz");
            if vmlinuz.is_file() {
                return Ok(vmlinuz);
            }
        }
    }
    bail!("no vmlinuz under {}", dir.display())
}

/// An APT configuration of its own: its sources, index, state and downloads live under its
/// directory, so the system's sources and installed packages stay untouched.
struct PrivateApt {
    config: PathBuf,
}

impl PrivateApt {
    fn create(dir: &Path) -> Result<Self> {
        for sub in [
            "sources.list.d",
            "preferences.d",
            "state/lists/partial",
            "cache/archives/partial",
        ] {
            fs::create_dir_all(dir.join(sub))
                .with_context(|| format!("creating {}", dir.display()))?;
        }
        let status = dir.join("state/status");
        if !status.exists() {
            fs::write(&status, "")?;
        }
        fs::write(
            dir.join("sources.list"),
            private_sources(&system_mirrors()?),
        )?;
        let d = dir.display();
        let config = dir.join("apt.conf");
        fs::write(
            &config,
            format!(
                "Dir::Etc::SourceList \"{d}/sources.list\";\n\
                 Dir::Etc::SourceParts \"{d}/sources.list.d\";\n\
                 Dir::Etc::Preferences \"{d}/preferences\";\n\
                 Dir::Etc::PreferencesParts \"{d}/preferences.d\";\n\
                 Dir::State \"{d}/state\";\n\
                 Dir::State::Lists \"{d}/state/lists\";\n\
                 Dir::State::status \"{d}/state/status\";\n\
                 Dir::Cache \"{d}/cache\";\n\
                 Dir::Cache::archives \"{d}/cache/archives\";\n\
                 APT::Architecture \"amd64\";\n\
                 Acquire::Languages \"none\";\n\
                 Acquire::IndexTargets::deb::DEP-11::DefaultEnabled \"false\";\n\
                 Acquire::IndexTargets::deb::DEP-11-icons::DefaultEnabled \"false\";\n\
                 Acquire::IndexTargets::deb::DEP-11-icons-hidpi::DefaultEnabled \"false\";\n\
                 # Its directories sit under root's home, which the _apt user cannot write.\n\
                 APT::Sandbox::User \"root\";\n"
            ),
        )?;
        Ok(Self { config })
    }

    fn command(&self, program: &str, args: &[&str]) -> Command {
        let mut command = Command::new(program);
        command.args(args).env("APT_CONFIG", &self.config);
        command
    }

    /// The pinned image package, or the newest of its series when the mirror dropped it.
    fn resolve(&self, kernel: &Kernel) -> Result<String> {
        let known = self
            .command("apt-cache", &["show", "-q", kernel.image])
            .output()
            .is_ok_and(|out| out.status.success() && !out.stdout.is_empty());
        if known {
            return Ok(kernel.image.to_owned());
        }
        let out = self
            .command("apt-cache", &["search", "--names-only", kernel.newest])
            .output()
            .context("cannot start apt-cache")?;
        let text = String::from_utf8_lossy(&out.stdout);
        let newest = text
            .lines()
            .filter_map(|line| line.split_whitespace().next())
            .max_by(|a, b| natural_key(a).cmp(&natural_key(b)))
            .with_context(|| format!("no package matches {} in the private index; fix: update KERNELS in xtask/src/kernels.rs", kernel.newest))?;
        eprintln!(
            "kernels: {} is gone from the mirror; using {newest}",
            kernel.image
        );
        Ok(newest.to_owned())
    }
}

/// Splits a name into text and numbers so that "6.12.118" sorts after "6.12.99".
fn natural_key(name: &str) -> Vec<(String, u64)> {
    let mut key = Vec::new();
    let mut text = String::new();
    let mut chars = name.chars().peekable();
    while let Some(c) = chars.next() {
        if !c.is_ascii_digit() {
            text.push(c);
            continue;
        }
        let mut number = u64::from(c.to_digit(10).unwrap_or(0));
        while let Some(d) = chars.peek().and_then(|d| d.to_digit(10)) {
            number = number.saturating_mul(10).saturating_add(u64::from(d));
            chars.next();
        }
        key.push((std::mem::take(&mut text), number));
    }
    key.push((text, 0));
    key
}

/// A Debian archive as the system's sources name it.
#[derive(Debug, Default)]
struct Mirror {
    uri: String,
    signed_by: Option<String>,
}

#[derive(Debug, Default)]
struct Mirrors {
    main: Option<Mirror>,
    security: Option<Mirror>,
}

const DEBIAN_CODENAMES: &[&str] = &["bullseye", "bookworm", "trixie", "forky", "sid"];

/// The mirrors the system already uses (one-line `.list` and deb822 `.sources` files), so the
/// private index goes through the same, reachable, hosts. `GUARD_DEBIAN_MIRROR` and
/// `GUARD_DEBIAN_SECURITY_MIRROR` override them.
fn system_mirrors() -> Result<(Mirror, Mirror)> {
    let mut found = Mirrors::default();
    let mut files = vec![PathBuf::from("/etc/apt/sources.list")];
    if let Ok(entries) = fs::read_dir("/etc/apt/sources.list.d") {
        let mut parts: Vec<PathBuf> = entries.flatten().map(|e| e.path()).collect();
        parts.sort();
        files.extend(parts);
    }
    for file in files {
        let Ok(text) = fs::read_to_string(&file) else {
            continue;
        };
        match file.extension().and_then(|e| e.to_str()) {
            Some("sources") => parse_deb822(&text, &mut found),
            _ if file.file_name().is_some_and(|n| n == "sources.list")
                || file.extension().is_some_and(|e| e == "list") =>
            {
                parse_one_line(&text, &mut found);
            }
            _ => {}
        }
    }
    let env = |name: &str| {
        std::env::var(name).ok().map(|uri| Mirror {
            uri,
            signed_by: None,
        })
    };
    let main = env("GUARD_DEBIAN_MIRROR").or(found.main).context(
        "no Debian mirror in /etc/apt/sources.list*; fix: set GUARD_DEBIAN_MIRROR to the URI of a Debian archive",
    )?;
    let security = env("GUARD_DEBIAN_SECURITY_MIRROR").or(found.security).context(
        "no Debian security mirror in /etc/apt/sources.list*; fix: set GUARD_DEBIAN_SECURITY_MIRROR to its URI",
    )?;
    Ok((main, security))
}

/// Files the first Debian archive (suite `<codename>[-updates|-backports]`) and the first
/// security archive (`<codename>-security`) seen; third-party sources name other suites.
fn note(found: &mut Mirrors, uri: &str, suites: &[&str], signed_by: Option<&str>) {
    let codename = |suite: &str| DEBIAN_CODENAMES.contains(&suite.split('-').next().unwrap_or(""));
    let mirror = || Mirror {
        uri: uri.trim_end_matches('/').to_owned(),
        signed_by: signed_by.map(str::to_owned),
    };
    for suite in suites.iter().filter(|s| codename(s)) {
        if suite.ends_with("-security") {
            found.security.get_or_insert_with(mirror);
        } else {
            found.main.get_or_insert_with(mirror);
        }
    }
}

fn parse_one_line(text: &str, found: &mut Mirrors) {
    for line in text.lines().map(str::trim) {
        let Some(rest) = line.strip_prefix("deb ") else {
            continue;
        };
        let (options, rest) = match rest.trim_start().strip_prefix('[') {
            Some(bracketed) => bracketed.split_once(']').unwrap_or(("", "")),
            None => ("", rest),
        };
        let signed_by = options
            .split_whitespace()
            .find_map(|o| o.strip_prefix("signed-by="));
        let mut words = rest.split_whitespace();
        if let (Some(uri), Some(suite)) = (words.next(), words.next()) {
            note(found, uri, &[suite], signed_by);
        }
    }
}

fn parse_deb822(text: &str, found: &mut Mirrors) {
    for stanza in text.split("\n\n") {
        let field = |name: &str| {
            stanza.lines().find_map(|line| {
                let (key, value) = line.split_once(':')?;
                key.trim().eq_ignore_ascii_case(name).then(|| value.trim())
            })
        };
        let enabled = field("Enabled").is_none_or(|v| !v.eq_ignore_ascii_case("no"));
        let debs = field("Types").is_some_and(|t| t.split_whitespace().any(|t| t == "deb"));
        let (Some(uris), Some(suites)) = (field("URIs"), field("Suites")) else {
            continue;
        };
        if enabled && debs {
            let suites: Vec<&str> = suites.split_whitespace().collect();
            for uri in uris.split_whitespace() {
                // An inline key block cannot go into a one-line source; apt then falls back
                // to the keys in /etc/apt/trusted.gpg.d.
                let key = field("Signed-By").filter(|key| key.starts_with('/'));
                note(found, uri, &suites, key);
            }
        }
    }
}

/// The suites the kernels come from, on the system's own mirrors.
fn private_sources((main, security): &(Mirror, Mirror)) -> String {
    let line = |mirror: &Mirror, suite: &str| {
        let signed = mirror
            .signed_by
            .as_deref()
            .map_or_else(String::new, |key| format!(" signed-by={key}"));
        format!("deb [arch=amd64{signed}] {} {suite} main\n", mirror.uri)
    };
    let mut text = String::new();
    for suite in [
        "bullseye",
        "bookworm",
        "bookworm-backports",
        "trixie",
        "trixie-backports",
    ] {
        text += &line(main, suite);
    }
    for suite in ["bullseye-security", "bookworm-security", "trixie-security"] {
        text += &line(security, suite);
    }
    text
}

/// Boots `vmlinuz` with this machine's root shared read-only and runs `command` in it as root;
/// `rwdir` is shared read-write at the same path (the only place the guest's writes reach the
/// host; /tmp, /etc, /usr and /var are writable overlays that vanish with the guest). The
/// guest is killed, with its QEMU, after `timeout`.
pub fn boot(
    vng: &Path,
    vmlinuz: &Path,
    command: &str,
    rwdir: &Path,
    timeout: Duration,
) -> Result<Boot> {
    fs::create_dir_all(rwdir).with_context(|| format!("creating {}", rwdir.display()))?;
    // One pipe for stdout and stderr keeps them in order; vng was seen to lose the guest's
    // output when its stdout was not a pipe.
    let (mut reader, writer) = std::io::pipe().context("creating a pipe")?;
    let mut child = vng_command(vng, vmlinuz, command, rwdir)?
        .stdin(Stdio::null())
        .stdout(writer.try_clone()?)
        .stderr(writer)
        // A group of its own, so that a timeout kills QEMU too, not only vng.
        .process_group(0)
        .spawn()
        .with_context(|| {
            format!(
                "cannot start {}; fix: delete its venv, ensure_tools makes it again",
                vng.display()
            )
        })?;
    // Read while the guest runs: a full pipe would stall it.
    let collector = std::thread::spawn(move || {
        let mut bytes = Vec::new();
        let _ = reader.read_to_end(&mut bytes);
        String::from_utf8_lossy(&bytes).into_owned()
    });
    let started = Instant::now();
    let status = wait(&mut child, timeout)?;
    let seconds = started.elapsed().as_secs_f64();
    let output = collector.join().unwrap_or_default();
    let Some(status) = status else {
        bail!(
            "{} did not finish within {timeout:?}; fix: raise the timeout (boots without KVM take 25-50 s); its output:\n{output}",
            vmlinuz.display()
        );
    };
    let exit_code = status
        .code()
        .with_context(|| format!("vng was killed by a signal ({status}); its output:\n{output}"))?;
    Ok(Boot {
        exit_code,
        seconds,
        output,
    })
}

/// `vng --run VMLINUZ --disable-kvm --user root --cpus 1 --memory 512M --rwdir=DIR --exec CMD`.
fn vng_command(vng: &Path, vmlinuz: &Path, command: &str, rwdir: &Path) -> Result<Command> {
    // vng starts `virtme-run` through PATH, and that lives in vng's virtual environment.
    let bin = vng.parent().context("vng has no directory")?;
    let path = std::env::var_os("PATH").unwrap_or_default();
    let path =
        std::env::join_paths(std::iter::once(bin.to_owned()).chain(std::env::split_paths(&path)))?;
    let mut vng = Command::new(vng);
    vng.arg("--run")
        .arg(vmlinuz)
        // `--user root`: guard's eBPF tests need root whoever runs the host side.
        .args(["--disable-kvm", "--user", "root"])
        .args(["--cpus", GUEST_CPUS, "--memory", GUEST_MEMORY])
        .arg(format!("--rwdir={}", rwdir.display()))
        .args(["--exec", command])
        .env("PATH", path);
    Ok(vng)
}

/// Waits for the child; on timeout kills its whole process group and returns None.
fn wait(
    child: &mut std::process::Child,
    timeout: Duration,
) -> Result<Option<std::process::ExitStatus>> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(Some(status));
        }
        if Instant::now() >= deadline {
            let group = format!("-{}", child.id());
            let _ = Command::new("kill").args(["-KILL", "--", &group]).status();
            let _ = child.kill();
            child.wait()?;
            return Ok(None);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Why QEMU cannot boot a guest here, if it cannot: a line CI can print before it skips.
pub fn qemu_usable() -> Result<(), String> {
    if !cfg!(all(target_os = "linux", target_arch = "x86_64")) {
        return Err(
            "kernels: skipped: the Debian kernels are amd64 and this host is not x86_64 Linux"
                .into(),
        );
    }
    let version = Command::new("qemu-system-x86_64").arg("--version").output();
    match version {
        Ok(out) if out.status.success() => {}
        Ok(out) => {
            return Err(format!(
                "kernels: skipped: qemu-system-x86_64 --version failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Err(error) => {
            return Err(format!(
                "kernels: skipped: cannot run qemu-system-x86_64 ({error}); fix: apt-get install qemu-system-x86"
            ));
        }
    }
    if !Path::new("/usr/bin/busybox").exists() && !Path::new("/bin/busybox").exists() {
        return Err("kernels: skipped: no busybox for the guest's initramfs; fix: apt-get install busybox-static".into());
    }
    let available = available_memory_kib().unwrap_or(u64::MAX);
    if available < 1024 * 1024 {
        return Err(format!(
            "kernels: skipped: {} MiB of memory available, a guest needs 512 MiB and QEMU about as much again",
            available / 1024
        ));
    }
    Ok(())
}

fn available_memory_kib() -> Option<u64> {
    let meminfo = fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_debian_mirrors_in_both_formats_and_skips_third_parties() {
        let mut found = Mirrors::default();
        parse_one_line(
            "# deb http://old.example/debian bookworm main\n\
             deb https://vendor.example/apt cloud-sdk-bookworm main\n\
             deb [arch=amd64 signed-by=/k.gpg] http://mirror.example/debian/ bookworm main\n",
            &mut found,
        );
        parse_deb822(
            "Types: deb\nURIs: https://vendor.example/node\nSuites: nodistro\n\n\
             Types: deb\nURIs: http://mirror.example/debian-security\n\
             Suites: bookworm-security\nEnabled: yes\n",
            &mut found,
        );
        let main = found.main.expect("main");
        assert_eq!(main.uri, "http://mirror.example/debian");
        assert_eq!(main.signed_by.as_deref(), Some("/k.gpg"));
        let security = found.security.expect("security");
        assert_eq!(security.uri, "http://mirror.example/debian-security");
    }

    #[test]
    fn newest_sorts_numbers_as_numbers() {
        let names = [
            "linux-image-6.12.99+deb13-amd64",
            "linux-image-6.12.118+deb13-amd64",
        ];
        let newest = names
            .iter()
            .max_by(|a, b| natural_key(a).cmp(&natural_key(b)));
        assert_eq!(newest, Some(&"linux-image-6.12.118+deb13-amd64"));
    }
}
