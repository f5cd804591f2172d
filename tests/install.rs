//! `cargo xtask install --root DIR` as a packager meets it: the binary, config, unit,
//! dashboard and alert rules land under DIR, the installed binary runs and accepts the
//! installed config, a second install keeps the admin's config, and the installed systemd unit
//! passes `systemd-analyze verify` with the capabilities and hardening the deployment relies
//! on, and `systemd-analyze security` rates its exposure at 3.0 or less.

use std::{
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    process::{Command, Output},
};

use guard_tests::TempDir;

const BINARY: &str = "usr/local/bin/guard";
const CONFIG: &str = "etc/guard/guard.toml";
const UNIT: &str = "etc/systemd/system/guard.service";
const STATE_DIR: &str = "var/lib/guard";
const DASHBOARD: &str = "usr/local/share/guard/guard-dashboard.json";
const ALERTS: &str = "usr/local/share/guard/guard-alerts.yml";

/// The capabilities the unit grants, no more: loading the eBPF program and its maps, and
/// attaching it to the tracepoint (perf_event_open). guard drops both once it is attached.
const CAPABILITIES: [&str; 2] = ["CAP_BPF", "CAP_PERFMON"];

/// The highest overall exposure `systemd-analyze security` may rate the unit, in tenths (3.0).
const MAX_EXPOSURE_TENTHS: u32 = 30;

/// `cargo xtask install --root ROOT`, which builds the release binary first; panics on failure.
fn install_into(root: &Path) -> Output {
    guard_tests::xtask(&["install".as_ref(), "--root".as_ref(), root.as_os_str()])
}

fn run(command: &mut Command) -> Output {
    command
        .output()
        .unwrap_or_else(|err| panic!("cannot start {command:?}: {err}"))
}

#[test]
fn install_into_a_temporary_root() {
    let tmp = TempDir::new("guard-install-root");
    let root = &tmp.0;
    let output = install_into(root);
    let log = String::from_utf8_lossy(&output.stderr);
    assert!(log.contains("install: "), "no install: lines:\n{log}");

    for path in [BINARY, CONFIG, UNIT, DASHBOARD, ALERTS] {
        assert!(
            root.join(path).is_file(),
            "{path} was not installed:\n{log}"
        );
    }
    assert!(root.join(STATE_DIR).is_dir(), "{STATE_DIR} missing");
    let state_mode = std::fs::metadata(root.join(STATE_DIR))
        .expect("stat the state dir")
        .permissions()
        .mode();
    assert_eq!(state_mode & 0o777, 0o750, "state dir mode {state_mode:o}");

    let binary = root.join(BINARY);
    let mode = std::fs::metadata(&binary)
        .expect("stat the binary")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o755, "binary mode {mode:o}");
    let version = run(Command::new(&binary).arg("--version"));
    assert!(version.status.success(), "guard --version: {version:?}");
    assert!(
        String::from_utf8_lossy(&version.stdout).contains("guard"),
        "guard --version printed {:?}",
        String::from_utf8_lossy(&version.stdout)
    );

    let config = root.join(CONFIG);
    let check = run(Command::new(&binary)
        .arg("check-config")
        .arg("--config")
        .arg(&config));
    assert!(
        check.status.success(),
        "the installed config does not check ({}):\n{}{}",
        check.status,
        String::from_utf8_lossy(&check.stdout),
        String::from_utf8_lossy(&check.stderr)
    );

    // An admin's edit survives a second install.
    let original = std::fs::read_to_string(&config).expect("read the installed config");
    std::fs::write(&config, format!("# mine\n{original}")).expect("edit the installed config");
    let again = install_into(root);
    let kept = std::fs::read_to_string(&config).expect("read the config after reinstalling");
    assert!(
        kept.starts_with("# mine\n"),
        "the second install overwrote the config:\n{}",
        String::from_utf8_lossy(&again.stderr)
    );
    assert!(
        String::from_utf8_lossy(&again.stderr).contains("kept"),
        "the second install did not say it kept the config:\n{}",
        String::from_utf8_lossy(&again.stderr)
    );
    assert!(root.join(BINARY).is_file() && root.join(UNIT).is_file());
}

