//! Facts about this host's processes and mounts, read through the procfs crate: one place for
//! every question guard asks /proc.

use std::path::{Path, PathBuf};

use procfs::process::{FDTarget, Process};

/// One mounted filesystem as this process sees it.
#[derive(Clone, Debug)]
pub struct Mount {
    pub point: PathBuf,
    pub fs_type: String,
    /// The per-superblock options: a cgroup v1 hierarchy's controllers are among them.
    pub options: Vec<String>,
}

/// This process's mounts (mountinfo: mount points arrive unescaped). Empty where /proc is
/// unreadable, which callers treat as "not mounted".
pub fn mounts() -> Vec<Mount> {
    let Ok(infos) = Process::myself().and_then(|me| me.mountinfo()) else {
        return Vec::new();
    };
    infos
        .into_iter()
        .map(|info| Mount {
            point: info.mount_point,
            fs_type: info.fs_type,
            options: info.super_options.into_keys().collect(),
        })
        .collect()
}

/// The cgroup v2 path of a process (as in /proc/PID/cgroup, e.g. `/guard/batch`).
pub fn cgroup_of(pid: i32) -> Option<String> {
    Process::new(pid)
        .and_then(|process| process.cgroups())
        .ok()?
        .into_iter()
        .find(|group| group.hierarchy == 0)
        .map(|group| group.pathname)
}

/// The real uid of a process (/proc/PID/status: readable for any process).
pub fn uid_of(pid: i32) -> Option<u32> {
    Process::new(pid)
        .and_then(|process| process.status())
        .ok()
        .map(|status| status.ruid)
}

/// The executable of a process. The kernel lets only a ptrace-capable reader see another
/// user's: without CAP_SYS_PTRACE that is None.
pub fn exe_of(pid: i32) -> Option<PathBuf> {
    Process::new(pid).and_then(|process| process.exe()).ok()
}

/// Most directories `cgroup_path_by_id` visits in one walk of the cgroup2 tree.
const MAX_CGROUP_WALK: usize = 100_000;

/// The cgroup v2 path whose directory has inode `id` (what the kernel calls the cgroup id).
/// Tries the path /proc/PID/cgroup names first (the usual case: the process has not moved),
/// then walks the cgroup2 tree, at most `MAX_CGROUP_WALK` directories.
pub fn cgroup_path_by_id(id: u64, pid: i32) -> Option<String> {
    use std::os::unix::fs::MetadataExt as _;
    let root = cgroup2_root()?;
    let inode_of = |path: &str| {
        std::fs::metadata(root.join(path.trim_start_matches('/')))
            .ok()
            .map(|m| m.ino())
    };
    if let Some(path) = cgroup_of(pid)
        && inode_of(&path) == Some(id)
    {
        return Some(path);
    }
    // Cgroup ids are never reused, so a walk's answer holds for good: a client that keeps
    // moving cgroups costs one walk per cgroup, not one per connection.
    static FOUND: std::sync::Mutex<Option<std::collections::HashMap<u64, String>>> =
        std::sync::Mutex::new(None);
    let mut found = FOUND
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let found = found.get_or_insert_with(Default::default);
    if let Some(path) = found.get(&id) {
        return Some(path.clone());
    }
    let path = walk_for(&root, id)?;
    if found.len() >= MAX_CGROUPS_REMEMBERED {
        found.clear();
    }
    found.insert(id, path.clone());
    Some(path)
}

/// Where cgroup v2 is mounted: read from mountinfo once, and again only where that path is
/// no longer a cgroup2 filesystem (a statfs a lookup, not a parse of every mount: a client's
/// connection is looked up as it arrives).
fn cgroup2_root() -> Option<PathBuf> {
    use nix::sys::statfs::{CGROUP2_SUPER_MAGIC, statfs};
    static ROOT: std::sync::Mutex<Option<PathBuf>> = std::sync::Mutex::new(None);
    let mut root = ROOT
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let mounted =
        |path: &PathBuf| statfs(path).is_ok_and(|fs| fs.filesystem_type() == CGROUP2_SUPER_MAGIC);
    if let Some(path) = root.as_ref().filter(|path| mounted(path)) {
        return Some(path.clone());
    }
    *root = mounts()
        .into_iter()
        .find(|mount| mount.fs_type == "cgroup2")
        .map(|mount| mount.point);
    root.clone()
}

