//! `cargo xtask kernels`: guard's eBPF test binary inside each Debian kernel of the matrix
//! (5.10, 6.1, 6.12, 7.x), booted under QEMU by `kernels`, and one table of what each showed:
//! boot time, whether the program loaded, close events seen of those expected under a burst,
//! ring-buffer drops, and `guard doctor`'s line on how client closes are seen.

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{Context as _, Result, bail};
use serde::Deserialize;

use crate::{
    kernels::{self, Boot, KERNELS, Kernel},
    setup::{self, cache_dir, run},
};

/// A guest's whole run: a boot of 25-50 s and the eBPF tests, slow under software emulation.
const GUEST_TIMEOUT: Duration = Duration::from_secs(15 * 60);
/// The line `guard doctor` prints on how client closes are seen.
const DOCTOR_LINE: &str = "client closes seen";

/// What one kernel showed.
struct Row {
    series: &'static str,
    release: String,
    boot_s: f64,
    load_ok: bool,
    seen: Option<(u64, u64)>,
    drops: Option<u64>,
    passed: usize,
    failed: usize,
    doctor: String,
    exit_code: i32,
}

impl Row {
    fn ok(&self) -> bool {
        self.exit_code == 0
            && self.failed == 0
            && self.load_ok
            && self.drops == Some(0)
            && self.seen.is_some_and(|(seen, expected)| seen == expected)
    }
}

pub fn kernels(only: Option<&str>) -> Result<()> {
    crate::tasks::require_root("the eBPF tests inside each guest load programs as root")?;
    let chosen: Vec<&Kernel> = KERNELS
        .iter()
        .filter(|k| only.is_none_or(|series| k.series == series))
        .collect();
    if chosen.is_empty() {
        let known: Vec<&str> = KERNELS.iter().map(|k| k.series).collect();
        bail!(
            "no kernel {only:?} in the matrix (known: {})",
            known.join(", ")
        );
    }
    setup::all()?;
    let cache = cache_dir();
    let vng = kernels::ensure_tools(&cache)?;
    if let Err(why) = kernels::qemu_usable() {
        println!("{why}");
        return Ok(());
    }
    let binary = ebpf_test_binary()?;
    let mut rows = Vec::new();
    for kernel in chosen {
        let vmlinuz = kernels::ensure_kernel(&cache, kernel)?;
        eprintln!(
            "kernels: booting {} from {} ({})",
            kernel.series,
            kernel.suite,
            vmlinuz.display()
        );
        let boot = kernels::boot(
            &vng,
            &vmlinuz,
            &guest_script(&binary),
            &cache.join("kernels/rw"),
            GUEST_TIMEOUT,
        )?;
        let row = read_row(kernel.series, &boot);
        if !row.ok() {
            eprintln!(
                "kernels: {} failed; its output:\n{}",
                kernel.series, boot.output
            );
        }
        rows.push(row);
    }
    print_table(&rows);
    let failed: Vec<&str> = rows.iter().filter(|r| !r.ok()).map(|r| r.series).collect();
    if !failed.is_empty() {
        bail!("eBPF failed on kernel(s) {}", failed.join(", "));
    }
    Ok(())
}

/// What the guest runs: its release, doctor's line, then the eBPF tests one at a time (one
/// vCPU), from /tmp (a writable overlay; the shared root is read-only).
fn guest_script(binary: &Path) -> String {
    let guard = binary
        .parent()
        .and_then(Path::parent)
        .map_or_else(|| PathBuf::from("guard"), |dir| dir.join("guard"));
    format!(
        "cd /tmp && echo \"release: $(uname -r)\" && \
         {guard} doctor 2>&1 | grep -F '{DOCTOR_LINE}'; \
         exec {binary} --test-threads=1 --nocapture",
        guard = guard.display(),
        binary = binary.display(),
    )
}

