//! The command line of DESIGN section 4.

use std::path::PathBuf;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "guard",
    version,
    about = "Keeps local LLM inference honest about its limits."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the daemon: the proxy, the metrics listener and the kernel watchers.
    Run {
        /// Config file (default /etc/guard/guard.toml; built-in defaults where it is absent).
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Validate a config file: exit 0, or 64 naming file, line and key.
    CheckConfig {
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Show what a running guard's /status says, as a table.
    Status {
        /// The metrics listener of the guard to ask.
        #[arg(long, default_value = "http://127.0.0.1:9464")]
        url: String,
    },
    /// Run CMD inside a class's cgroup (created where missing), as that class's workload.
    Exec {
        #[arg(long)]
        config: Option<PathBuf>,
        /// The class whose cgroup CMD runs in.
        #[arg(long)]
        class: String,
        /// The command and its arguments.
        #[arg(last = true, required = true)]
        command: Vec<String>,
    },
    /// Check what guard needs from this host; each line ok or missing, with the fix.
    Doctor {
        #[arg(long)]
        config: Option<PathBuf>,
    },
}
