//! `cargo xtask conformance`: llama.cpp's own server test suite, run straight against
//! llama-server and then through guard (`conformance-server` puts guard where the suite
//! expects the server), from the dev cache with the cached model in place of the suite's.
//! A test that passes straight and fails through guard is run once more on both sides, so a
//! flake is set aside, not blamed on guard; any left fail the task.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::Command,
    time::Instant,
};

use anyhow::{Context as _, Result, bail};
use serde::Deserialize;

use crate::setup::{self, Installed, cache_dir, run};

/// The suite's own requirements, plus the plugin that writes one JSON line per report.
const EXTRA_PACKAGES: &[&str] = &["pytest-reportlog==1.0.0"];
/// Two workers on two cores: each test starts its own server, mostly waiting on it.
const WORKERS: &str = "2";

#[derive(Clone, Copy, PartialEq, Eq)]
enum Side {
    Straight,
    Through,
}

impl Side {
    fn name(self) -> &'static str {
        match self {
            Self::Straight => "straight",
            Self::Through => "through",
        }
    }
}

/// What one run of the suite says of each test: passed or not.
type Results = BTreeMap<String, bool>;

pub fn conformance(pytest_args: &[String]) -> Result<()> {
    let installed = setup::all()?;
    let suite = crate::llama::sources(&cache_dir())?.join("tools/server/tests");
    let pytest = venv(&suite)?;
    crate::tasks::build_guard_and("conformance-server", false)?;
    let runner = Runner {
        pytest,
        suite,
        installed,
        extra: pytest_args.to_vec(),
    };
    let started = Instant::now();
    let straight = runner.run(Side::Straight, None)?;
    let through = runner.run(Side::Through, None)?;
    let suspects: Vec<String> = differing(&straight, &through);
    let confirmed = if suspects.is_empty() {
        Vec::new()
    } else {
        let again_straight = runner.run(Side::Straight, Some(&suspects))?;
        let again_through = runner.run(Side::Through, Some(&suspects))?;
        differing(&again_straight, &again_through)
    };
    report(&straight, &through, &suspects, &confirmed, started);
    if !confirmed.is_empty() {
        bail!(
            "{} test(s) pass straight and fail through guard",
            confirmed.len()
        );
    }
    Ok(())
}

/// Tests that pass in `straight` and not in `through`.
fn differing(straight: &Results, through: &Results) -> Vec<String> {
    straight
        .iter()
        .filter(|(id, passed)| **passed && !through.get(*id).copied().unwrap_or(false))
        .map(|(id, _)| id.clone())
        .collect()
}

fn report(
    straight: &Results,
    through: &Results,
    suspects: &[String],
    confirmed: &[String],
    started: Instant,
) {
    let passed = |results: &Results| results.values().filter(|p| **p).count();
    println!(
        "\nllama.cpp server tests (not slow), {} run",
        straight.len()
    );
    println!("  passed straight          {}", passed(straight));
    println!("  passed through guard     {}", passed(through));
    println!(
        "  differing                {} ({} set aside as flaky after a rerun on both sides)",
        confirmed.len(),
        suspects.len() - confirmed.len()
    );
    for id in suspects {
        let verdict = if confirmed.contains(id) {
            "DIFFERS"
        } else {
            "flaky  "
        };
        println!("    {verdict} {id}");
    }
    println!("  took {:.0} s", started.elapsed().as_secs_f64());
}

/// A virtual environment with the suite's requirements; returns its pytest.
fn venv(suite: &Path) -> Result<PathBuf> {
    let venv = cache_dir().join("conformance");
    let pytest = venv.join("bin/pytest");
    let marker = venv.join(".complete");
    if marker.is_file() {
        return Ok(pytest);
    }
    run(Command::new("python3").args(["-m", "venv"]).arg(&venv))
        .context("fix: apt-get install python3-venv")?;
    run(Command::new(venv.join("bin/pip"))
        .args(["install", "-q", "--disable-pip-version-check", "-r"])
        .arg(suite.join("requirements.txt"))
        .args(EXTRA_PACKAGES))
    .context("pip install of the suite's requirements failed; fix: check that pip reaches the package index")?;
    std::fs::write(&marker, "").context("marking the venv complete")?;
    Ok(pytest)
}

