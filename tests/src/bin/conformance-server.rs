//! The llama-server that llama.cpp's server test suite starts, for `cargo xtask conformance`:
//! it takes llama-server's own arguments, puts the cached model in place of the models the
//! suite names (no network here), and then either runs llama-server as asked (`straight`) or
//! moves it to a port of its own and puts guard where the suite expects the server
//! (`through`), on every address of `--host`. SIGTERM stops both and waits for them, so the
//! suite's next server finds the port free.
//!
//! Environment: `CONFORMANCE_MODE` (straight | through), `CONFORMANCE_LLAMA_SERVER`,
//! `CONFORMANCE_MODEL`, `CONFORMANCE_GUARD`.

use std::{
    net::{SocketAddr, TcpListener},
    os::unix::process::CommandExt as _,
    process::{Child, Command, ExitCode},
    time::{Duration, Instant},
};

use nix::sys::signal::{SigSet, Signal, kill};
use nix::unistd::Pid;

/// Arguments that name a model to fetch or read; each takes a value.
const MODEL_ARGS: &[&str] = &[
    "--hf-repo",
    "-hf",
    "-hfr",
    "--hf-file",
    "-hff",
    "--model-url",
    "-mu",
    "--model",
    "-m",
];

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (mode, llama, model) = (
        env("CONFORMANCE_MODE"),
        env("CONFORMANCE_LLAMA_SERVER"),
        env("CONFORMANCE_MODEL"),
    );
    let args = with_model(&args, &model);
    if mode == "straight" {
        let err = Command::new(llama).args(&args).exec();
        eprintln!("conformance-server: cannot run llama-server: {err}");
        return ExitCode::from(127);
    }
    through(&llama, args)
}

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("conformance-server: {name} is not set"))
}

/// `args` without the suite's model arguments, and with the cached model where it named one.
fn with_model(args: &[String], model: &str) -> Vec<String> {
    let mut out = Vec::with_capacity(args.len() + 2);
    let mut named = false;
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        if MODEL_ARGS.contains(&arg.as_str()) {
            it.next();
            named = true;
        } else {
            out.push(arg.clone());
        }
    }
    if named {
        out.extend(["--model".to_owned(), model.to_owned()]);
    }
    out
}

/// The value after `flag`, if given.
fn value<'a>(args: &'a [String], flag: &str) -> Option<&'a str> {
    let at = args.iter().position(|a| a == flag)?;
    args.get(at + 1).map(String::as_str)
}

fn set_value(args: &mut Vec<String>, flag: &str, new: String) {
    match args.iter().position(|a| a == flag) {
        Some(at) if at + 1 < args.len() => args[at + 1] = new,
        _ => args.extend([flag.to_owned(), new]),
    }
}

