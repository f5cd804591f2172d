//! The Debian package as its users meet it: `cargo xtask deb`'s guard_VERSION_amd64.deb is
//! installed, upgraded, removed and purged by dpkg in a fresh Debian 12 root (mmdebstrap's,
//! made by setup) through chroot; its maintainer scripts ask systemd for exactly what they
//! promise (nothing on a fresh install, a restart on upgrade, a stop on removal) and run
//! `guard restore` on removal against a real frozen cgroup; the unit it installs passes
//! `systemd-analyze verify` and `security --offline` (3.0 or less); lintian reports nothing
//! the package does not explain.

use std::{
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    process::{Command, Output, Stdio},
    sync::OnceLock,
};

use guard_tests::{TempDir, TestCgroup, cgroup2_root, require_root};

/// The highest overall exposure `systemd-analyze security` may rate the unit, in tenths (3.0).
const MAX_EXPOSURE_TENTHS: u32 = 30;
const UNIT: &str = "/lib/systemd/system/guard.service";
/// Where the maintainer scripts' requests to systemd are written down (see [`Root::unpack`]).
const POLICY_LOG: &str = "var/log/policy-rc.d.log";

/// `cargo xtask deb` (once per test binary; a second run finds the package up to date).
fn package() -> &'static Path {
    static PACKAGE: OnceLock<PathBuf> = OnceLock::new();
    PACKAGE.get_or_init(|| {
        guard_tests::xtask(&["deb".as_ref()]);
        let version = env!("CARGO_PKG_VERSION");
        guard_tests::workspace().join(format!("target/deb/guard_{version}_amd64.deb"))
    })
}

/// The output of a command that must succeed.
fn ok(command: &mut Command) -> String {
    let out = output(command);
    assert!(
        out.status.success(),
        "{command:?} failed ({}):\n{}",
        out.status,
        text(&out)
    );
    text(&out)
}

fn output(command: &mut Command) -> Output {
    command
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|err| panic!("cannot start {command:?}: {err}"))
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// A fresh Debian 12 root, unpacked from setup's tarball; removed on drop.
struct Root {
    dir: TempDir,
}

impl Root {
    /// Unpacks it, and makes the maintainer scripts believe systemd runs (/run/systemd/system)
    /// while a policy-rc.d writes down each action they ask for and refuses it (101).
    fn unpack(name: &str) -> Self {
        let tarball = std::env::var_os("GUARD_DEBIAN_ROOTFS").map_or_else(
            || {
                PathBuf::from(std::env::var("HOME").unwrap_or_else(|_| "/root".into()))
                    .join(".cache/guard-dev/debian-12-systemd-procps.tar")
            },
            PathBuf::from,
        );
        assert!(
            tarball.is_file(),
            "{} is missing: run `cargo xtask setup` (mmdebstrap makes it)",
            tarball.display()
        );
        let dir = TempDir::new(name);
        ok(Command::new("tar")
            .arg("-xf")
            .arg(&tarball)
            .arg("-C")
            .arg(&dir.0));
        for made in ["run/systemd/system", "sys/fs/cgroup", "tmp"] {
            std::fs::create_dir_all(dir.0.join(made)).expect("a directory in the root");
        }
        let policy = dir.0.join("usr/sbin/policy-rc.d");
        std::fs::write(
            &policy,
            format!("#!/bin/sh\necho \"$*\" >> /{POLICY_LOG}\nexit 101\n"),
        )
        .expect("write policy-rc.d");
        std::fs::set_permissions(&policy, std::fs::Permissions::from_mode(0o755))
            .expect("chmod policy-rc.d");
        Self { dir }
    }

    fn path(&self, inside: &str) -> PathBuf {
        self.dir.0.join(inside.trim_start_matches('/'))
    }

    /// Runs `args` chrooted, in a mount namespace of its own with /proc and this host's
    /// cgroup2 tree at /sys/fs/cgroup (as on a Debian 12 host).
    fn run(&self, args: &[&str]) -> Output {
        output(
            Command::new("unshare")
                .args(["--mount", "--propagation", "private", "sh", "-c"])
                .arg(
                    r#"mount -t proc proc "$0/proc" && mount --bind "$1" "$0/sys/fs/cgroup" && root="$0" && shift && exec chroot "$root" "$@""#,
                )
                .arg(&self.dir.0)
                .arg(cgroup2_root())
                .args(args)
                .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
                .env("DEBIAN_FRONTEND", "noninteractive"),
        )
    }

