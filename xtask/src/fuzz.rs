//! `cargo xtask bench fuzz`: each libFuzzer target of `fuzz/` for a million inputs, with the
//! inputs per second it managed. cargo-fuzz is installed on first use; stable rustc takes its
//! `-Z` flags under RUSTC_BOOTSTRAP (the one toolchain this machine kind has).

use std::{path::Path, process::Command, time::Instant};

use anyhow::{Context as _, Result, bail};

use crate::setup::run;

const TARGETS: [&str; 4] = ["request_head", "model_field", "config", "ebpf_event"];
const RUNS: u64 = 1_000_000;
const CARGO_FUZZ: &str = "0.13.2";

pub fn bench() -> Result<()> {
    install()?;
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz");
    println!("fuzz targets, {RUNS} inputs each (libFuzzer, no sanitizer; a panic fails the run):");
    for target in TARGETS {
        let build = Instant::now();
        run(&mut fuzz(&dir, "build", target)).with_context(|| format!("building {target}"))?;
        let built = build.elapsed();
        let started = Instant::now();
        let output = fuzz(&dir, "run", target)
            .args(["--", &format!("-runs={RUNS}"), "-seed=1"])
            .output()
            .with_context(|| format!("running {target}"))?;
        let took = started.elapsed();
        if !output.status.success() {
            let log = String::from_utf8_lossy(&output.stderr);
            bail!("{target} found a failure:\n{}", tail(&log, 40));
        }
        println!(
            "   {target:<13} {RUNS} inputs in {:.1} s: {:.0} inputs/s (built in {:.0} s)",
            took.as_secs_f64(),
            RUNS as f64 / took.as_secs_f64(),
            built.as_secs_f64()
        );
    }
    Ok(())
}

/// `cargo fuzz SUBCOMMAND --sanitizer none TARGET` in `fuzz/` (the code fuzzed is safe Rust
/// but for one read of a fixed-size record; a panic is what is looked for).
fn fuzz(dir: &Path, subcommand: &str, target: &str) -> Command {
    let mut command = Command::new("cargo");
    command.current_dir(dir).env("RUSTC_BOOTSTRAP", "1").args([
        "fuzz",
        subcommand,
        "--sanitizer",
        "none",
        target,
    ]);
    command
}

fn install() -> Result<()> {
    let present = Command::new("cargo")
        .args(["fuzz", "--version"])
        .output()
        .is_ok_and(|out| String::from_utf8_lossy(&out.stdout).contains(CARGO_FUZZ));
    if present {
        return Ok(());
    }
    eprintln!("bench fuzz: installing cargo-fuzz {CARGO_FUZZ} (about a minute)");
    run(Command::new("cargo").args(["install", "cargo-fuzz", "--version", CARGO_FUZZ, "--locked"]))
        .context("installing cargo-fuzz")
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