/// Cgroup paths `cgroup_path_by_id` remembers; past this it starts over.
const MAX_CGROUPS_REMEMBERED: usize = 4096;

/// Walks the cgroup2 tree under `root` for the directory with inode `id`.
fn walk_for(root: &Path, id: u64) -> Option<String> {
    use std::os::unix::fs::MetadataExt as _;
    let mut pending = vec![root.to_path_buf()];
    let mut visited = 0;
    while let Some(dir) = pending.pop() {
        visited += 1;
        if visited > MAX_CGROUP_WALK {
            return None;
        }
        let Ok(meta) = std::fs::metadata(&dir) else {
            continue;
        };
        if meta.ino() == id {
            let relative = dir.strip_prefix(root).ok()?;
            return Some(format!("/{}", relative.display()));
        }
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        pending.extend(
            entries
                .flatten()
                .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                .map(|e| e.path()),
        );
    }
    None
}

/// This process's effective capability set.
pub fn effective_capabilities() -> std::io::Result<u64> {
    Process::myself()
        .and_then(|me| me.status())
        .map(|status| status.capeff)
        .map_err(std::io::Error::other)
}

/// Every TCP socket of this network namespace, IPv4 and IPv6.
pub fn tcp_sockets() -> impl Iterator<Item = procfs::net::TcpNetEntry> {
    procfs::net::tcp()
        .into_iter()
        .flatten()
        .chain(procfs::net::tcp6().into_iter().flatten())
}

/// The process holding the socket with this inode (a scan of every process's descriptors:
/// slow, for where nothing faster knows).
pub fn socket_holder(inode: u64) -> Option<i32> {
    procfs::process::all_processes()
        .ok()?
        .flatten()
        .find_map(|process| {
            let holds = process
                .fd()
                .ok()?
                .flatten()
                .any(|fd| matches!(fd.target, FDTarget::Socket(found) if found == inode));
            holds.then_some(process.pid)
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_is_found_in_proc() {
        assert!(
            mounts()
                .iter()
                .any(|m| m.point == std::path::Path::new("/"))
        );
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let inode = tcp_sockets()
            .find(|s| s.local_address.port() == port)
            .map(|s| s.inode)
            .expect("our listening socket");
        assert_eq!(socket_holder(inode), Some(std::process::id() as i32));
        let me = std::process::id() as i32;
        let cgroup = cgroup_of(me).expect("our cgroup");
        assert!(cgroup.starts_with('/'));
        assert_eq!(uid_of(me), Some(nix::unistd::getuid().as_raw()));
        assert_eq!(exe_of(me), std::env::current_exe().ok());
        assert!(effective_capabilities().is_ok());
    }

    #[test]
    fn a_cgroup_is_found_by_its_id_even_when_the_pid_says_otherwise() {
        use std::os::unix::fs::MetadataExt as _;
        let Some(root) = mounts()
            .into_iter()
            .find(|m| m.fs_type == "cgroup2")
            .map(|m| m.point)
        else {
            return; // no cgroup2 here: nothing to find
        };
        let me = std::process::id() as i32;
        let path = cgroup_of(me).expect("our cgroup");
        let id = std::fs::metadata(root.join(path.trim_start_matches('/')))
            .expect("our cgroup's directory")
            .ino();
        assert_eq!(cgroup_path_by_id(id, me).as_deref(), Some(path.as_str()));
        // pid 1 is most likely elsewhere; the walk finds ours anyway.
        assert_eq!(cgroup_path_by_id(id, 1).as_deref(), Some(path.as_str()));
        assert_eq!(cgroup_path_by_id(u64::MAX, me), None);
    }
}