    fn ok(&self, args: &[&str]) -> String {
        let out = self.run(args);
        assert!(
            out.status.success(),
            "chroot {args:?} failed ({}):\n{}",
            out.status,
            text(&out)
        );
        text(&out)
    }

    /// Copies a package into the root's /tmp; returns its path there.
    fn copy_in(&self, package: &Path) -> String {
        let name = package.file_name().expect("a file name").to_string_lossy();
        std::fs::copy(package, self.path("tmp").join(&*name)).expect("copy the package in");
        format!("/tmp/{name}")
    }

    /// The actions asked of systemd since the last call (and forgets them).
    fn asked(&self) -> Vec<String> {
        let log = self.path(POLICY_LOG);
        let lines = std::fs::read_to_string(&log).unwrap_or_default();
        let _ = std::fs::remove_file(&log);
        lines.lines().map(str::to_owned).collect()
    }
}

/// The package again, one version later (`VERSION+test1`): what an upgrade installs.
fn next_version(package: &Path, dir: &Path) -> PathBuf {
    let tree = dir.join("tree");
    ok(Command::new("dpkg-deb").arg("-R").arg(package).arg(&tree));
    let control = tree.join("DEBIAN/control");
    let text = std::fs::read_to_string(&control).expect("read control");
    let version = env!("CARGO_PKG_VERSION");
    std::fs::write(
        &control,
        text.replace(
            &format!("Version: {version}\n"),
            &format!("Version: {version}+test1\n"),
        ),
    )
    .expect("write control");
    let next = dir.join(format!("guard_{version}+test1_amd64.deb"));
    ok(Command::new("dpkg-deb")
        .args(["--root-owner-group", "-b"])
        .arg(&tree)
        .arg(&next));
    next
}

#[test]
fn the_package_installs_upgrades_removes_and_purges_in_debian_12() {
    require_root();
    let root = Root::unpack("guard-package-lifecycle");
    let first = root.copy_in(package());
    let installed = root.ok(&["dpkg", "-i", &first]);
    assert!(
        installed.contains("installed, not started"),
        "the postinst says what to do next:\n{installed}"
    );
    assert_eq!(
        root.asked(),
        Vec::<String>::new(),
        "a fresh install asks systemd for nothing (it starts no daemon on the example config)"
    );
    assert_fresh_install(&root);

    // The admin writes the config and enables guard; an upgrade keeps the one and restarts.
    let config = root.path("etc/guard/guard.toml");
    let original = std::fs::read_to_string(&config).expect("read the config");
    std::fs::write(&config, format!("# mine\n{original}")).expect("edit the config");
    root.ok(&["systemctl", "--root=/", "enable", "guard.service"]);
    let upgrades = TempDir::new("guard-package-next");
    let next = root.copy_in(&next_version(package(), &upgrades.0));
    root.ok(&["dpkg", "-i", &next]);
    assert_eq!(
        root.asked(),
        ["guard.service restart"],
        "an upgrade restarts guard"
    );
    let kept = std::fs::read_to_string(&config).expect("read the config");
    assert!(
        kept.starts_with("# mine\n"),
        "the upgrade kept the admin's config"
    );
    let enabled = root.run(&["systemctl", "--root=/", "is-enabled", "guard.service"]);
    assert_eq!(
        text(&enabled).trim(),
        "enabled",
        "still enabled after the upgrade"
    );

    assert_removal_restores(&root);
    assert_purge_leaves_nothing(&root);
}

/// What a fresh install put where, and that the binary runs in a bare Debian 12.
fn assert_fresh_install(root: &Root) {
    let version = root.ok(&["guard", "--version"]);
    assert!(version.contains(env!("CARGO_PKG_VERSION")), "{version}");
    root.ok(&["guard", "check-config", "--config", "/etc/guard/guard.toml"]);
    let enabled = root.run(&["systemctl", "--root=/", "is-enabled", "guard.service"]);
    assert_eq!(text(&enabled).trim(), "disabled", "installed, not enabled");
    for file in [
        "usr/share/guard/guard-dashboard.json",
        "usr/share/guard/guard-alerts.yml",
        "usr/share/man/man1/guard.1.gz",
        "etc/logrotate.d/guard",
    ] {
        assert!(root.path(file).is_file(), "{file} is missing");
    }
    let unit = std::fs::read_to_string(root.path(UNIT)).expect("the unit");
    assert!(
        unit.contains("ExecStart=/usr/bin/guard run --config /etc/guard/guard.toml\n")
            && unit.contains("ExecStopPost=/usr/bin/guard restore --state-dir /var/lib/guard\n"),
        "the unit names the packaged binary"
    );
    let mode = |path: &str| {
        std::fs::metadata(root.path(path))
            .expect("stat")
            .permissions()
            .mode()
            & 0o777
    };
    assert_eq!(
        mode("etc/guard/guard.toml"),
        0o640,
        "the config may hold tokens"
    );
    assert_eq!(mode("var/lib/guard"), 0o750, "the state directory");
}

