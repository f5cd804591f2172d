//! guard's entry point: parses the command line and wires the pieces together.

#![forbid(unsafe_code)]

use std::{io::IsTerminal as _, path::PathBuf, process::ExitCode};

use anyhow::Context as _;
use clap::Parser as _;
use cli::{BenchArgs, Cli, Command, LogbookCommand, UsageArgs};
use guard::{
    config::{self, Config, ConfigError},
    daemon, privileges,
    throttle::{self, state::Restored},
};
use guard_tools::{doctor, logbook, status, usage};

mod cli;
#[cfg(test)]
mod help_test;
#[cfg(test)]
mod readme_test;

/// The exit status for a bad config or command line (docs/design.md §4: sysexits EX_USAGE).
const EXIT_BAD_CONFIG: u8 = 64;

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("GUARD_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        // --help and --version are not errors; a wrong command line is EX_USAGE.
        Err(err) if !err.use_stderr() => err.exit(),
        Err(err) => {
            let _ = err.print();
            return ExitCode::from(EXIT_BAD_CONFIG);
        }
    };
    match run(cli.command) {
        Ok(code) => code,
        Err(err) => {
            eprintln!("guard: {}", guard::error_chain(err.as_ref()));
            ExitCode::FAILURE
        }
    }
}

fn run(command: Command) -> anyhow::Result<ExitCode> {
    match command {
        Command::Run { config } => run_daemon(config),
        Command::CheckConfig { config, file_only } => Ok(check_config(config, file_only)),
        Command::Restore { state_dir } => Ok(if restore(&state_dir) {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        }),
        Command::Status { url, token_file } => {
            let token = token_file
                .map(|file| {
                    std::fs::read_to_string(&file)
                        .with_context(|| format!("reading {}", file.display()))
                })
                .transpose()?;
            let token = token
                .as_deref()
                .and_then(|t| t.lines().next())
                .map(str::trim);
            let table = runtime()?.block_on(status::show(&url, token))?;
            print!("{table}");
            Ok(ExitCode::SUCCESS)
        }
        Command::Exec {
            config,
            class,
            command,
        } => Ok(exec(config, &class, &command)),
        Command::Bench(args) => bench(*args),
        Command::Logbook { logbook, command } => logbook_command(&logbook, command),
        Command::Doctor { config } => {
            let config = match load(config) {
                Ok((config, _)) => config,
                Err(err) => return Ok(bad_config(&err)),
            };
            let (text, runs) = doctor::render(&doctor::run(&config));
            print!("{text}");
            Ok(if runs {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            })
        }
        Command::Usage(args) => usage_command(&args),
    }
}

/// `guard check-config`: every problem of the file, then (unless `file_only`) what this host
/// refuses it, each with file:line:key; exit 64 where any would stop `guard run`.
fn check_config(path: Option<PathBuf>, file_only: bool) -> ExitCode {
    let (config, path) = match load(path) {
        Ok(loaded) => loaded,
        Err(err) => return bad_config(&err),
    };
    let findings = if file_only {
        Vec::new()
    } else {
        guard_tools::host::check(&config)
    };
    let text = path
        .as_ref()
        .and_then(|p| std::fs::read_to_string(p).ok())
        .unwrap_or_default();
    let source = path.map_or("built-in defaults".to_owned(), |p| p.display().to_string());
    for finding in &findings {
        let line = config::line_of_key(&text, &finding.key)
            .map(|l| format!(":{l}"))
            .unwrap_or_default();
        let word = if finding.fatal {
            "bad config"
        } else {
            "warning"
        };
        eprintln!(
            "guard: {word}: {source}{line}: {}: {}",
            finding.key, finding.why
        );
    }
    if findings.iter().any(|f| f.fatal) {
        return ExitCode::from(EXIT_BAD_CONFIG);
    }
    let host = match (file_only, findings.len()) {
        (true, _) => String::new(),
        (false, 0) => "; this host has what it needs".to_owned(),
        (false, 1) => "; 1 warning above".to_owned(),
        (false, n) => format!("; {n} warnings above"),
    };
    println!(
        "{source}: ok ({} classes: {}{host})",
        config.class.len(),
        config.class_names()
    );
    ExitCode::SUCCESS
}

/// `guard exec`: becomes CMD inside the class's cgroup; else exits as sysexits(3) says
/// (guard_tools::exec::ExecError::exit_code).
fn exec(config: Option<PathBuf>, class: &str, command: &[String]) -> ExitCode {
    let config = match load(config) {
        Ok((config, _)) => config,
        Err(err) => {
            for problem in err.problems() {
                eprintln!("guard exec: bad config: {}", guard::error_chain(problem));
            }
            return ExitCode::from(guard_tools::exec::config_exit_code(&err));
        }
    };
    let err = guard_tools::exec::exec(&config, class, command);
    eprintln!("guard exec: {}", guard::error_chain(&err));
    ExitCode::from(err.exit_code())
}

