//! `cargo xtask deb`: guard_VERSION_amd64.deb with dpkg-deb alone (no debhelper, no cargo-deb):
//! the release build staged by `install::stage` in Debian's places, stripped, with a man page
//! made from `--help`, the copyright and changelog, and deploy/debian's maintainer scripts.

use std::{
    fs,
    hash::{Hash as _, Hasher as _},
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, Result, bail};

use crate::{
    install::{self, DEBIAN},
    setup::run,
};

/// The maintainer scripts, from deploy/debian, each mode 0755 in DEBIAN/.
const SCRIPTS: &[&str] = &["postinst", "prerm", "postrm"];
/// The package's documentation directory.
const DOC: &str = "usr/share/doc/guard";

/// Builds (or finds, unchanged since the last run) the package; returns its path.
pub fn deb() -> Result<PathBuf> {
    let workspace = install::workspace();
    install::build(&workspace)?;
    let out = install::target_dir(&workspace).join("deb");
    let version = env!("CARGO_PKG_VERSION");
    let package = out.join(format!("guard_{version}_amd64.deb"));
    let root = out.join("root");
    if root.exists() {
        fs::remove_dir_all(&root).with_context(|| format!("removing {}", root.display()))?;
    }
    stage(&workspace, &root, version)?;

    let stamp = out.join(format!("guard_{version}_amd64.deb.inputs"));
    let digest = format!("{:016x}\n", tree_digest(&root)?);
    if package.exists() && fs::read_to_string(&stamp).is_ok_and(|s| s == digest) {
        eprintln!("deb: {} is up to date", package.display());
        return Ok(package);
    }
    run(Command::new("dpkg-deb")
        .args(["--root-owner-group", "-Zxz", "--build"])
        .arg(&root)
        .arg(&package)
        .env("SOURCE_DATE_EPOCH", source_date_epoch(&workspace)))
    .context("dpkg-deb failed")?;
    fs::write(&stamp, digest).with_context(|| format!("writing {}", stamp.display()))?;
    let size = fs::metadata(&package)?.len();
    eprintln!("deb: built {} ({} KiB)", package.display(), size / 1024);
    Ok(package)
}

/// Lays the package's tree out under `root`: files, documentation, then DEBIAN/.
fn stage(workspace: &Path, root: &Path, version: &str) -> Result<()> {
    install::stage(workspace, root, &DEBIAN)?;
    let binary = root.join(DEBIAN.binary);
    run(Command::new("strip")
        .args([
            "--remove-section=.comment",
            "--remove-section=.note",
            "--strip-unneeded",
        ])
        .arg(&binary))
    .context("strip failed (package binutils)")?;
    let debian = workspace.join("deploy/debian");
    let epoch = source_date_epoch(workspace);
    let doc = root.join(DOC);
    fs::create_dir_all(&doc)?;
    fs::copy(debian.join("copyright"), doc.join("copyright"))?;
    let changelog = fill(&read(&debian.join("changelog"))?, version, &epoch)?;
    gzip(changelog.as_bytes(), &doc.join("changelog.gz"))?;
    let man = man_page(&binary, version)?;
    gzip(man.as_bytes(), &root.join("usr/share/man/man1/guard.1.gz"))?;
    let overrides = root.join("usr/share/lintian/overrides/guard");
    fs::create_dir_all(overrides.parent().context("overrides dir")?)?;
    fs::copy(debian.join("lintian-overrides"), &overrides)?;
    set_modes(root)?;
    control(workspace, root, version)
}

