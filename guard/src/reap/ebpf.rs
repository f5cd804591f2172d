//! Loads and attaches guard's eBPF program (guard-ebpf), and offers what it sees: a stream of
//! connection events for watched ports, and who opened a connection.

use std::{
    net::{IpAddr, SocketAddr},
    path::Path,
    sync::Arc,
};

use aya::{
    Ebpf,
    maps::{HashMap, MapData, PerCpuArray, RingBuf},
    programs::TracePoint,
};
use guard_common::{AF_INET, AF_INET6, Layout, Owner, OwnerKey, counter};
use tokio::{io::unix::AsyncFd, sync::mpsc, task::JoinHandle};

use super::{event::ConnEvent, mounts};

/// Events waiting for their consumer; beyond this the reader waits and the kernel's ring
/// buffer absorbs (and counts) the excess.
const CHANNEL_CAPACITY: usize = 16_384;

/// Why the kernel half cannot run. Each message says what is missing and how to fix it.
#[derive(Debug, thiserror::Error)]
pub enum EbpfError {
    #[error("disabled in the config (ebpf.enabled = false)")]
    Disabled,
    #[error(
        "no permission to load eBPF programs: run as root, or grant CAP_BPF and CAP_PERFMON \
         (the systemd unit does)"
    )]
    Permission,
    #[error("tracefs is not mounted and mounting it at /sys/kernel/tracing failed")]
    Tracefs(#[source] nix::Error),
    #[error("this kernel has no tracepoint sock/inet_sock_set_state (Linux 4.16 or newer has it)")]
    NoTracepoint(#[source] std::io::Error),
    #[error(
        "the tracepoint's field `{field}` is {found} on this kernel, guard reads {size} bytes: \
         this kernel is not supported yet"
    )]
    FormatMismatch {
        field: &'static str,
        size: usize,
        /// What the format file says of it: "missing", or its size.
        found: String,
    },
    #[error("the kernel refused guard's eBPF object")]
    Load(#[from] aya::EbpfError),
    #[error("the kernel refused guard's eBPF program")]
    Program(#[from] aya::programs::ProgramError),
    #[error("guard's eBPF map `{name}`")]
    Map {
        name: &'static str,
        source: aya::maps::MapError,
    },
    #[error("guard's eBPF map `{0}` is missing from the object")]
    MissingMap(&'static str),
    #[error("cannot read this process's capabilities")]
    Capabilities(#[source] std::io::Error),
    #[error("cannot watch guard's eBPF events")]
    Io(#[from] std::io::Error),
}

/// What `guard doctor` finds missing for the kernel half.
#[derive(Debug, thiserror::Error)]
pub enum PreflightError {
    #[error(transparent)]
    Ebpf(#[from] EbpfError),
    #[error(
        "no /sys/kernel/btf/vmlinux: not needed by guard's tracepoint, but bpftool and CO-RE \
         tools want CONFIG_DEBUG_INFO_BTF=y"
    )]
    NoBtf,
    /// Clients' closes are seen, only not by the kernel program.
    #[error("from user space (a poll on each client's socket)")]
    UserSpace(#[source] EbpfError),
}

/// The process that opened a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnOwner {
    /// The thread that called `connect()`.
    pub pid: u32,
    /// Its process (what `ps` shows as PID).
    pub tgid: u32,
    /// cgroup v2 id: the inode number of the cgroup's directory.
    pub cgroup_id: u64,
    /// The connecting task's real uid.
    pub uid: u32,
}

/// guard's attached eBPF program and its maps. Dropping it detaches everything.
pub struct EbpfTracker {
    /// Filled at attach; kept so the map lives as long as the tracker.
    _watched: HashMap<MapData, u16, u8>,
    owners: HashMap<MapData, OwnerKey, Owner>,
    counters: PerCpuArray<MapData, u64>,
    tasks: Vec<JoinHandle<()>>,
    // Last, so the program is detached after the tasks that read its maps are told to stop.
    _ebpf: Ebpf,
}

/// The program loaded and attached, its maps taken, nothing read yet: the privileged half of
/// the start, done before any thread exists so that the capabilities it needed can be dropped
/// for every thread.
pub struct Loaded {
    ebpf: Ebpf,
    logger: Option<aya_log::EbpfLogger<&'static dyn log::Log>>,
    watched: HashMap<MapData, u16, u8>,
    owners: HashMap<MapData, OwnerKey, Owner>,
    counters: PerCpuArray<MapData, u64>,
    ring: RingBuf<MapData>,
}

impl EbpfTracker {
    /// Loads and attaches the program, watching `ports`, with the record layout of this
    /// kernel's tracepoint. Needs no runtime; `Loaded::start` then begins reading.
    pub fn load(ports: &[u16]) -> Result<Loaded, EbpfError> {
        check_capabilities()?;
        let layout = running_layout()?;
        Self::load_checked(ports, layout)
    }

    /// As `load`, with the layout the caller says (tests hand it a wrong one on purpose, to
    /// see that the program reads where it is told).
    pub fn load_with_layout(ports: &[u16], layout: Layout) -> Result<Loaded, EbpfError> {
        check_capabilities()?;
        Self::load_checked(ports, layout)
    }

    /// Loads and attaches once the capabilities are known to be held.
    fn load_checked(ports: &[u16], layout: Layout) -> Result<Loaded, EbpfError> {
        if let Err(err) = mounts::ensure_bpffs() {
            // Nothing is pinned, so a missing bpffs costs only bpftool's view of our maps.
            tracing::warn!(%err, "could not mount bpffs at /sys/fs/bpf");
        }
        if layout != Layout::KNOWN {
            tracing::info!(
                ?layout,
                "this kernel lays the tracepoint's record out its own way"
            );
        }
        let mut ebpf = aya::EbpfLoader::new()
            .override_global("LAYOUT", &layout, true)
            .load(aya::include_bytes_aligned!(concat!(
                env!("OUT_DIR"),
                "/guard-ebpf"
            )))?;
        let logger = aya_log::EbpfLogger::init(&mut ebpf)
            .inspect_err(|err| {
                let error = crate::error_chain(err);
                tracing::warn!(%error, "eBPF log records will not be shown");
            })
            .ok();
        let mut watched: HashMap<MapData, u16, u8> = take_map(&mut ebpf, "WATCHED_PORTS")?;
        for &port in ports {
            watched
                .insert(port, 1, 0)
                .map_err(map_error("WATCHED_PORTS"))?;
        }
        let owners = take_map(&mut ebpf, "OWNERS")?;
        let counters = take_map(&mut ebpf, "COUNTERS")?;
        let ring: RingBuf<MapData> = take_map(&mut ebpf, "EVENTS")?;

        let program: &mut TracePoint = ebpf
            .program_mut("inet_sock_set_state")
            .ok_or(EbpfError::MissingMap("inet_sock_set_state"))?
            .try_into()?;
        program.load()?;
        program.attach("sock", "inet_sock_set_state")?;

        // Loading parsed the kernel's BTF (megabytes) on the heap: hand it back.
        crate::memory::trim();
        Ok(Loaded {
            ebpf,
            logger,
            watched,
            owners,
            counters,
            ring,
        })
    }

    /// Loads, attaches and starts reading at once (for tests and tools that hold no
    /// capabilities to drop). Needs a tokio runtime.
    pub fn attach(ports: &[u16]) -> Result<(Arc<Self>, mpsc::Receiver<ConnEvent>), EbpfError> {
        Self::load(ports)?.start()
    }

    /// Who opened the connection whose client end is `client` (a local process connecting to
    /// a watched port), where the kernel saw its `connect()`.
    pub fn owner(&self, client: SocketAddr) -> Option<ConnOwner> {
        owner_keys(client)
            .into_iter()
            .find_map(|key| self.owners.get(&key, 0).ok())
            .map(|owner| ConnOwner {
                pid: owner.pid,
                tgid: owner.tgid,
                cgroup_id: owner.cgroup_id,
                uid: owner.uid,
            })
    }

    /// Events the kernel could not put in the ring buffer since attach.
    pub fn ring_drops(&self) -> u64 {
        self.counter(counter::RING_DROPS)
    }

    /// Events the kernel sent since attach.
    pub fn events_sent(&self) -> u64 {
        self.counter(counter::EVENTS)
    }

    fn counter(&self, index: u32) -> u64 {
        self.counters
            .get(&index, 0)
            .map(|per_cpu| per_cpu.iter().sum())
            .unwrap_or(0)
    }
}

impl Loaded {
    /// Starts reading: the receiver yields every state change of a connection on a watched
    /// port (either end local). Needs a tokio runtime; no capability.
    pub fn start(self) -> Result<(Arc<EbpfTracker>, mpsc::Receiver<ConnEvent>), EbpfError> {
        let mut tasks = Vec::new();
        if let Some(logger) = self.logger {
            tasks.push(tokio::spawn(forward_logs(logger)));
        }
        let (sender, receiver) = mpsc::channel(CHANNEL_CAPACITY);
        tasks.push(tokio::spawn(read_events(register(self.ring)?, sender)));
        let tracker = EbpfTracker {
            _watched: self.watched,
            owners: self.owners,
            counters: self.counters,
            tasks,
            _ebpf: self.ebpf,
        };
        Ok((Arc::new(tracker), receiver))
    }
}

impl Drop for EbpfTracker {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// The owner-map keys a client address may have been recorded under: an IPv4 client may have
/// connected from an AF_INET socket or, IPv4-mapped, from an AF_INET6 one.
fn owner_keys(client: SocketAddr) -> Vec<OwnerKey> {
    let key = |family, addr| OwnerKey {
        addr,
        port: client.port(),
        family,
        _pad: 0,
    };
    match client.ip().to_canonical() {
        IpAddr::V4(v4) => {
            let mut plain = [0u8; 16];
            plain[..4].copy_from_slice(&v4.octets());
            vec![
                key(AF_INET, plain),
                key(AF_INET6, v4.to_ipv6_mapped().octets()),
            ]
        }
        IpAddr::V6(v6) => vec![key(AF_INET6, v6.octets())],
    }
}

async fn read_events(mut ring: AsyncFd<RingBuf<MapData>>, sender: mpsc::Sender<ConnEvent>) {
    let mut batch = Vec::new();
    loop {
        let mut ready = match ring.readable_mut().await {
            Ok(ready) => ready,
            Err(err) => {
                tracing::error!(%err, "eBPF event ring buffer failed; no more close events");
                return;
            }
        };
        let events = ready.get_inner_mut();
        while let Some(item) = events.next() {
            if let Some(event) = ConnEvent::decode(&item) {
                batch.push(event);
            }
        }
        ready.clear_ready();
        for event in batch.drain(..) {
            if sender.send(event).await.is_err() {
                return;
            }
        }
    }
}

async fn forward_logs(logger: aya_log::EbpfLogger<&'static dyn log::Log>) {
    let Ok(mut logger) = register(logger) else {
        return;
    };
    while let Ok(mut ready) = logger.readable_mut().await {
        ready.get_inner_mut().flush();
        ready.clear_ready();
    }
}

/// Registers a map's descriptor with tokio's reactor.
fn register<T: std::os::fd::AsFd + std::os::fd::AsRawFd>(inner: T) -> std::io::Result<AsyncFd<T>> {
    guard_sys::fd::register(inner)
}

fn take_map<T>(ebpf: &mut Ebpf, name: &'static str) -> Result<T, EbpfError>
where
    T: TryFrom<aya::maps::Map, Error = aya::maps::MapError>,
{
    let map = ebpf.take_map(name).ok_or(EbpfError::MissingMap(name))?;
    T::try_from(map).map_err(map_error(name))
}

fn map_error(name: &'static str) -> impl Fn(aya::maps::MapError) -> EbpfError {
    move |source| EbpfError::Map { name, source }
}

/// Fails early, with a message that says what to grant, where loading would get EPERM.
fn check_capabilities() -> Result<(), EbpfError> {
    const CAP_SYS_ADMIN: u32 = 21;
    const CAP_PERFMON: u32 = 38;
    const CAP_BPF: u32 = 39;
    let effective = crate::procs::effective_capabilities().map_err(EbpfError::Capabilities)?;
    let has = |cap: u32| effective & (1 << cap) != 0;
    if has(CAP_SYS_ADMIN) || (has(CAP_BPF) && has(CAP_PERFMON)) {
        Ok(())
    } else {
        Err(EbpfError::Permission)
    }
}

/// The running kernel's layout of the tracepoint's record, from its format file.
fn running_layout() -> Result<Layout, EbpfError> {
    let tracefs = mounts::ensure_tracefs().map_err(EbpfError::Tracefs)?;
    layout_of(&mounts::tracepoint_format(tracefs).map_err(EbpfError::NoTracepoint)?)
}

/// Where a format file puts each field the program reads; a field missing or of another size
/// than the program reads is refused by name (guard then watches clients from user space).
fn layout_of(format: &str) -> Result<Layout, EbpfError> {
    let field = |name: &'static str, size: usize| match field_place(format, name) {
        Some((offset, found)) if found == size => {
            u32::try_from(offset).map_err(|_| EbpfError::FormatMismatch {
                field: name,
                size,
                found: format!("at offset {offset}"),
            })
        }
        place => Err(EbpfError::FormatMismatch {
            field: name,
            size,
            found: place.map_or_else(|| "missing".to_owned(), |(_, s)| format!("{s} bytes")),
        }),
    };
    Ok(Layout {
        skaddr: field("skaddr", 8)?,
        oldstate: field("oldstate", 4)?,
        newstate: field("newstate", 4)?,
        sport: field("sport", 2)?,
        dport: field("dport", 2)?,
        family: field("family", 2)?,
        protocol: field("protocol", 2)?,
        saddr: field("saddr", 4)?,
        daddr: field("daddr", 4)?,
        saddr_v6: field("saddr_v6", 16)?,
        daddr_v6: field("daddr_v6", 16)?,
        _pad: 0,
    })
}

/// The offset and size of `field` in a tracepoint format file.
fn field_place(format: &str, field: &str) -> Option<(usize, usize)> {
    format.lines().find_map(|line| {
        let mut parts = line.trim().split(';');
        let declaration = parts.next()?.trim();
        let name = declaration.rsplit([' ', '*']).next()?;
        let name = name.split('[').next()?;
        if name != field {
            return None;
        }
        let value = |key: &str| -> Option<usize> {
            line.split(';')
                .find_map(|part| part.trim().strip_prefix(key))?
                .parse()
                .ok()
        };
        Some((value("offset:")?, value("size:")?))
    })
}

/// Which way guard learns that a client left, and why: for `guard doctor`.
pub fn close_detection(enabled: bool) -> Result<String, PreflightError> {
    if !enabled {
        // The operator's choice, not something missing.
        return Ok(crate::error_chain(&PreflightError::UserSpace(
            EbpfError::Disabled,
        )));
    }
    check_capabilities().map_err(PreflightError::UserSpace)?;
    match running_layout() {
        Ok(layout) if layout == Layout::KNOWN => Ok(
            "eBPF on sock/inet_sock_set_state; the record's layout read from this kernel's \
             format file (the layout of every kernel tested)"
                .to_owned(),
        ),
        Ok(layout) => Ok(format!(
            "eBPF on sock/inet_sock_set_state; this kernel's own layout, read from its format \
             file and handed to the program: {layout:?}"
        )),
        Err(err) => Err(PreflightError::UserSpace(err)),
    }
}

/// Whether the host offers what the loader needs, for `guard doctor`: each item is a check
/// name and the problem, if any.
pub fn preflight() -> Vec<(&'static str, Result<String, PreflightError>)> {
    let btf = Path::new("/sys/kernel/btf/vmlinux");
    vec![
        (
            "bpf capabilities",
            check_capabilities()
                .map(|()| "CAP_BPF and CAP_PERFMON (or CAP_SYS_ADMIN) held".to_owned())
                .map_err(PreflightError::from),
        ),
        (
            "kernel BTF",
            if btf.exists() {
                Ok(btf.display().to_string())
            } else {
                Err(PreflightError::NoBtf)
            },
        ),
        (
            "tracepoint sock/inet_sock_set_state",
            mounts::ensure_tracefs()
                .map_err(EbpfError::Tracefs)
                .and_then(|tracefs| {
                    let format =
                        mounts::tracepoint_format(tracefs).map_err(EbpfError::NoTracepoint)?;
                    layout_of(&format)?;
                    Ok(format!("{} (every field guard reads)", tracefs.display()))
                })
                .map_err(PreflightError::from),
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    const FORMAT: &str = "name: inet_sock_set_state\nformat:\n\tfield:const void * skaddr;\toffset:8;\tsize:8;\tsigned:0;\n\tfield:__u8 saddr_v6[16];\toffset:40;\tsize:16;\tsigned:0;\n\tfield:__u16 sport;\toffset:24;\tsize:2;\tsigned:0;\n";

    #[test]
    fn field_places_are_read_from_the_format_file() {
        assert_eq!(field_place(FORMAT, "skaddr"), Some((8, 8)));
        assert_eq!(field_place(FORMAT, "saddr_v6"), Some((40, 16)));
        assert_eq!(field_place(FORMAT, "sport"), Some((24, 2)));
        assert_eq!(field_place(FORMAT, "dport"), None);
    }

    /// The format file of Debian's 5.10, 6.1, 6.12 and 7.3 kernels (all the same).
    const FULL: &str = include_str!("testdata/inet_sock_set_state.format");

    #[test]
    fn the_known_kernels_give_the_known_layout_and_a_moved_field_is_followed() {
        assert_eq!(layout_of(FULL).expect("layout"), Layout::KNOWN);
        let moved = FULL
            .replace("sport;\toffset:24;", "sport;\toffset:26;")
            .replace("dport;\toffset:26;", "dport;\toffset:24;");
        let layout = layout_of(&moved).expect("layout");
        assert_eq!((layout.sport, layout.dport), (26, 24));
    }

    #[test]
    fn a_missing_or_resized_field_is_refused_by_name() {
        let resized = FULL.replace("sport;\toffset:24;\tsize:2;", "sport;\toffset:24;\tsize:4;");
        let missing = FULL.replace("field:__u16 family", "field:__u16 famly");
        for (format, expected) in [(resized, "sport"), (missing, "family")] {
            match layout_of(&format) {
                Err(EbpfError::FormatMismatch { field, .. }) => assert_eq!(field, expected),
                other => panic!("expected a mismatch, got {other:?}"),
            }
        }
    }

    #[test]
    fn v4_clients_are_looked_up_both_ways() {
        let keys = owner_keys("127.0.0.1:4000".parse().expect("addr"));
        assert_eq!(keys.len(), 2);
        assert_eq!(keys[0].family, AF_INET);
        assert_eq!(&keys[0].addr[..4], &[127, 0, 0, 1]);
        assert_eq!(keys[1].family, AF_INET6);
    }
}