/// `guard run`: restore what a crash left, read the config, take what needs privileges, drop
/// the privileges, then serve.
fn run_daemon(config: Option<PathBuf>) -> anyhow::Result<ExitCode> {
    // First put back what a crashed guard left held, even if this config is broken.
    let given = config_path(config);
    restore(&Config::state_dir_of(given.as_deref()));
    let (config, path) = match load(given) {
        Ok(loaded) => loaded,
        Err(err) => return Ok(bad_config(&err)),
    };
    // Binding and loading eBPF may need privileges; they are dropped before the runtime starts
    // any thread, so that every thread has only what is left.
    let setup = match daemon::Setup::new(&config) {
        Ok(setup) => setup,
        // A class cgroup that cannot be used is a configuration error.
        Err(daemon::DaemonError::Throttle(err)) => {
            eprintln!("guard: bad config: {}", guard::error_chain(&err));
            return Ok(ExitCode::from(EXIT_BAD_CONFIG));
        }
        Err(err) => return Err(err.into()),
    };
    match privileges::keep_only(&privileges::needed(&config, setup.ebpf_attached())) {
        Ok(dropped) if !dropped.is_empty() => tracing::info!(
            dropped = dropped.join(","),
            held = privileges::held().join(","),
            "capabilities dropped"
        ),
        Ok(_) => {}
        Err(err) => {
            let error = guard::error_chain(&err);
            tracing::warn!(%error, "guard keeps capabilities it does not need");
        }
    }
    runtime()?.block_on(daemon::run(config, path, setup))?;
    Ok(ExitCode::SUCCESS)
}

fn bench(args: BenchArgs) -> anyhow::Result<ExitCode> {
    let api = match args.api.as_str() {
        "ollama" => config::Api::Ollama,
        "openai" => config::Api::Openai,
        other => anyhow::bail!("--api {other}: use ollama or openai"),
    };
    let plan = logbook::run::Plan {
        command: std::env::args().collect::<Vec<_>>().join(" "),
        url: args.url,
        api,
        model: args.model,
        runtime: args.runtime,
        runtime_version: args.runtime_version,
        launch_flags: args.launch_flags,
        input: args.input,
        repetitions: args.repeat.max(1),
        class: args.class,
        server_pid: args.server_pid,
        model_file: args.model_file,
        restart: args.restart,
        max_tokens: args.max_tokens,
        decision: args.decision,
        owner: args.owner,
        retest_days: args.retest_days,
    };
    let entry = runtime()?.block_on(logbook::run::run(&plan))?;
    logbook::append(&args.logbook, &entry).context("recording the run")?;
    println!(
        "{}",
        logbook::list(std::slice::from_ref(&entry), logbook::today())
    );
    println!("recorded as {} in {}", entry.id, args.logbook.display());
    Ok(ExitCode::SUCCESS)
}

fn logbook_command(path: &std::path::Path, command: LogbookCommand) -> anyhow::Result<ExitCode> {
    let entries = logbook::read(path)?;
    let today = logbook::today();
    match command {
        LogbookCommand::List => print!("{}", logbook::list(&entries, today)),
        LogbookCommand::Due => {
            let due: Vec<_> = logbook::due(&entries, today).into_iter().cloned().collect();
            print!("{}", logbook::list(&due, today));
            if !due.is_empty() {
                return Ok(ExitCode::FAILURE);
            }
        }
        LogbookCommand::Compare { a, b, format } => {
            let (a, b) = (logbook::find(&entries, &a)?, logbook::find(&entries, &b)?);
            let comparison = logbook::compare::compare(a, b);
            print!("{}", logbook::compare::render(&comparison, format)?);
        }
        LogbookCommand::Report { id, compare, out } => {
            let mut chosen = vec![logbook::find(&entries, &id)?];
            if let Some(other) = compare {
                chosen.push(logbook::find(&entries, &other)?);
            }
            logbook::report::write(&chosen, &out)?;
            println!("wrote {}", out.display());
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `guard usage`: the ledger on standard output, the lines that were not records counted on
/// standard error.
fn usage_command(args: &UsageArgs) -> anyhow::Result<ExitCode> {
    let query = usage::Query::until_now(args.by, args.since);
    let ledger = usage::read(&args.log, &query)?;
    print!("{}", usage::render(&ledger, args.by, args.format)?);
    if ledger.skipped > 0 {
        let lines = if ledger.skipped == 1 { "line" } else { "lines" };
        eprintln!(
            "guard usage: skipped {} {lines} of {} that are not access log records",
            ledger.skipped,
            args.log.display()
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// `--config`, else the default path where it exists (else built-in defaults: none).
fn config_path(path: Option<PathBuf>) -> Option<PathBuf> {
    path.or_else(|| {
        let default = PathBuf::from(config::DEFAULT_PATH);
        default.exists().then_some(default)
    })
}

/// Puts back what the records in `state_dir` hold, saying what it did; false if any failed.
fn restore(state_dir: &std::path::Path) -> bool {
    let mut all_ok = true;
    for restored in throttle::state::restore_dir(state_dir) {
        match restored {
            Restored::Put { control, original } => {
                tracing::warn!(file = %control.display(), %original, "restored a cgroup value a guard left changed");
            }
            Restored::Held { record } => {
                tracing::info!(record = %record.display(), "left to the running guard that holds it");
            }
            Restored::Failed { record, reason } => {
                all_ok = false;
                let reason = guard::error_chain(&reason);
                tracing::error!(record = %record.display(), %reason, "could not restore");
            }
        }
    }
    all_ok
}

/// The config from `--config`, else the default path where it exists, else built-in defaults.
fn load(path: Option<PathBuf>) -> Result<(Config, Option<PathBuf>), ConfigError> {
    match config_path(path) {
        Some(path) => Ok((Config::load(&path)?, Some(path))),
        None => Ok((Config::default(), None)),
    }
}

/// Says each problem on a line of its own; exit 64.
fn bad_config(err: &ConfigError) -> ExitCode {
    for problem in err.problems() {
        eprintln!("guard: bad config: {}", guard::error_chain(problem));
    }
    ExitCode::from(EXIT_BAD_CONFIG)
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")
}