struct Runner {
    pytest: PathBuf,
    suite: PathBuf,
    installed: Installed,
    extra: Vec<String>,
}

impl Runner {
    /// Runs the suite (or `only` these tests) on one side; a test that fails is a result,
    /// not an error.
    fn run(&self, side: Side, only: Option<&[String]>) -> Result<Results> {
        let target = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/debug");
        let log = std::env::temp_dir().join(format!("guard-conformance-{}.jsonl", side.name()));
        let _ = std::fs::remove_file(&log);
        eprintln!(
            "conformance: {} ({} tests)",
            side.name(),
            only.map_or_else(|| "all".to_owned(), |ids| ids.len().to_string())
        );
        // A network namespace of its own: the suite's fixed ports (8080, 8090) meet nothing.
        let mut pytest = Command::new("unshare");
        pytest
            .args([
                "--net",
                "--",
                "sh",
                "-c",
                r#"ip link set lo up && exec "$0" "$@""#,
            ])
            .arg(&self.pytest)
            .args(["-q", "-p", "no:cacheprovider", "-n", WORKERS])
            .arg(format!("--report-log={}", log.display()))
            .current_dir(&self.suite)
            .env("LLAMA_SERVER_BIN_PATH", target.join("conformance-server"))
            .env("CONFORMANCE_MODE", side.name())
            .env("CONFORMANCE_LLAMA_SERVER", &self.installed.llama.server)
            .env("CONFORMANCE_MODEL", &self.installed.llama.model)
            .env("CONFORMANCE_GUARD", target.join("guard"));
        match only {
            Some(ids) => pytest.args(ids),
            None => pytest.args(["-m", "not slow"]).args(&self.extra),
        };
        // pytest exits 1 when a test failed: the log says which.
        let status = pytest.status().context("cannot start pytest")?;
        if !matches!(status.code(), Some(0 | 1)) {
            bail!("pytest ({}) exited with {status}", side.name());
        }
        read_log(&log)
    }
}

/// One line of pytest-reportlog's file; only test reports matter.
#[derive(Deserialize)]
struct Report {
    #[serde(rename = "$report_type")]
    kind: String,
    #[serde(default)]
    nodeid: String,
    #[serde(default)]
    when: String,
    #[serde(default)]
    outcome: String,
}

/// A test passed when its call passed and neither its setup nor its teardown failed.
fn read_log(log: &Path) -> Result<Results> {
    let text =
        std::fs::read_to_string(log).with_context(|| format!("reading {}", log.display()))?;
    let mut results = Results::new();
    for line in text.lines() {
        let report: Report = serde_json::from_str(line)
            .with_context(|| format!("a line of {} is not a report", log.display()))?;
        if report.kind != "TestReport" {
            continue;
        }
        let passed = results.entry(report.nodeid).or_insert(true);
        match (report.when.as_str(), report.outcome.as_str()) {
            ("call", "passed") | ("setup" | "teardown", "passed") => {}
            _ => *passed = false,
        }
    }
    Ok(results)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_test_passes_only_when_every_phase_passed() {
        let dir = std::env::temp_dir().join(format!("xtask-reportlog-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let log = dir.join("log.jsonl");
        let line = |id: &str, when: &str, outcome: &str| {
            format!(
                r#"{{"$report_type": "TestReport", "nodeid": "{id}", "when": "{when}", "outcome": "{outcome}"}}"#
            )
        };
        let lines = [
            r#"{"$report_type": "SessionStart", "pytest_version": "8"}"#.to_owned(),
            line("a", "setup", "passed"),
            line("a", "call", "passed"),
            line("a", "teardown", "passed"),
            line("b", "setup", "passed"),
            line("b", "call", "failed"),
            line("c", "setup", "skipped"),
            line("d", "call", "passed"),
            line("d", "teardown", "failed"),
        ];
        std::fs::write(&log, lines.join("\n")).expect("write");
        let results = read_log(&log).expect("read");
        let passing: Vec<&str> = results
            .iter()
            .filter(|(_, p)| **p)
            .map(|(id, _)| id.as_str())
            .collect();
        assert_eq!(passing, ["a"]);
        let through = Results::from([("a".to_owned(), false)]);
        assert_eq!(differing(&results, &through), ["a"]);
        let _ = std::fs::remove_dir_all(dir);
    }
}
