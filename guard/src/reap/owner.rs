//! Which process, in which cgroup, opened a connection guard accepted: from the eBPF
//! connect-owner map, or, where eBPF is off, from /proc (slower: it scans open sockets).

use std::net::SocketAddr;

use super::{EbpfTracker, event::canonical};

/// The cgroup v2 path (as in /proc/PID/cgroup, e.g. `/guard/batch`) of the process that opened
/// the connection from `client` to `server`.
pub fn client_cgroup(
    tracker: Option<&EbpfTracker>,
    client: SocketAddr,
    server: SocketAddr,
) -> Option<String> {
    let pid = match tracker.and_then(|t| t.owner(client)) {
        Some(owner) => owner.tgid as i32,
        None => pid_from_proc(client, server)?,
    };
    cgroup_of(pid)
}

/// The cgroup v2 path of a process.
pub fn cgroup_of(pid: i32) -> Option<String> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    text.lines()
        .find_map(|line| line.strip_prefix("0::"))
        .map(str::to_owned)
}

/// Finds the local process whose socket is `client` → `server` by its inode.
fn pid_from_proc(client: SocketAddr, server: SocketAddr) -> Option<i32> {
    let (client, server) = (canonical(client), canonical(server));
    let entries = procfs::net::tcp()
        .into_iter()
        .flatten()
        .chain(procfs::net::tcp6().into_iter().flatten());
    let inode = entries
        .filter(|entry| {
            canonical(entry.local_address) == client && canonical(entry.remote_address) == server
        })
        .map(|entry| entry.inode)
        .next()?;
    procfs::process::all_processes()
        .ok()?
        .flatten()
        .find_map(|process| {
            let holds = process.fd().ok()?.flatten().any(|fd| {
            matches!(fd.target, procfs::process::FDTarget::Socket(found) if found == inode)
        });
            holds.then_some(process.pid)
        })
}
