//! Who opened a connection guard accepted: its process, user, cgroup and executable. From the
//! eBPF connect-owner record where the program runs (pid, uid and cgroup id as the kernel saw
//! them at `connect()`: no capability needed to read them back), else from /proc (a scan of
//! every process's sockets: slower, and blind to other users' processes without
//! CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH).

use std::{net::SocketAddr, path::PathBuf, sync::Arc};

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
    pub cgroup: Option<Arc<str>>,
    /// The cgroup's last component (a systemd unit or scope), e.g. `nightly-extract.service`.
    /// Shared, like the path: every request of the connection names it in the access log.
    pub unit: Option<Arc<str>>,
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
        return Some(Peer::new(
            pid,
            Some(owner.uid),
            crate::procs::cgroup_path_by_id(owner.cgroup_id, pid),
            PeerSource::Ebpf,
        ));
    }
    let pid = pid_from_proc(client, server)?;
    Some(Peer::new(
        pid,
        crate::procs::uid_of(pid),
        crate::procs::cgroup_of(pid),
        PeerSource::Proc,
    ))
}

impl Peer {
    /// A process with its user and cgroup; its executable is read here.
    pub fn new(pid: i32, uid: Option<u32>, cgroup: Option<String>, source: PeerSource) -> Self {
        let unit = cgroup
            .as_deref()
            .and_then(|path| path.rsplit('/').next())
            .filter(|unit| !unit.is_empty())
            .map(Arc::from);
        Self {
            pid,
            uid,
            cgroup: cgroup.map(Arc::from),
            unit,
            exe: crate::procs::exe_of(pid),
            source,
        }
    }
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