/// Asserts that the unit sets each key to exactly its value.
fn assert_sets(unit: &str, settings: &[(&str, &str)]) {
    for (key, value) in settings {
        assert_eq!(
            unit_values(unit, key),
            [*value],
            "the unit must set {key}={value}"
        );
    }
}

/// The space-separated values of every `key=` line of a unit, in order.
fn unit_values(unit: &str, key: &str) -> Vec<String> {
    let prefix = format!("{key}=");
    unit.lines()
        .filter_map(|line| line.trim().strip_prefix(&prefix))
        .flat_map(|value| value.split_whitespace().map(str::to_owned))
        .collect()
}

/// Installs into a fresh root under `tmp` and returns the installed unit's text and the path of
/// a copy of it to analyse. systemd-analyze verify checks that the binaries of ExecStart= and
/// ExecStopPost= exist, and with --root it looks for the system's targets and /bin/kill under the
/// root too. So the copy, named guard.service, names the binary installed under the root.
fn installed_unit(tmp: &TempDir) -> (String, PathBuf) {
    let root = &tmp.0;
    install_into(root);
    let unit = std::fs::read_to_string(root.join(UNIT)).expect("read the installed unit");
    let installed_binary = root.join(BINARY);
    let copy_dir: PathBuf = root.join("verify");
    std::fs::create_dir_all(&copy_dir).expect("create the verify dir");
    let copy = copy_dir.join("guard.service");
    std::fs::write(
        &copy,
        unit.replace(
            "/usr/local/bin/guard",
            installed_binary.to_str().expect("a UTF-8 temp path"),
        ),
    )
    .expect("write the unit copy");
    (unit, copy)
}

/// The sorted capabilities of [`CAPABILITIES`].
fn expected_capabilities() -> Vec<String> {
    let mut expected: Vec<String> = CAPABILITIES.iter().map(|c| (*c).to_owned()).collect();
    expected.sort();
    expected
}

#[test]
fn the_systemd_unit_verifies() {
    let tmp = TempDir::new("guard-install-unit");
    let (unit, copy) = installed_unit(&tmp);

    let verify = Command::new("systemd-analyze")
        .arg("verify")
        .arg(&copy)
        .output()
        .expect("start systemd-analyze (package systemd)");
    guard_tests::assert_unit_verifies(&verify);

    let expected = expected_capabilities();
    for key in ["AmbientCapabilities", "CapabilityBoundingSet"] {
        let mut granted = unit_values(&unit, key);
        granted.sort();
        assert_eq!(granted, expected, "{key}= grants other capabilities");
    }
    assert_sets(
        &unit,
        &[
            ("NoNewPrivileges", "yes"),
            ("ProtectSystem", "strict"),
            ("ProtectHome", "yes"),
            ("ProtectControlGroups", "no"),
        ],
    );
    assert!(
        unit.lines()
            .any(|line| line == "ExecStart=/usr/local/bin/guard run --config /etc/guard/guard.toml"),
        "unexpected ExecStart"
    );
}

/// `systemd-analyze security` rates the unit copy at `copy` at [`MAX_EXPOSURE_TENTHS`] or less.
fn assert_exposure_at_most_3(copy: &Path) {
    // --threshold counts tenths: the exit status fails above 3.0.
    let security = run(Command::new("systemd-analyze")
        .args(["security", "--offline=yes"])
        .arg(format!("--threshold={MAX_EXPOSURE_TENTHS}"))
        .arg(copy));
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&security.stdout),
        String::from_utf8_lossy(&security.stderr)
    );
    let exposure = guard_tests::exposure_tenths(&report).unwrap_or_else(|| {
        panic!("systemd-analyze security printed no overall exposure level:\n{report}")
    });
    assert!(
        exposure <= MAX_EXPOSURE_TENTHS,
        "overall exposure {}.{} is above {}.{}:\n{report}",
        exposure / 10,
        exposure % 10,
        MAX_EXPOSURE_TENTHS / 10,
        MAX_EXPOSURE_TENTHS % 10
    );
    assert!(
        security.status.success(),
        "systemd-analyze security --threshold={MAX_EXPOSURE_TENTHS} failed ({}):\n{report}",
        security.status
    );
}

