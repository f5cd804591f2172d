//! Facts about this host's processes and mounts, read through the procfs crate: one place for
//! every question guard asks /proc.

use std::path::PathBuf;

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
        assert!(cgroup_of(std::process::id() as i32).is_some_and(|c| c.starts_with('/')));
        assert!(effective_capabilities().is_ok());
    }
}
