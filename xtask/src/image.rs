//! `cargo xtask image`: guard's OCI image, built offline from deploy/container/Containerfile on
//! an empty base: the stripped release binary and the shared objects it links, taken from this
//! Debian host, tagged `localhost/guard:VERSION` (the version deploy/kubernetes names).

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, Result, bail};

use crate::{install, setup::run};

/// How podman runs on hosts like this one: crun refuses a hybrid cgroup layout, and the
/// systemd cgroup manager needs a running systemd.
pub const PODMAN_GLOBAL: &[&str] = &["--runtime", "runc", "--cgroup-manager", "cgroupfs"];
/// The label holding the digest of what the image was built from: the cache key.
const INPUTS_LABEL: &str = "dev.guard.inputs";
/// Empty directories the runtime mounts over (a read-only root cannot grow them).
const MOUNT_POINTS: &[&str] = &["etc/guard", "var/lib/guard", "tmp"];

/// Builds the image unless one built from the same inputs is there; returns its tag.
pub fn image() -> Result<String> {
    let workspace = install::workspace();
    install::build(&workspace)?;
    let version = env!("CARGO_PKG_VERSION");
    let tag = format!("localhost/guard:{version}");
    let context = install::target_dir(&workspace).join("image");
    if context.exists() {
        fs::remove_dir_all(&context).with_context(|| format!("removing {}", context.display()))?;
    }
    stage_rootfs(&workspace, &context.join("rootfs"))?;
    let containerfile = workspace.join("deploy/container/Containerfile");
    let revision = revision(&workspace);
    let source = git(&workspace, &["remote", "get-url", "origin"])
        .unwrap_or_else(|| format!("file://{}", workspace.display()));

    let inputs = format!(
        "{:016x}",
        crate::deb::tree_digest(&context)?
            ^ text_digest(&[&fs::read_to_string(&containerfile)?, &revision, &source])
    );
    let previous = label(&tag, INPUTS_LABEL);
    if previous.as_deref() == Some(inputs.as_str()) {
        eprintln!("image: {tag} is up to date");
        return Ok(tag);
    }
    let old_id = image_id(&tag);
    let args = BuildArgs {
        version,
        revision: &revision,
        source: &source,
        inputs: &inputs,
    };
    build(&containerfile, &context, &tag, &args)?;
    if let Some(old) = old_id.filter(|old| image_id(&tag).as_ref() != Some(old)) {
        // The image this one replaces, untagged now; best effort.
        let _ = podman_output(&["rmi", "--force", &old]);
    }
    let size = podman_output(&["image", "inspect", "--format", "{{.Size}}", &tag])?;
    eprintln!(
        "image: built {tag} ({} KiB)",
        size.trim().parse::<u64>().unwrap_or(0) / 1024
    );
    Ok(tag)
}

/// What goes into the image's labels and annotations.
struct BuildArgs<'a> {
    version: &'a str,
    revision: &'a str,
    source: &'a str,
    inputs: &'a str,
}

/// `podman build` with the OCI labels as build arguments and as manifest annotations.
fn build(containerfile: &Path, context: &Path, tag: &str, args: &BuildArgs<'_>) -> Result<()> {
    let mut command = Command::new("podman");
    command
        .args(PODMAN_GLOBAL)
        .args([
            "build",
            "--format",
            "oci",
            "--pull=never",
            "--layers=false",
            "--file",
        ])
        .arg(containerfile)
        .args(["--tag", tag])
        .arg(format!("--label={INPUTS_LABEL}={}", args.inputs));
    for (key, value) in [
        ("VERSION", args.version),
        ("REVISION", args.revision),
        ("SOURCE", args.source),
    ] {
        command.arg(format!("--build-arg={key}={value}"));
        command.arg(format!(
            "--annotation=org.opencontainers.image.{}={value}",
            key.to_lowercase()
        ));
    }
    command.arg(context);
    run(&mut command).context("podman build failed; fix: cargo xtask setup (installs podman)")
}

