//! `guard check-config` as strict as `guard run` and a reload, and `guard exec`'s exit codes,
//! as a user meets them: every problem at once with file:line: key in plain words, an empty
//! file refused by both, a port another program holds refused and one a running guard holds
//! only a warning; exec exits as sysexits(3) says, or with its command's own status.

use std::{path::Path, process::Command};

use guard_tests::{TempDir, TestCgroup, free_addr, guard_bin, require_root, servers::GuardProcess};

/// Runs guard's subcommand `args[0]` with `--config` and the rest of `args`: its exit code,
/// stdout and stderr.
fn guard(args: &[&str], config: &Path) -> (Option<i32>, String, String) {
    let output = Command::new(guard_bin())
        .arg(args[0])
        .arg("--config")
        .arg(config)
        .args(&args[1..])
        .output()
        .expect("run guard");
    (
        output.status.code(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// Writes `text` to a file of `dir` and returns its path.
fn config_file(dir: &TempDir, name: &str, text: &str) -> std::path::PathBuf {
    let path = dir.0.join(name);
    std::fs::write(&path, text).expect("write config");
    path
}

#[test]
fn every_problem_is_named_at_once_in_plain_words() {
    let dir = TempDir::new("guard-config-all");
    let text = "[class.chat]\n\n[upstream]\nmax_concurrency = \"two\"\nconnect_timeout_ms = -5\n\
                [server]\nlisen = 1\n[[classify.rule]]\npath_prefix = \"/x\"\n";
    let path = config_file(&dir, "all.toml", text);
    let (code, _, stderr) = guard(&["check-config", "--file-only"], &path);
    assert_eq!(code, Some(64), "{stderr}");
    let file = path.display();
    for expected in [
        format!(
            "{file}:1: classify.default: unknown class `interactive`: known are chat. A \
             [class.NAME] table replaces the built-in classes (batch, interactive)"
        ),
        format!(
            "{file}:4: upstream.max_concurrency: expected a whole number from 1 to 65536, \
             found the string \"two\""
        ),
        format!(
            "{file}:5: upstream.connect_timeout_ms: -5 is out of range: use a whole number of \
             milliseconds from 1 to 604800000"
        ),
        format!("{file}:7: server.lisen: unknown key `lisen` (did you mean `listen`?)"),
        format!("{file}:8: classify.rule[0].class: a rule needs the class it gives"),
    ] {
        assert!(stderr.contains(&expected), "{expected}\nnot in:\n{stderr}");
    }
    assert_eq!(stderr.lines().count(), 5, "one line each:\n{stderr}");
    assert!(!stderr.contains("expected u32"), "{stderr}");
}

#[test]
fn an_empty_file_is_refused_by_check_config_and_run_alike() {
    let dir = TempDir::new("guard-config-empty");
    let path = config_file(&dir, "empty.toml", "# only a comment\n");
    for command in ["check-config", "run"] {
        let (code, _, stderr) = guard(&[command], &path);
        assert_eq!(code, Some(64), "{command}: {stderr}");
        assert!(stderr.contains("sets no key"), "{command}: {stderr}");
    }
}

#[test]
fn a_port_another_program_holds_is_refused_naming_it() {
    let dir = TempDir::new("guard-config-port");
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = taken.local_addr().expect("addr");
    let text = format!(
        "[server]\nlisten = \"{addr}\"\n[metrics]\nlisten = \"{}\"\n",
        free_addr()
    );
    let path = config_file(&dir, "port.toml", &text);
    let (code, _, stderr) = guard(&["check-config"], &path);
    assert_eq!(code, Some(64), "{stderr}");
    let expected = format!(
        "{}:2: server.listen: {addr} is taken by {} (pid {})",
        path.display(),
        std::env::current_exe()
            .ok()
            .and_then(|exe| Some(exe.file_name()?.to_string_lossy().into_owned()))
            .expect("this test's name"),
        std::process::id()
    );
    assert!(stderr.contains(&expected), "{expected}\nnot in:\n{stderr}");
    let (code, stdout, _) = guard(&["check-config", "--file-only"], &path);
    assert_eq!(code, Some(0), "the file alone is fine: {stdout}");
}

#[test]
fn the_ports_of_a_running_guard_are_only_a_warning() {
    require_root();
    let guard_process = GuardProcess::start(free_addr(), "ollama", "");
    let (code, stdout, stderr) = guard(&["check-config"], &guard_process.config_path);
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    let warning = format!(
        "server.listen: {} is held by a running guard (pid {})",
        guard_process.listen,
        guard_process.pid()
    );
    assert!(stderr.contains(&warning), "{warning}\nnot in:\n{stderr}");
    assert!(stdout.contains("warnings above"), "{stdout}");
}

#[test]
fn exec_exits_as_sysexits_says_or_with_its_commands_own_status() {
    let dir = TempDir::new("guard-config-exec");
    let plain = dir.0.join("not-a-cgroup");
    let text = format!(
        "[class.interactive]\n[class.batch]\npriority = 10\n[class.odd]\ncgroup = \"{}\"\n",
        plain.display()
    );
    let path = config_file(&dir, "exec.toml", &text);
    let exec = |class: &str, command: &[&str]| {
        let mut args = vec!["exec", "--class", class, "--"];
        args.extend_from_slice(command);
        guard(&args, &path)
    };
    assert_eq!(exec("nope", &["true"]).0, Some(64), "unknown class");
    let (code, _, stderr) = exec("batch", &["true"]);
    assert_eq!(code, Some(78), "{stderr}");
    assert!(
        stderr.contains("cgroup = \"/sys/fs/cgroup/guard/batch\""),
        "{stderr}"
    );
    let (code, _, stderr) = exec("odd", &["true"]);
    assert_eq!(code, Some(78), "{stderr}");
    assert!(
        stderr.contains("not inside a cgroup filesystem"),
        "{stderr}"
    );
    assert!(!plain.exists(), "nothing made outside a cgroup filesystem");
    let missing = dir.0.join("missing.toml");
    assert_eq!(
        guard(&["exec", "--class", "batch", "--", "true"], &missing).0,
        Some(66)
    );
    let bad = config_file(&dir, "bad.toml", "[upstream]\nmax_concurrency = 0\n");
    assert_eq!(
        guard(&["exec", "--class", "batch", "--", "true"], &bad).0,
        Some(78)
    );
}

#[test]
fn exec_runs_its_command_in_the_cgroup_and_exits_with_its_status() {
    require_root();
    let dir = TempDir::new("guard-config-exec-cgroup");
    // `guard exec` makes the cgroup; removed on drop, whatever the asserts below say.
    let cgroup = TestCgroup {
        path: guard_tests::cgroup2_root().join(format!("guard-test-exec-{}", std::process::id())),
    };
    let text = format!(
        "[class.interactive]\n[class.batch]\ncgroup = \"{}\"\n",
        cgroup.path.display()
    );
    let path = config_file(&dir, "exec.toml", &text);
    let script = "grep -q guard-test-exec /proc/self/cgroup && exit 7; exit 1";
    let args = ["exec", "--class", "batch", "--", "sh", "-c", script];
    let (code, _, stderr) = guard(&args, &path);
    assert_eq!(
        code,
        Some(7),
        "its own status, from inside the cgroup: {stderr}"
    );
    let (code, _, _) = guard(&["exec", "--class", "batch", "--", "/no/such/cmd"], &path);
    assert_eq!(code, Some(127));
    assert!(cgroup.path.is_dir(), "guard exec made the class's cgroup");
}
