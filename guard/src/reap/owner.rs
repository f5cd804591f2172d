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
    crate::procs::cgroup_of(pid)
}

/// Finds the local process whose socket is `client` → `server` by its inode.
fn pid_from_proc(client: SocketAddr, server: SocketAddr) -> Option<i32> {
    let (client, server) = (canonical(client), canonical(server));
    let inode = crate::procs::tcp_sockets()
        .find(|entry| {
            canonical(entry.local_address) == client && canonical(entry.remote_address) == server
        })?
        .inode;
    crate::procs::socket_holder(inode)
}