/// rootfs/: the stripped binary, each shared object `ldd` lists (the file itself, at the path
/// the binary's loader looks in), the copyright, and the mount points.
fn stage_rootfs(workspace: &Path, rootfs: &Path) -> Result<()> {
    let binary = rootfs.join("usr/bin/guard");
    fs::create_dir_all(binary.parent().context("usr/bin")?)?;
    fs::copy(install::release_binary(workspace), &binary)?;
    run(Command::new("strip").arg("--strip-unneeded").arg(&binary)).context("strip")?;
    for library in linked_libraries(&binary)? {
        let to = rootfs.join(library.strip_prefix("/")?);
        fs::create_dir_all(to.parent().context("a library's directory")?)?;
        // fs::copy follows symbolic links: the image holds the files, not links into the host.
        fs::copy(&library, &to).with_context(|| format!("copying {}", library.display()))?;
    }
    let doc = rootfs.join("usr/share/doc/guard");
    fs::create_dir_all(&doc)?;
    fs::copy(
        workspace.join("deploy/debian/copyright"),
        doc.join("copyright"),
    )?;
    for dir in MOUNT_POINTS {
        fs::create_dir_all(rootfs.join(dir))?;
    }
    Ok(())
}

/// The absolute paths `ldd` resolves for `binary`, the dynamic loader included.
fn linked_libraries(binary: &Path) -> Result<Vec<PathBuf>> {
    let out = Command::new("ldd").arg(binary).output().context("ldd")?;
    if !out.status.success() {
        bail!("ldd {} failed", binary.display());
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let libraries: Vec<PathBuf> = text
        .lines()
        .filter_map(|line| {
            // "libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)" or "/lib64/ld-linux... (0x...)"
            let path = line.split("=>").last()?.split_whitespace().next()?;
            path.starts_with('/').then(|| PathBuf::from(path))
        })
        .collect();
    if libraries.is_empty() {
        bail!("ldd found no libraries in {}:\n{text}", binary.display());
    }
    Ok(libraries)
}

/// A label of the image `tag`, if the image and the label exist.
fn label(tag: &str, name: &str) -> Option<String> {
    let format = format!("{{{{index .Labels \"{name}\"}}}}");
    podman_output(&["image", "inspect", "--format", &format, tag])
        .ok()
        .map(|value| value.trim().to_owned())
        .filter(|value| !value.is_empty() && value != "<no value>")
}

fn image_id(tag: &str) -> Option<String> {
    podman_output(&["image", "inspect", "--format", "{{.Id}}", tag])
        .ok()
        .map(|id| id.trim().to_owned())
}

fn podman_output(args: &[&str]) -> Result<String> {
    let out = Command::new("podman")
        .args(PODMAN_GLOBAL)
        .args(args)
        .output()
        .context("running podman; fix: cargo xtask setup")?;
    if !out.status.success() {
        bail!("podman {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// HEAD's commit, `-dirty` where tracked files differ from it (as `git describe --dirty`).
fn revision(workspace: &Path) -> String {
    let Some(head) = git(workspace, &["rev-parse", "HEAD"]) else {
        return "unknown".into();
    };
    let changed = git(
        workspace,
        &["status", "--porcelain", "--untracked-files=no"],
    );
    if changed.is_some() {
        format!("{head}-dirty")
    } else {
        head
    }
}

/// What `git args` prints in `workspace`, trimmed; None where it fails or prints nothing.
pub fn git(workspace: &Path, args: &[&str]) -> Option<String> {
    let out = Command::new("git")
        .args(args)
        .current_dir(workspace)
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    (out.status.success() && !text.is_empty()).then_some(text)
}

fn text_digest(parts: &[&str]) -> u64 {
    use std::hash::{Hash as _, Hasher as _};
    let mut hasher = std::hash::DefaultHasher::new();
    parts.hash(&mut hasher);
    hasher.finish()
}
