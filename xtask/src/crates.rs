//! The crate graph of the workspace, as `cargo xtask modules` checks it: each crate may use
//! only the crates below it (the daemon never its tools, the connection machinery never the
//! daemon), and every crate that is not named as holding `unsafe` forbids it at its root.

use std::{collections::BTreeSet, path::Path, process::Command};

use anyhow::{Context as _, Result, bail};
use serde::Deserialize;

/// One crate: its directory, the workspace crates it may use, whether it may hold `unsafe`.
pub struct Crate {
    pub name: &'static str,
    pub dir: &'static str,
    pub may_use: &'static [&'static str],
    pub holds_unsafe: bool,
    /// Its top-level modules form a graph checked for cycles.
    pub modules: bool,
}

/// The workspace, bottom to top. `unsafe` lives in guard-sys (the allocator, the reactor),
/// guard-common (plain-data records read from the kernel) and guard-ebpf (kernel programs).
pub const CRATES: [Crate; 9] = [
    Crate::leaf("guard-common", true),
    Crate {
        name: "guard-ebpf",
        dir: "guard-ebpf",
        may_use: &["guard-common"],
        holds_unsafe: true,
        modules: false,
    },
    Crate::leaf("guard-sys", true),
    Crate {
        name: "guard-net",
        dir: "guard-net",
        may_use: &[],
        holds_unsafe: false,
        modules: true,
    },
    Crate {
        name: "guard",
        dir: "guard",
        may_use: &["guard-common", "guard-ebpf", "guard-net", "guard-sys"],
        holds_unsafe: false,
        modules: true,
    },
    Crate {
        name: "guard-tools",
        dir: "guard-tools",
        may_use: &["guard"],
        holds_unsafe: false,
        modules: true,
    },
    Crate {
        name: "guard-cli",
        dir: "guard-cli",
        may_use: &["guard", "guard-tools"],
        holds_unsafe: false,
        modules: false,
    },
    Crate {
        name: "guard-tests",
        dir: "tests",
        may_use: &["guard", "guard-sys", "guard-tools", "guard-testkit"],
        holds_unsafe: false,
        modules: false,
    },
    Crate {
        name: "xtask",
        dir: "xtask",
        may_use: &[],
        holds_unsafe: false,
        modules: false,
    },
];

impl Crate {
    const fn leaf(name: &'static str, holds_unsafe: bool) -> Self {
        Self {
            name,
            dir: name,
            may_use: &[],
            holds_unsafe,
            modules: false,
        }
    }
}

#[derive(Deserialize)]
struct Metadata {
    packages: Vec<Package>,
}

#[derive(Deserialize)]
struct Package {
    name: String,
    dependencies: Vec<Dependency>,
}

#[derive(Deserialize)]
struct Dependency {
    name: String,
    /// Set for a crate of this workspace (a path dependency).
    path: Option<String>,
    /// `dev` for a dev-dependency, `build` for a build-dependency.
    kind: Option<String>,
}

/// Fails listing every crate that uses a workspace crate it may not, and every crate that
/// does not forbid `unsafe` where it should.
pub fn check(root: &Path) -> Result<()> {
    let mut wrong = Vec::new();
    for package in metadata(root)?.packages {
        let Some(krate) = CRATES.iter().find(|c| c.name == package.name) else {
            // A crate the table does not know (the test kit) uses nothing of guard's.
            let ours = package.dependencies.iter().filter(|d| d.path.is_some());
            wrong.extend(ours.map(|d| format!("{} may not use {}", package.name, d.name)));
            continue;
        };
        let uses: BTreeSet<&str> = package
            .dependencies
            .iter()
            .filter(|d| d.path.is_some() && d.kind.as_deref() != Some("dev"))
            .map(|d| d.name.as_str())
            .collect();
        for used in uses {
            if !krate.may_use.contains(&used) {
                wrong.push(format!("{} may not use {used}", krate.name));
            }
        }
        if !krate.holds_unsafe && !forbids_unsafe(&root.join(krate.dir))? {
            wrong.push(format!(
                "{} does not say #![forbid(unsafe_code)]",
                krate.name
            ));
        }
    }
    for krate in &CRATES {
        let uses = krate.may_use.join(", ");
        println!(
            "{:<13} -> {}",
            krate.name,
            if uses.is_empty() { "-" } else { &uses }
        );
    }
    if !wrong.is_empty() {
        bail!("the crate graph is off:\n  {}", wrong.join("\n  "));
    }
    Ok(())
}

fn metadata(root: &Path) -> Result<Metadata> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let output = Command::new(cargo)
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .current_dir(root)
        .output()
        .context("running cargo metadata")?;
    if !output.status.success() {
        bail!(
            "cargo metadata failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    serde_json::from_slice(&output.stdout).context("reading cargo metadata")
}

/// Whether the crate's root files (lib.rs, main.rs) forbid `unsafe`.
fn forbids_unsafe(dir: &Path) -> Result<bool> {
    let mut roots = 0;
    for root in ["src/lib.rs", "src/main.rs"] {
        let path = dir.join(root);
        if !path.exists() {
            continue;
        }
        roots += 1;
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        if !text.contains("#![forbid(unsafe_code)]") {
            return Ok(false);
        }
    }
    Ok(roots > 0)
}
