//! The command line of docs/design.md §4.

use std::path::PathBuf;

use clap::{
    Parser, Subcommand,
    builder::{PossibleValuesParser, TypedValueParser as _},
};
use guard_tools::usage;

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
        /// Config file [default: /etc/guard/guard.toml where it exists, else built-in defaults]
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Check a config as `guard run` and a reload would: every problem at once, each as
    /// file:line: key, then what this host refuses it (class cgroups, the state directory,
    /// the access log, taken ports). Exit 0, or 64.
    CheckConfig {
        /// Config file [default: /etc/guard/guard.toml where it exists, else built-in defaults]
        #[arg(long)]
        config: Option<PathBuf>,
        /// Check the file alone, not this host (for a config meant for another box).
        #[arg(long)]
        file_only: bool,
    },
    /// Put back every cgroup value a guard recorded before changing it (after a crash), reading
    /// no config; a running guard's own records are left to it.
    Restore {
        /// The state directory (risk.state_dir).
        #[arg(long, default_value = "/var/lib/guard")]
        state_dir: PathBuf,
    },
    /// Show what a running guard's /status says, as a table.
    Status {
        /// The metrics listener of the guard to ask.
        #[arg(long, default_value = "http://127.0.0.1:9464")]
        url: String,
        /// A file whose first line is the token the metrics listener requires.
        #[arg(long)]
        token_file: Option<PathBuf>,
    },
    /// Run CMD inside a class's cgroup (created where missing), as that class's workload.
    /// Exits with CMD's own status, else 64 (unknown class), 66 (config unreadable), 71 (OS
    /// error), 77 (no permission), 78 (bad config or no cgroup), 126/127 (CMD not runnable /
    /// not found).
    Exec {
        /// Config file [default: /etc/guard/guard.toml where it exists, else built-in defaults]
        #[arg(long)]
        config: Option<PathBuf>,
        /// The class whose cgroup CMD runs in.
        #[arg(long)]
        class: String,
        /// The command and its arguments.
        #[arg(last = true, required = true)]
        command: Vec<String>,
    },
    /// Record a baseline run in the logbook: a fixed input set against a named model.
    Bench(Box<BenchArgs>),
    /// List, check due retests, compare, and report on logbook entries.
    Logbook {
        /// The logbook file.
        #[arg(long, default_value = guard_tools::logbook::DEFAULT_PATH, global = true)]
        logbook: PathBuf,
        #[command(subcommand)]
        command: LogbookCommand,
    },
    /// Check what guard needs from this host; each line ok, notice, warning or missing, with
    /// the fix. Exit 1 only for what stops guard from running here, 64 for a bad config.
    Doctor {
        /// Config file [default: /etc/guard/guard.toml where it exists, else built-in defaults]
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Who used the box: the access log summed per client (requests by outcome, tokens read,
    /// cached and generated, slot-seconds, energy where measured, queue wait p50/p95, 503s).
    Usage(UsageArgs),
}

#[derive(Debug, clap::Args)]
pub struct UsageArgs {
    /// The access log guard writes where `[log] access` says in guard.toml.
    #[arg(long, default_value = usage::DEFAULT_LOG)]
    pub log: PathBuf,
    /// How far back: a duration such as 24h, 90m, 7d or 30s (a day is 24 hours), or all.
    #[arg(long, default_value = "24h")]
    pub since: usage::Since,
    /// One row per value of this (records without one: the row `-`).
    #[arg(
        long,
        default_value = "unit",
        value_parser = PossibleValuesParser::new(usage::By::NAMES)
            .try_map(|by| by.parse::<usage::By>())
    )]
    pub by: usage::By,
    /// table (the table leaves out outcomes no request had), csv, or json (one array of rows).
    #[arg(
        long,
        default_value = "table",
        value_parser = PossibleValuesParser::new(usage::Format::NAMES)
            .try_map(|format| format.parse::<usage::Format>())
    )]
    pub format: usage::Format,
}

#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// The input set: JSONL, one `{"prompt": ...}` or `{"messages": [...]}` a line, each with an
    /// optional "expect" (regular expression) and "expect_json" (keys the answer must have).
    #[arg(long)]
    pub input: PathBuf,
    /// The server (or guard in front of it) to measure.
    #[arg(long, default_value = "http://127.0.0.1:11434")]
    pub url: String,
    /// "ollama" or "openai" (llama-server, vLLM, ...).
    #[arg(long, default_value = "ollama")]
    pub api: String,
    /// The model to ask for, as the server names it (e.g. llama3.2:3b).
    #[arg(long)]
    pub model: String,
    /// The runtime's name (ollama, llama.cpp, vllm, ...).
    #[arg(long)]
    pub runtime: String,
    /// Its version, where the server does not say.
    #[arg(long)]
    pub runtime_version: Option<String>,
    /// The server's launch flags (default: its command line from /proc where it runs here).
    #[arg(long)]
    pub launch_flags: Option<String>,
    /// The server's pid (default: found by the URL's port).
    #[arg(long)]
    pub server_pid: Option<i32>,
    /// The model file, for its digest where the server gives none.
    #[arg(long)]
    pub model_file: Option<PathBuf>,
    /// A command that restarts the server, for a cold start where the API cannot unload.
    #[arg(long)]
    pub restart: Option<String>,
    /// Repetitions of the whole input set.
    #[arg(long, default_value_t = 3)]
    pub repeat: usize,
    /// The workload class (sent as x-guard-class).
    #[arg(long, default_value = "batch")]
    pub class: String,
    /// The most tokens each answer may have (sent as max_tokens / num_predict).
    #[arg(long, default_value_t = 128)]
    pub max_tokens: u32,
    /// What was decided from this run.
    #[arg(long, default_value = "baseline")]
    pub decision: String,
    /// Who owns the number.
    #[arg(long)]
    pub owner: String,
    /// Days until this baseline should be measured again.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u16).range(0..=3_660))]
    pub retest_days: u16,
    /// The logbook file the run is appended to.
    #[arg(long, default_value = guard_tools::logbook::DEFAULT_PATH)]
    pub logbook: PathBuf,
}

#[derive(Debug, Subcommand)]
pub enum LogbookCommand {
    /// Every entry, due retests marked.
    List,
    /// Entries whose retest date has come (exit 1 when any are due).
    Due,
    /// Every figure of B against A in its unit: gains, costs, and what is inside the runs'
    /// spread.
    Compare {
        /// The entry compared against (an id or a unique prefix of one).
        a: String,
        /// The entry compared (an id or a unique prefix of one).
        b: String,
        /// table (aligned columns), json (one object: `rows`, `gains`, `costs`; a CI
        /// fails on `.costs != []`), or csv (one line a figure).
        #[arg(
            long,
            default_value = "table",
            value_parser = PossibleValuesParser::new(usage::Format::NAMES)
                .try_map(|format| format.parse::<usage::Format>())
        )]
        format: usage::Format,
    },
    /// A report of one entry, or of two compared: an HTML page with the table and every chart,
    /// or the TTFT chart alone as SVG or PNG.
    Report {
        /// The entry (an id or a unique prefix of one); A when compared.
        id: String,
        /// A second entry, B, compared against the first (default: none, one entry alone).
        #[arg(long)]
        compare: Option<String>,
        /// The file written, its kind by its extension: .html (the page), .svg or .png (the
        /// TTFT chart alone). No default: required.
        #[arg(long)]
        out: PathBuf,
    },
}