/// DEBIAN/: control (with the size and the libraries' packages filled in), conffiles,
/// md5sums and the maintainer scripts.
fn control(workspace: &Path, root: &Path, version: &str) -> Result<()> {
    let debian = workspace.join("deploy/debian");
    let control_dir = root.join("DEBIAN");
    fs::create_dir_all(&control_dir)?;
    let depends = shlib_depends(workspace, &root.join(DEBIAN.binary))?;
    let control = read(&debian.join("control"))?
        .replace("@VERSION@", version)
        .replace("@DEPENDS@", &depends)
        .replace("@INSTALLED_SIZE@", &installed_size_kib(root)?.to_string());
    fs::write(control_dir.join("control"), control)?;
    fs::copy(debian.join("conffiles"), control_dir.join("conffiles"))?;
    for script in SCRIPTS {
        let to = control_dir.join(script);
        fs::copy(debian.join(script), &to)?;
        fs::set_permissions(&to, fs::Permissions::from_mode(0o755))?;
    }
    let sums = Command::new("sh")
        .args([
            "-c",
            "find . -path ./DEBIAN -prune -o -type f -printf '%P\\0' | sort -z | xargs -0 md5sum",
        ])
        .current_dir(root)
        .output()
        .context("md5sum")?;
    if !sums.status.success() {
        bail!("md5sum failed: {}", String::from_utf8_lossy(&sums.stderr));
    }
    fs::write(control_dir.join("md5sums"), sums.stdout)?;
    fs::set_permissions(&control_dir, fs::Permissions::from_mode(0o755))?;
    Ok(())
}

/// The libraries' packages, as dpkg-shlibdeps reads them from the binary's NEEDED entries
/// (`libc6 (>= 2.34), libgcc-s1 (>= 4.2)`). It insists on a debian/control; give it one.
fn shlib_depends(workspace: &Path, binary: &Path) -> Result<String> {
    let dir = install::target_dir(workspace).join("deb/shlibdeps");
    fs::create_dir_all(dir.join("debian"))?;
    fs::write(
        dir.join("debian/control"),
        "Source: guard\n\nPackage: guard\nArchitecture: amd64\n",
    )?;
    let out = Command::new("dpkg-shlibdeps")
        .arg("-O")
        .arg(binary)
        .current_dir(&dir)
        .output()
        .context("running dpkg-shlibdeps (package dpkg-dev)")?;
    let text = String::from_utf8_lossy(&out.stdout);
    let depends = text
        .lines()
        .find_map(|line| line.strip_prefix("shlibs:Depends="))
        .with_context(|| {
            format!(
                "dpkg-shlibdeps printed no dependencies: {text}{}",
                String::from_utf8_lossy(&out.stderr)
            )
        })?;
    Ok(depends.to_owned())
}

/// Files 0644, directories 0755, but what install::stage made tighter on purpose (the
/// config, 0640; the state directory, 0750) and the binary (0755).
fn set_modes(root: &Path) -> Result<()> {
    let (state, binary, config) = (install::STATE_DIR, DEBIAN.binary, install::CONFIG);
    run(Command::new("sh")
        .arg("-c")
        .arg(format!(
            "find . -type d ! -path ./{state} -exec chmod 0755 {{}} + && \
             find . -type f ! -path ./{binary} ! -path ./{config} -exec chmod 0644 {{}} +"
        ))
        .current_dir(root))
}

/// What the installed package occupies, in KiB (dpkg's Installed-Size).
fn installed_size_kib(root: &Path) -> Result<u64> {
    let mut bytes = 0;
    visit(root, &mut |path, meta| {
        if meta.is_file() && !path.starts_with(root.join("DEBIAN")) {
            bytes += meta.len().div_ceil(1024) * 1024;
        }
        Ok(())
    })?;
    Ok(bytes / 1024)
}

/// A digest of every path, mode and content under `root`: the cache key of the package.
pub fn tree_digest(root: &Path) -> Result<u64> {
    let mut paths = Vec::new();
    visit(root, &mut |path, _| {
        paths.push(path.to_owned());
        Ok(())
    })?;
    paths.sort();
    let mut hasher = std::hash::DefaultHasher::new();
    for path in paths {
        let meta = fs::symlink_metadata(&path)?;
        path.strip_prefix(root)?.hash(&mut hasher);
        meta.permissions().mode().hash(&mut hasher);
        if meta.is_file() {
            fs::read(&path)?.hash(&mut hasher);
        }
    }
    Ok(hasher.finish())
}