/// Reads the guest's output: `release:`, doctor's line, libtest's per-test lines and the
/// burst test's `burst: N close events of M connections, D ring drops`.
fn read_row(series: &'static str, boot: &Boot) -> Row {
    let lines = || boot.output.lines().map(str::trim);
    let field = |prefix: &str| lines().find_map(|l| l.strip_prefix(prefix).map(str::to_owned));
    // libtest may have printed "test NAME ... " on the same line before it.
    let burst = lines()
        .find_map(|l| l.split_once("burst: ").map(|(_, rest)| rest.to_owned()))
        .and_then(|text| {
            let numbers: Vec<u64> = text
                .split(|c: char| !c.is_ascii_digit())
                .filter_map(|n| n.parse().ok())
                .collect();
            match numbers[..] {
                [seen, expected, drops] => Some(((seen, expected), drops)),
                _ => None,
            }
        });
    // libtest's summary, "test result: ok. 9 passed; 0 failed; ...": a test's own line may
    // be split by what it prints.
    let summary = field("test result: ").unwrap_or_default();
    let count = |word: &str| -> usize {
        summary
            .split(['.', ';'])
            .find_map(|part| part.trim().strip_suffix(word))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or(0)
    };
    Row {
        series,
        release: field("release: ").unwrap_or_default(),
        boot_s: boot.seconds,
        load_ok: lines().any(|l| l == "test fin_on_ipv4_is_reported_with_its_4_tuple ... ok"),
        seen: burst.map(|(seen, _)| seen),
        drops: burst.map(|(_, drops)| drops),
        passed: count("passed"),
        failed: count("failed"),
        doctor: lines()
            .find_map(|l| {
                l.split_once(DOCTOR_LINE)
                    .map(|(_, rest)| rest.trim().to_owned())
            })
            .unwrap_or_default(),
        exit_code: boot.exit_code,
    }
}

fn print_table(rows: &[Row]) {
    println!(
        "\n| kernel | release | run s | load ok | close events seen / expected | lost | tests | verdict |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for row in rows {
        let seen = row
            .seen
            .map_or_else(|| "-".to_owned(), |(s, e)| format!("{s} / {e}"));
        println!(
            "| {} | {} | {:.0} | {} | {seen} | {} | {} passed, {} failed | {} |",
            row.series,
            row.release,
            row.boot_s,
            if row.load_ok { "yes" } else { "no" },
            row.drops.map_or_else(|| "-".to_owned(), |d| d.to_string()),
            row.passed,
            row.failed,
            if row.ok() { "pass" } else { "FAIL" },
        );
    }
    println!("\nguard doctor, `{DOCTOR_LINE}`:");
    for row in rows {
        println!("  {}: {}", row.series, row.doctor);
    }
}

/// One line of cargo's JSON messages: only the test artifact's executable matters.
#[derive(Deserialize)]
struct Artifact {
    reason: String,
    #[serde(default)]
    executable: Option<PathBuf>,
    #[serde(default)]
    target: Option<Target>,
}

#[derive(Deserialize)]
struct Target {
    name: String,
}

/// Builds guard and its eBPF test binary; returns the binary's path.
fn ebpf_test_binary() -> Result<PathBuf> {
    run(crate::tasks::cargo().args(["build", "-p", "guard-cli"])).context("the build failed")?;
    let out = crate::tasks::cargo()
        .args(["test", "-p", "guard-tests", "--test", "ebpf", "--no-run"])
        .args(["--message-format=json"])
        .output()
        .context("cannot run cargo")?;
    if !out.status.success() {
        bail!(
            "building the eBPF tests failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| serde_json::from_str::<Artifact>(line).ok())
        .filter(|a| a.reason == "compiler-artifact")
        .find(|a| a.target.as_ref().is_some_and(|t| t.name == "ebpf"))
        .and_then(|a| a.executable)
        .context("cargo named no executable for the ebpf test")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_guest_run_reads_into_a_row() {
        let output = "release: 6.1.0-57-amd64\n\
            ok      client closes seen                     eBPF on sock/inet_sock_set_state\n\
            test fin_on_ipv4_is_reported_with_its_4_tuple ... ok\n\
            test ten_thousand_connections_lose_no_event ... burst: 10000 close events of 10000 connections, 0 ring drops\n\
            ok\n\
            test result: ok. 2 passed; 0 failed; 0 ignored\n";
        let boot = Boot {
            exit_code: 0,
            seconds: 30.0,
            output: output.to_owned(),
        };
        let row = read_row("6.1", &boot);
        assert!(row.ok());
        assert_eq!(row.seen, Some((10_000, 10_000)));
        assert_eq!((row.passed, row.failed), (2, 0));
        assert_eq!(row.doctor, "eBPF on sock/inet_sock_set_state");
        let failed = Boot {
            output: output.replace("10000 close events", "9999 close events"),
            ..boot
        };
        assert!(!read_row("6.1", &failed).ok());
    }
}
