//! `cargo xtask gpu-check`: starts the release guard for a few seconds and prints what its NVML
//! path reads (the `guard_gpu_*` metrics, /status's GPU section, and `guard doctor`). Meant
//! for a machine with an NVIDIA GPU; elsewhere it shows `guard_gpu_available 0` and why.

use std::{
    io::{BufRead as _, BufReader, Read as _, Write as _},
    net::{TcpListener, TcpStream},
    path::Path,
    process::{Command, Stdio},
};

use anyhow::{Context as _, Result, bail};

pub fn check(guard: &Path) -> Result<()> {
    let port = |what: &str| -> Result<u16> {
        Ok(TcpListener::bind("127.0.0.1:0")
            .with_context(|| format!("a free port for {what}"))?
            .local_addr()?
            .port())
    };
    let (listen, metrics) = (port("listen")?, port("metrics")?);
    let dir = std::env::temp_dir().join(format!("guard-gpu-check-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let config = dir.join("guard.toml");
    std::fs::write(
        &config,
        format!(
            "[server]\nlisten = \"127.0.0.1:{listen}\"\n[metrics]\nlisten = \"127.0.0.1:{metrics}\"\n[watch]\ninterval_ms = 500\n"
        ),
    )?;
    let mut child = Command::new(guard)
        .args(["run", "--config"])
        .arg(&config)
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {}", guard.display()))?;
    let mut log = BufReader::new(child.stderr.take().context("guard's stderr")?);
    let mut line = String::new();
    while log.read_line(&mut line)? > 0 && !line.contains("guard is serving") {
        eprint!("guard: {line}");
        line.clear();
    }
    // Two watcher rounds, so the GPU readings are in.
    std::thread::sleep(std::time::Duration::from_millis(1_200));
    let text = get(metrics, "/metrics")?;
    let status = get(metrics, "/status")?;
    let _ = child.kill();
    let _ = child.wait();
    let doctor = Command::new(guard)
        .args(["doctor", "--config"])
        .arg(&config)
        .output()?;
    let _ = std::fs::remove_dir_all(&dir);
    println!("== guard_gpu_* on /metrics");
    text.lines()
        .filter(|l| l.starts_with("guard_gpu"))
        .for_each(|l| println!("{l}"));
    println!("== /status watch.gpu");
    let gpu = status
        .find("\"gpu\":")
        .map_or("(none)", |at| &status[at..status.len().min(at + 1_500)]);
    println!("{gpu}");
    println!("== guard doctor");
    print!("{}", String::from_utf8_lossy(&doctor.stdout));
    if !text.contains("guard_gpu_available") {
        bail!("guard exported no guard_gpu_available");
    }
    Ok(())
}

fn get(port: u16, path: &str) -> Result<String> {
    let mut stream = TcpStream::connect(("127.0.0.1", port))?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: guard\r\nConnection: close\r\n\r\n"
    )?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    Ok(response
        .split_once("\r\n\r\n")
        .map_or(response.clone(), |(_, body)| body.to_owned()))
}
