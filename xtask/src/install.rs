//! `cargo xtask install [--root DIR]`: builds the release binary and installs it with its
//! config (never overwriting one), its systemd unit, the dashboard and the alert rules; the
//! Debian package (`cargo xtask deb`) stages the same files in Debian's places.

use std::{
    fs,
    io::{ErrorKind, Write as _},
    os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _},
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, Result};

/// Where each installed file goes, relative to the root.
pub struct Layout {
    /// The binary; the unit's `ExecStart=` and `ExecStopPost=` name it.
    pub binary: &'static str,
    /// The systemd unit; ours, so a newer one replaces it.
    pub unit: &'static str,
    /// The Grafana dashboard and the Prometheus alert rules.
    pub share: &'static str,
}

/// `cargo xtask install`: the admin's own software, under /usr/local and /etc/systemd.
pub const LOCAL: Layout = Layout {
    binary: "usr/local/bin/guard",
    unit: "etc/systemd/system/guard.service",
    share: "usr/local/share/guard",
};

/// The Debian package: the distribution's places (bookworm's units live in /lib).
pub const DEBIAN: Layout = Layout {
    binary: "usr/bin/guard",
    unit: "lib/systemd/system/guard.service",
    share: "usr/share/guard",
};

/// Where the config goes; an existing one is never touched.
pub const CONFIG: &str = "etc/guard/guard.toml";
/// logrotate's rule for the access log; ours, so a newer one replaces it.
pub const LOGROTATE: &str = "etc/logrotate.d/guard";
/// guard's state directory (`risk.state_dir`): original cgroup values it must restore.
pub const STATE_DIR: &str = "var/lib/guard";
/// The path the unit in deploy/systemd names the binary by.
const UNIT_BINARY: &str = "/usr/local/bin/guard";
/// What goes under [`Layout::share`], from the workspace.
const SHARED: &[&str] = &[
    "deploy/grafana/guard-dashboard.json",
    "deploy/prometheus/guard-alerts.yml",
];

/// Builds `guard` in release mode and installs it under `root` (`/` when `None`).
pub fn install(root: Option<&Path>) -> Result<()> {
    let workspace = workspace();
    let root = root.unwrap_or(Path::new("/"));

    build(&workspace)?;
    stage(&workspace, root, &LOCAL)?;

    if root == Path::new("/") && on_path("systemctl") {
        eprintln!("install: done; to start guard now and at every boot, run:");
        eprintln!("    systemctl daemon-reload && systemctl enable --now guard");
    } else {
        eprintln!("install: done under {}", root.display());
    }
    Ok(())
}

/// The workspace's root directory.
pub fn workspace() -> PathBuf {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    fs::canonicalize(&workspace).unwrap_or(workspace)
}

/// Installs the built binary and its files under `root` in `layout`'s places.
pub fn stage(workspace: &Path, root: &Path, layout: &Layout) -> Result<()> {
    let built = release_binary(workspace);
    replace_file(&built, &root.join(layout.binary), 0o755)?;
    install_config(
        &workspace.join("deploy/guard.example.toml"),
        &root.join(CONFIG),
    )?;
    let unit_source = workspace.join("deploy/systemd/guard.service");
    let unit = fs::read_to_string(&unit_source)
        .with_context(|| format!("reading {}", unit_source.display()))?
        .replace(UNIT_BINARY, &format!("/{}", layout.binary));
    replace_contents(unit.as_bytes(), &root.join(layout.unit), 0o644)?;
    replace_file(
        &workspace.join("deploy/logrotate/guard"),
        &root.join(LOGROTATE),
        0o644,
    )?;
    for shared in SHARED {
        let from = workspace.join(shared);
        let name = from.file_name().context("a shared file's name")?;
        replace_file(&from, &root.join(layout.share).join(name), 0o644)?;
    }
    state_dir(&root.join(STATE_DIR))
}

/// The release binary `build` makes.
pub fn release_binary(workspace: &Path) -> PathBuf {
    target_dir(workspace).join("release/guard")
}

