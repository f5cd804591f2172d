//! Project tasks, run with `cargo xtask <task>`: setup, test, demo, bench, install, deb, image.
//!
//! xtask never depends on guard itself: it must build on a fresh machine before `setup` has
//! installed what guard's eBPF build needs.

#![forbid(unsafe_code)]

mod conformance;
mod crates;
mod deb;
mod fuzz;
mod gpu;
mod image;
mod install;
mod kernels;
mod lengths;
mod llama;
mod matrix;
mod modules;
mod setup;
mod tasks;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "cargo xtask", about = "guard's project tasks")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Install everything the build and the tests need (idempotent: seconds when present).
    Setup,
    /// Set up, then run every test, including the root tests on the real kernel.
    Test {
        /// Extra arguments for the test binaries (a name filter, --nocapture, ...).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Set up, then run guard in front of a real tiny model and show what it does.
    Demo,
    /// Build the release binary and install it with its config and systemd unit.
    Install {
        /// Install under this directory instead of / (for packaging and tests).
        #[arg(long)]
        root: Option<std::path::PathBuf>,
    },
    /// Build guard_VERSION_amd64.deb under target/deb (skipped when its inputs are unchanged).
    Deb,
    /// Build the OCI image localhost/guard:VERSION from deploy/container/Containerfile,
    /// offline (skipped when its inputs are unchanged).
    Image,
    /// llama.cpp's server test suite straight and through guard; fails on any test that
    /// passes straight and not through guard.
    Conformance {
        /// Extra pytest arguments (a `-k` filter, a test file).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Boot Debian's 5.10, 6.1, 6.12 and 7.x kernels under QEMU and run guard's eBPF tests
    /// in each; prints one table.
    Kernels {
        /// Only this series (5.10, 6.1, 6.12, 7.x).
        #[arg(long)]
        only: Option<String>,
    },
    /// Start the release guard briefly and print what its NVML (GPU) path reads.
    GpuCheck,
    /// Print the graph of guard's top-level modules and the longest functions; fail on an
    /// import cycle or a function over 80 lines.
    Modules,
    /// Benchmarks that print ratios measured side by side in one run.
    Bench {
        #[arg(value_enum)]
        which: tasks::Bench,
        /// Parts of the benchmark to run (all when none), e.g. `bench proxy table flame`.
        #[arg(trailing_var_arg = true)]
        parts: Vec<String>,
    },
}

fn main() -> Result<()> {
    match Cli::parse().task {
        Task::Setup => setup::all().map(|_| ()),
        Task::Test { args } => tasks::test(&args),
        Task::Demo => tasks::demo(),
        Task::Bench {
            which: tasks::Bench::Fuzz,
            ..
        } => fuzz::bench(),
        Task::Bench { which, parts } => tasks::bench(which, &parts),
        Task::Install { root } => install::install(root.as_deref()),
        Task::Deb => deb::deb().map(|_| ()),
        Task::Image => image::image().map(|_| ()),
        Task::GpuCheck => tasks::gpu_check(),
        Task::Conformance { args } => conformance::conformance(&args),
        Task::Kernels { only } => matrix::kernels(only.as_deref()),
        Task::Modules => modules::check(),
    }
}