/// Calls `each` on every entry under `dir`, depth first.
pub fn visit(dir: &Path, each: &mut dyn FnMut(&Path, &fs::Metadata) -> Result<()>) -> Result<()> {
    for entry in fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        let meta = fs::symlink_metadata(&path)?;
        each(&path, &meta)?;
        if meta.is_dir() {
            visit(&path, each)?;
        }
    }
    Ok(())
}

/// The last commit's time: the changelog's date and every file's mtime, so that the same
/// commit makes the same package.
pub fn source_date_epoch(workspace: &Path) -> String {
    crate::image::git(workspace, &["log", "-1", "--format=%ct"]).unwrap_or_else(|| "0".to_owned())
}

/// The changelog template with its version and an RFC 5322 date.
fn fill(template: &str, version: &str, epoch: &str) -> Result<String> {
    let date = Command::new("date")
        .args(["-u", "-R", "-d"])
        .arg(format!("@{epoch}"))
        .output()
        .context("date")?;
    if !date.status.success() {
        bail!(
            "date -d @{epoch}: {}",
            String::from_utf8_lossy(&date.stderr)
        );
    }
    let date = String::from_utf8_lossy(&date.stdout).trim().to_owned();
    Ok(template
        .replace("@VERSION@", version)
        .replace("@DATE@", &date))
}

/// `gzip -9n` (no name, no time stamp: lintian checks both).
fn gzip(contents: &[u8], to: &Path) -> Result<()> {
    use std::io::Write as _;
    fs::create_dir_all(to.parent().context("a parent")?)?;
    let mut child = Command::new("gzip")
        .arg("-9n")
        .stdin(std::process::Stdio::piped())
        .stdout(fs::File::create(to)?)
        .spawn()
        .context("gzip")?;
    child
        .stdin
        .take()
        .context("gzip's stdin")?
        .write_all(contents)?;
    if !child.wait()?.success() {
        bail!("gzip failed for {}", to.display());
    }
    Ok(())
}

fn read(path: &Path) -> Result<String> {
    fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
}

/// guard(1): `guard --help` and each command's `--help`, verbatim, so that the man page says
/// what the binary says.
fn man_page(binary: &Path, version: &str) -> Result<String> {
    let help = |args: &[&str]| -> Result<String> {
        let out = Command::new(binary).args(args).arg("--help").output()?;
        if !out.status.success() {
            bail!("guard {args:?} --help failed");
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    };
    let main = help(&[])?;
    let mut page = format!(
        ".TH GUARD 1 \"\" \"guard {version}\" \"User Commands\"\n.SH NAME\nguard \\- protects local LLM servers: queueing, deadlines, cgroup throttling\n.SH SYNOPSIS\n.B guard\n\\fICOMMAND\\fR [\\fIOPTIONS\\fR]\n.SH DESCRIPTION\n{}",
        verbatim(&main)
    );
    for command in commands(&main) {
        page.push_str(&format!(
            ".SS guard {command}\n{}",
            verbatim(&help(&[command])?)
        ));
    }
    page.push_str(".SH FILES\n.TP\n/etc/guard/guard.toml\nthe config (every key, with its default, is in the shipped file)\n.TP\n/var/lib/guard\ncgroup values to restore after a crash (\\fBguard restore\\fR)\n.TP\n/usr/share/guard\nthe Grafana dashboard and the Prometheus alert rules\n");
    Ok(page)
}

/// The command names under clap's `Commands:` heading (`help` left out).
fn commands(help: &str) -> Vec<&str> {
    help.lines()
        .skip_while(|line| !line.starts_with("Commands:"))
        .skip(1)
        .take_while(|line| line.starts_with("  "))
        .filter_map(|line| line.split_whitespace().next())
        .filter(|name| *name != "help")
        .collect()
}

/// Text shown as it is: no fill, backslashes and leading dots or quotes escaped.
fn verbatim(text: &str) -> String {
    let mut out = String::from(".nf\n");
    for line in text.lines() {
        out.push_str("\\&");
        out.push_str(&line.replace('\\', "\\e"));
        out.push('\n');
    }
    out.push_str(".fi\n");
    out
}