/// `cargo build --release -p guard-cli` (the `guard` binary) in the workspace.
pub fn build(workspace: &Path) -> Result<()> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut command = Command::new(cargo);
    command
        .args(["build", "--release", "-p", "guard-cli"])
        .current_dir(workspace);
    eprintln!("install: building: {command:?}");
    crate::setup::run(&mut command)
}

/// The build's target directory: `CARGO_TARGET_DIR` (relative to the workspace) or `target`.
pub fn target_dir(workspace: &Path) -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) => workspace.join(dir),
        None => workspace.join("target"),
    }
}

/// Copies `from` to `to` with `mode` (see [`replace_contents`]).
fn replace_file(from: &Path, to: &Path, mode: u32) -> Result<()> {
    let contents = fs::read(from).with_context(|| format!("reading {}", from.display()))?;
    replace_contents(&contents, to, mode)
}

/// Writes `contents` to `to` with `mode`, through a temporary name in the same directory and a
/// rename, so that `to` is never seen half written (a running binary is replaced, not edited).
fn replace_contents(contents: &[u8], to: &Path, mode: u32) -> Result<()> {
    create_parent(to)?;
    let file_name = to
        .file_name()
        .with_context(|| format!("{} has no file name", to.display()))?;
    let mut temp_name = std::ffi::OsString::from(".");
    temp_name.push(file_name);
    temp_name.push(".install-tmp");
    let temp = to.with_file_name(temp_name);

    let placed = fs::write(&temp, contents)
        .with_context(|| format!("writing {}", temp.display()))
        .and_then(|()| {
            fs::set_permissions(&temp, fs::Permissions::from_mode(mode))
                .with_context(|| format!("setting the mode of {}", temp.display()))
        })
        .and_then(|()| {
            fs::rename(&temp, to)
                .with_context(|| format!("renaming {} to {}", temp.display(), to.display()))
        });
    if placed.is_err() {
        // Best effort: the error that matters is the one returned.
        let _ = fs::remove_file(&temp);
    }
    placed?;
    eprintln!("install: installed {} (mode {mode:o})", to.display());
    Ok(())
}

/// Writes the example config to `to` (mode 0640: rules may hold bearer tokens) unless a file
/// is there already: the admin's config is never overwritten.
fn install_config(example: &Path, to: &Path) -> Result<()> {
    create_parent(to)?;
    let text = fs::read(example).with_context(|| format!("reading {}", example.display()))?;
    // create_new: an existing file, even one created a moment ago, is kept.
    let mut file = match fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o640)
        .open(to)
    {
        Ok(file) => file,
        Err(err) if err.kind() == ErrorKind::AlreadyExists => {
            eprintln!("install: kept the existing {}", to.display());
            return Ok(());
        }
        Err(err) => return Err(err).with_context(|| format!("creating {}", to.display())),
    };
    file.write_all(&text)
        .and_then(|()| file.sync_all())
        .with_context(|| format!("writing {}", to.display()))?;
    eprintln!(
        "install: installed {} from {}",
        to.display(),
        example.display()
    );
    Ok(())
}

/// Creates guard's state directory, mode 0750.
fn state_dir(dir: &Path) -> Result<()> {
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    fs::set_permissions(dir, fs::Permissions::from_mode(0o750))
        .with_context(|| format!("setting the mode of {}", dir.display()))?;
    eprintln!("install: created {} (mode 750)", dir.display());
    Ok(())
}

fn create_parent(path: &Path) -> Result<()> {
    if let Some(parent) = path.parent() {
        fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    }
    Ok(())
}

/// Whether an executable named `name` is on `PATH`.
fn on_path(name: &str) -> bool {
    std::env::var_os("PATH").is_some_and(|path| {
        std::env::split_paths(&path).any(|dir| {
            fs::metadata(dir.join(name))
                .is_ok_and(|meta| meta.is_file() && meta.permissions().mode() & 0o111 != 0)
        })
    })
}