/// The settings the score rests on: the bounding set, the system call allow list, the
/// sandboxing keys, and `guard restore` after a stop.
fn assert_confined(unit: &str) {
    let mut bounding = unit_values(unit, "CapabilityBoundingSet");
    bounding.sort();
    assert_eq!(
        bounding,
        expected_capabilities(),
        "the bounding set must be exactly CAP_BPF CAP_PERFMON"
    );
    let filter = unit_values(unit, "SystemCallFilter");
    for call in ["@system-service", "bpf", "perf_event_open"] {
        assert!(
            filter.iter().any(|c| c == call),
            "SystemCallFilter= lacks {call}: {filter:?}"
        );
    }
    assert!(
        filter.iter().all(|c| !c.starts_with('~')),
        "SystemCallFilter= must stay an allow list: {filter:?}"
    );
    assert_sets(
        unit,
        &[
            ("SystemCallErrorNumber", "EPERM"),
            ("UMask", "0077"),
            ("PrivateDevices", "yes"),
            ("ProtectKernelTunables", "yes"),
            ("ProtectControlGroups", "no"),
            ("ProtectProc", "default"),
            ("LimitMEMLOCK", "infinity"),
        ],
    );
    assert!(
        unit.lines()
            .any(|line| line
                == "ExecStopPost=/usr/local/bin/guard restore --state-dir /var/lib/guard"),
        "ExecStopPost= must run `guard restore` on the state dir"
    );
}

/// The settings guard needs to keep working.
fn assert_guard_keeps_working(unit: &str) {
    // Writable cgroups and state; /proc whole (other users' processes, /proc/pressure, ...).
    let writable = unit_values(unit, "ReadWritePaths");
    for path in ["/sys/fs/cgroup", "/var/lib/guard"] {
        assert!(
            writable.iter().any(|p| p == path),
            "ReadWritePaths= lacks {path}"
        );
    }
    assert_eq!(
        unit_values(unit, "LogsDirectory"),
        ["guard"],
        "/var/log/guard is writable for the access log"
    );
    for key in [
        "ProcSubset",
        "PrivateUsers",
        "PrivateNetwork",
        "User",
        "DynamicUser",
    ] {
        assert!(
            unit_values(unit, key).is_empty(),
            "{key}= would break guard (cgroups, /proc, capabilities or clients)"
        );
    }
    // NVML's devices reach the private /dev.
    let binds = unit_values(unit, "BindPaths");
    for node in ["-/dev/nvidiactl", "-/dev/nvidia0"] {
        assert!(binds.iter().any(|b| b == node), "BindPaths= lacks {node}");
    }
    let devices = unit_values(unit, "DeviceAllow");
    for group in ["char-nvidia", "char-nvidiactl", "char-nvidia-frontend"] {
        assert!(
            devices.iter().any(|d| d == group),
            "DeviceAllow= lacks {group}"
        );
    }
}

#[test]
fn the_systemd_unit_scores_3_or_less() {
    let tmp = TempDir::new("guard-install-security");
    let (unit, copy) = installed_unit(&tmp);
    assert_exposure_at_most_3(&copy);
    // The settings the score rests on, and those guard needs to keep working.
    assert_confined(&unit);
    assert_guard_keeps_working(&unit);
}

#[test]
fn exposure_levels_parse() {
    assert_eq!(
        guard_tests::exposure_tenths(
            "x\n\u{2192} Overall exposure level for guard.service: 2.4 OK \u{1f642}\n"
        ),
        Some(24)
    );
    assert_eq!(
        guard_tests::exposure_tenths("Overall exposure level for guard.service: 10.0 UNSAFE"),
        Some(100)
    );
    assert_eq!(
        guard_tests::exposure_tenths("Overall exposure level for x.service: 2.4"),
        None
    );
    assert_eq!(guard_tests::exposure_tenths("nothing"), None);
}