/// llama-server on a free port of loopback, guard on the addresses the suite asked for.
fn through(llama: &str, mut args: Vec<String>) -> ExitCode {
    let port: u16 = value(&args, "--port")
        .and_then(|p| p.parse().ok())
        .unwrap_or(8080);
    let hosts = value(&args, "--host").unwrap_or("127.0.0.1").to_owned();
    let slots: u32 = value(&args, "--parallel")
        .or_else(|| value(&args, "-np"))
        .and_then(|n| n.parse().ok())
        .unwrap_or(4);
    set_value(&mut args, "--host", "127.0.0.1".to_owned());
    // Blocked before the children exist, so that no signal is lost between a spawn and the
    // wait; each child unblocks them again (`child`).
    let signals = SigSet::from_iter([Signal::SIGTERM, Signal::SIGINT, Signal::SIGCHLD]);
    signals.thread_block().expect("block signals");
    let Some((server, private)) = start_llama(llama, &mut args) else {
        eprintln!("conformance-server: llama-server did not start on any of {ATTEMPTS} ports");
        return ExitCode::from(1);
    };
    let dir = std::env::temp_dir().join(format!("conformance-guard-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("conformance-server: a directory for guard's config");
    let config = dir.join("guard.toml");
    let listen: Vec<String> = hosts
        .split(',')
        .map(|host| {
            SocketAddr::new(host.trim().parse().expect("an IP in --host"), port).to_string()
        })
        .collect();
    std::fs::write(&config, guard_config(&listen, private, slots)).expect("write guard.toml");
    let mut guard = Command::new(env("CONFORMANCE_GUARD"));
    guard.args(["run", "--config"]).arg(&config);
    let children = [server, child(&mut guard).expect("start guard")];
    let code = supervise(children, &signals);
    let _ = std::fs::remove_dir_all(dir);
    code
}

/// Ports tried for llama-server: one asked free a moment ago may be taken by the time it
/// binds (any client's connection may get it as its own port).
const ATTEMPTS: usize = 5;

/// Starts llama-server on a free loopback port, trying another where it exits before it
/// listens; returns it and its port.
fn start_llama(llama: &str, args: &mut Vec<String>) -> Option<(Child, u16)> {
    for _ in 0..ATTEMPTS {
        let private = free_port();
        set_value(args, "--port", private.to_string());
        let mut server = Command::new(llama);
        server.args(args.iter());
        if std::env::var_os("AIP_HTTP_PORT").is_some() {
            server.env("AIP_HTTP_PORT", private.to_string());
        }
        let mut server = child(&mut server).expect("start llama-server");
        // It listens before it loads the model (answering 503 meanwhile).
        loop {
            if server.try_wait().ok().flatten().is_some() {
                break;
            }
            if std::net::TcpStream::connect(("127.0.0.1", private)).is_ok() {
                return Some((server, private));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    None
}

/// Starts `command` with every signal unblocked (a child inherits the blocked mask) and set
/// to die with this process, so that a suite that kills this wrapper frees its port.
fn child(command: &mut Command) -> std::io::Result<Child> {
    guard_sys::process::unblocked_and_tied(command);
    command.spawn()
}

/// Waits for a signal: a stop request stops both; one child's end stops the other.
fn supervise(mut children: [Child; 2], signals: &SigSet) -> ExitCode {
    loop {
        let signal = signals.wait().expect("sigwait");
        let ended = children
            .iter_mut()
            .find_map(|c| c.try_wait().ok().flatten());
        if signal != Signal::SIGCHLD || ended.is_some() {
            stop(&mut children);
            let code = ended.and_then(|status| status.code()).unwrap_or(0);
            return ExitCode::from(u8::try_from(code).unwrap_or(1));
        }
    }
}

/// SIGTERM to both, then SIGKILL to what is still running after `STOP_GRACE` (llama-server
/// waits for an open stream's client), so the suite's next server finds the port free.
fn stop(children: &mut [Child; 2]) {
    const STOP_GRACE: Duration = Duration::from_secs(3);
    for child in children.iter() {
        let _ = kill(Pid::from_raw(child.id() as i32), Signal::SIGTERM);
    }
    let deadline = Instant::now() + STOP_GRACE;
    for child in children.iter_mut() {
        while child.try_wait().ok().flatten().is_none() {
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// guard as a user who wants it invisible would set it: one class without a deadline, a
/// queue far longer than the suite ever fills, the upstream's slots as its concurrency.
fn guard_config(listen: &[String], upstream: u16, slots: u32) -> String {
    let listen = listen
        .iter()
        .map(|addr| format!("\"{addr}\""))
        .collect::<Vec<_>>()
        .join(", ");
    format!(
        "[server]\nlisten = [{listen}]\ndrain_grace_ms = 0\n\
         [upstream]\nurl = \"http://127.0.0.1:{upstream}\"\napi = \"openai\"\nmax_concurrency = {slots}\n\
         [metrics]\nlisten = \"127.0.0.1:0\"\n\
         [classify]\ndefault = \"suite\"\n\
         [class.suite]\npriority = 0\nmax_queue = 1000\n"
    )
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port on loopback")
}
