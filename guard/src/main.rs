//! guard's entry point: parses the command line and wires the pieces together.

use std::{io::IsTerminal as _, path::PathBuf, process::ExitCode};

use anyhow::Context as _;
use clap::Parser as _;
use guard::{
    cli::{Cli, Command},
    config::{self, Config, ConfigError},
    daemon, doctor, status,
};

/// The exit status for a bad config (DESIGN section 4).
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
    let cli = Cli::parse();
    match run(cli.command) {
        Ok(code) => code,
        Err(err) => {
            eprintln!("guard: {err:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(command: Command) -> anyhow::Result<ExitCode> {
    match command {
        Command::Run { config } => {
            let (config, path) = match load(config) {
                Ok(loaded) => loaded,
                Err(err) => return Ok(bad_config(&err)),
            };
            match runtime()?.block_on(daemon::run(config, path)) {
                Ok(()) => Ok(ExitCode::SUCCESS),
                // A class cgroup that cannot be used is a configuration error.
                Err(daemon::DaemonError::Throttle(err)) => {
                    eprintln!("guard: bad config: {err}");
                    Ok(ExitCode::from(EXIT_BAD_CONFIG))
                }
                Err(err) => Err(err.into()),
            }
        }
        Command::CheckConfig { config } => match load(config) {
            Ok((config, path)) => {
                let source =
                    path.map_or("built-in defaults".to_owned(), |p| p.display().to_string());
                println!(
                    "{source}: ok ({} classes: {})",
                    config.class.len(),
                    config.class_names()
                );
                Ok(ExitCode::SUCCESS)
            }
            Err(err) => Ok(bad_config(&err)),
        },
        Command::Status { url } => {
            let table = runtime()?.block_on(status::show(&url))?;
            print!("{table}");
            Ok(ExitCode::SUCCESS)
        }
        Command::Exec {
            config,
            class,
            command,
        } => {
            let config = match load(config) {
                Ok((config, _)) => config,
                Err(err) => return Ok(bad_config(&err)),
            };
            let err = guard::exec::exec(&config, &class, &command);
            eprintln!("guard exec: {err}");
            Ok(ExitCode::from(EXIT_BAD_CONFIG))
        }
        Command::Doctor { config } => {
            let config = match load(config) {
                Ok((config, _)) => config,
                Err(err) => return Ok(bad_config(&err)),
            };
            let (text, all_ok) = doctor::render(&doctor::run(&config));
            print!("{text}");
            Ok(if all_ok {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            })
        }
    }
}

/// The config from `--config`, else the default path where it exists, else built-in defaults.
fn load(path: Option<PathBuf>) -> Result<(Config, Option<PathBuf>), ConfigError> {
    let path = path.or_else(|| {
        let default = PathBuf::from(config::DEFAULT_PATH);
        default.exists().then_some(default)
    });
    match path {
        Some(path) => Ok((Config::load(&path)?, Some(path))),
        None => Ok((Config::default(), None)),
    }
}

fn bad_config(err: &ConfigError) -> ExitCode {
    eprintln!("guard: bad config: {err}");
    ExitCode::from(EXIT_BAD_CONFIG)
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")
}