/// `dpkg -r`: systemd is asked to stop guard, and `guard restore` thaws a real cgroup that a
/// record in /var/lib/guard says guard froze.
fn assert_removal_restores(root: &Root) {
    let cgroup = TestCgroup::new(&cgroup2_root(), "guard-test-package");
    let freeze = cgroup.path.join("cgroup.freeze");
    std::fs::write(&freeze, "1").expect("freeze the test cgroup");
    let name = cgroup.path.file_name().expect("a name").to_string_lossy();
    let record = serde_json::json!({
        "control": format!("/sys/fs/cgroup/{name}/cgroup.freeze"),
        "original": "0",
    });
    let record_path = root.path("var/lib/guard/test_cgroup_freeze.orig");
    std::fs::write(&record_path, record.to_string()).expect("write a record");
    std::fs::set_permissions(&record_path, std::fs::Permissions::from_mode(0o600))
        .expect("chmod the record");

    let removed = root.ok(&["dpkg", "-r", "guard"]);
    assert_eq!(root.asked(), ["guard.service stop"], "removal stops guard");
    assert_eq!(
        std::fs::read_to_string(&freeze)
            .expect("read cgroup.freeze")
            .trim(),
        "0",
        "the prerm's guard restore thawed the recorded cgroup:\n{removed}"
    );
    assert!(!root.path("usr/bin/guard").exists(), "the binary is gone");
    assert!(
        root.path("etc/guard/guard.toml").is_file(),
        "removal keeps the config"
    );
}

/// `dpkg -P`: no config, state, logs or systemd links stay behind.
fn assert_purge_leaves_nothing(root: &Root) {
    root.ok(&["dpkg", "-P", "guard"]);
    for gone in [
        "etc/guard",
        "var/lib/guard",
        "var/log/guard",
        "etc/systemd/system/multi-user.target.wants/guard.service",
        "etc/systemd/system/guard.service",
        "var/lib/systemd/deb-systemd-helper-enabled/guard.service.dsh-also",
        "var/lib/systemd/deb-systemd-helper-masked/guard.service",
    ] {
        assert!(!root.path(gone).exists(), "{gone} is left after purge");
    }
    let status = root.run(&["dpkg-query", "-W", "-f=${Status}", "guard"]);
    assert!(
        !text(&status).contains("installed") && !text(&status).contains("config-files"),
        "dpkg still knows guard: {}",
        text(&status)
    );
}

#[test]
fn the_installed_unit_verifies_and_scores_3_or_less() {
    require_root();
    let root = Root::unpack("guard-package-unit");
    let deb = root.copy_in(package());
    root.ok(&["dpkg", "-i", &deb]);
    guard_tests::assert_unit_verifies(&root.run(&["systemd-analyze", "verify", UNIT]));

    let threshold = format!("--threshold={MAX_EXPOSURE_TENTHS}");
    let security = root.run(&[
        "systemd-analyze",
        "security",
        "--offline=yes",
        &threshold,
        UNIT,
    ]);
    let report = text(&security);
    let exposure = guard_tests::exposure_tenths(&report)
        .unwrap_or_else(|| panic!("no overall exposure level:\n{report}"));
    println!(
        "systemd-analyze security: {}.{}",
        exposure / 10,
        exposure % 10
    );
    assert!(
        exposure <= MAX_EXPOSURE_TENTHS && security.status.success(),
        "exposure {}.{} above 3.0:\n{report}",
        exposure / 10,
        exposure % 10
    );
}

#[test]
fn lintian_reports_only_what_the_package_explains() {
    let out = output(
        Command::new("lintian")
            .args(["--fail-on", "error,warning", "--display-info"])
            .arg(package()),
    );
    let report = text(&out);
    println!("lintian:\n{report}");
    assert!(out.status.success(), "lintian fails:\n{report}");
    let unexplained: Vec<&str> = report
        .lines()
        .filter(|line| {
            ["E: ", "W: ", "I: "]
                .iter()
                .any(|kind| line.starts_with(kind))
        })
        .collect();
    assert!(
        unexplained.is_empty(),
        "unexplained tags:\n{}",
        unexplained.join("\n")
    );
}
