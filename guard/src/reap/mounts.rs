//! Mounts tracefs and bpffs where the host has not: the tracepoint needs the first, and tools
//! such as bpftool expect the second.

use std::path::Path;

use nix::mount::{MsFlags, mount};

const TRACEFS: &str = "/sys/kernel/tracing";
const DEBUGFS_TRACING: &str = "/sys/kernel/debug/tracing";
const BPFFS: &str = "/sys/fs/bpf";
const TRACEPOINT_FORMAT: &str = "events/sock/inet_sock_set_state/format";

/// Returns the tracefs directory, mounting it first where neither usual place has it.
pub(super) fn ensure_tracefs() -> Result<&'static Path, nix::Error> {
    for dir in [TRACEFS, DEBUGFS_TRACING] {
        if Path::new(dir).join("events").is_dir() {
            return Ok(Path::new(dir));
        }
    }
    mount(
        Some("tracefs"),
        TRACEFS,
        Some("tracefs"),
        MsFlags::empty(),
        None::<&str>,
    )?;
    tracing::info!(path = TRACEFS, "mounted tracefs");
    Ok(Path::new(TRACEFS))
}

/// Mounts bpffs at /sys/fs/bpf unless something is mounted there already.
pub(super) fn ensure_bpffs() -> Result<(), nix::Error> {
    if crate::procs::mounts()
        .iter()
        .any(|m| m.point == Path::new(BPFFS))
    {
        return Ok(());
    }
    mount(
        Some("bpf"),
        BPFFS,
        Some("bpf"),
        MsFlags::empty(),
        None::<&str>,
    )?;
    tracing::info!(path = BPFFS, "mounted bpffs");
    Ok(())
}

/// The tracepoint's record format, as this kernel describes it.
pub(super) fn tracepoint_format(tracefs: &Path) -> std::io::Result<String> {
    std::fs::read_to_string(tracefs.join(TRACEPOINT_FORMAT))
}
