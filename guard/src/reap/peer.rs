//! Who opened a connection guard accepted: its process, user, cgroup and executable. From the
//! eBPF connect-owner record where the program runs (pid, uid and cgroup id as the kernel saw
//! them at `connect()`: no capability needed to read them back), else from /proc (a scan of
//! every process's sockets: slower, and blind to other users' processes without
//! CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH).

use std::{net::SocketAddr, path::PathBuf};

use super::{EbpfTracker, event::canonical};

/// Where a peer's identity came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PeerSource {
    /// The eBPF record taken in the client's `connect()`.
    Ebpf,
    /// A scan of /proc.
    Proc,
}

/// The local process at the other end of a connection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Peer {
    pub pid: i32,
    pub uid: Option<u32>,
    /// The cgroup v2 path, e.g. `/system.slice/nightly-extract.service`.
    pub cgroup: Option<String>,
    /// Its executable; unreadable for another user's process without CAP_SYS_PTRACE.
    pub exe: Option<PathBuf>,
    pub source: PeerSource,
}

/// The process that opened the connection from `client` to `server`, if it is local.
pub fn peer_of(
    tracker: Option<&EbpfTracker>,
    client: SocketAddr,
    server: SocketAddr,
) -> Option<Peer> {
    if let Some(owner) = tracker.and_then(|t| t.owner(client)) {
        let pid = owner.tgid as i32;
        return Some(Peer {
            pid,
            uid: Some(owner.uid),
            cgroup: crate::procs::cgroup_path_by_id(owner.cgroup_id, pid),
            exe: crate::procs::exe_of(pid),
            source: PeerSource::Ebpf,
        });
    }
    let pid = pid_from_proc(client, server)?;
    Some(Peer {
        pid,
        uid: crate::procs::uid_of(pid),
        cgroup: crate::procs::cgroup_of(pid),
        exe: crate::procs::exe_of(pid),
        source: PeerSource::Proc,
    })
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
