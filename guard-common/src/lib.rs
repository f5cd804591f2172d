//! Types shared by guard's eBPF programs (kernel side) and its loader (user side).
//!
//! Every type here is `#[repr(C)]` plain data: the kernel writes it into maps and the ring
//! buffer, user space reads the same bytes back.
#![no_std]

/// Size of the ring buffer that carries [`SockEvent`]s, in bytes (a power of two, as the kernel
/// requires). 4 MiB holds about 50,000 events between two reads.
pub const RING_BUFFER_BYTES: u32 = 1 << 22;

/// Entries in the map of watched local ports.
pub const MAX_WATCHED_PORTS: u32 = 64;

/// Entries in the LRU map of connection owners.
pub const MAX_OWNERS: u32 = 65_536;

/// `AF_INET`, as the tracepoint reports it.
pub const AF_INET: u16 = 2;
/// `AF_INET6`, as the tracepoint reports it.
pub const AF_INET6: u16 = 10;
/// `IPPROTO_TCP`.
pub const IPPROTO_TCP: u16 = 6;

/// TCP states, numbered as in the kernel's `include/net/tcp_states.h`.
pub mod tcp_state {
    pub const ESTABLISHED: i32 = 1;
    pub const SYN_SENT: i32 = 2;
    pub const SYN_RECV: i32 = 3;
    pub const FIN_WAIT1: i32 = 4;
    pub const FIN_WAIT2: i32 = 5;
    pub const TIME_WAIT: i32 = 6;
    pub const CLOSE: i32 = 7;
    pub const CLOSE_WAIT: i32 = 8;
    pub const LAST_ACK: i32 = 9;
    pub const LISTEN: i32 = 10;
    pub const CLOSING: i32 = 11;
    pub const NEW_SYN_RECV: i32 = 12;
}

/// Byte offsets of the fields of `sock/inet_sock_set_state` in the tracepoint's record. User
/// space reads them from the running kernel's `format` file and hands them to the program as
/// its `LAYOUT` global before loading it, so a kernel that moves a field is read right.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    pub skaddr: u32,
    pub oldstate: u32,
    pub newstate: u32,
    pub sport: u32,
    pub dport: u32,
    pub family: u32,
    pub protocol: u32,
    pub saddr: u32,
    pub daddr: u32,
    pub saddr_v6: u32,
    pub daddr_v6: u32,
    pub _pad: u32,
}

impl Layout {
    /// The layout of every kernel from 4.16 to 7.3 (the program's value until user space
    /// sets its own).
    pub const KNOWN: Self = Self {
        skaddr: 8,
        oldstate: 16,
        newstate: 20,
        sport: 24,
        dport: 26,
        family: 28,
        protocol: 30,
        saddr: 32,
        daddr: 36,
        saddr_v6: 40,
        daddr_v6: 56,
        _pad: 0,
    };
}

/// One TCP state change of a connection on a watched port.
///
/// Addresses are 16 bytes for both families; IPv4 uses the first four. Ports are in host
/// byte order (the tracepoint converts them).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SockEvent {
    /// `bpf_ktime_get_ns()` at the state change (CLOCK_MONOTONIC).
    pub timestamp_ns: u64,
    /// The kernel's socket address: identifies one socket for its lifetime.
    pub skaddr: u64,
    pub saddr: [u8; 16],
    pub daddr: [u8; 16],
    pub sport: u16,
    pub dport: u16,
    pub family: u16,
    pub _pad: u16,
    pub oldstate: i32,
    pub newstate: i32,
}

/// Key of the connection-owner map: the client's own end of a connection.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct OwnerKey {
    pub addr: [u8; 16],
    pub port: u16,
    pub family: u16,
    pub _pad: u32,
}

/// The process that opened a connection, read while the kernel ran its `connect()`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Owner {
    /// The thread that called `connect()` (the kernel's pid).
    pub pid: u32,
    /// The process (the kernel's tgid: what user space calls the pid).
    pub tgid: u32,
    /// The cgroup v2 id (inode number of the cgroup's directory).
    pub cgroup_id: u64,
    /// The task's real user id.
    pub uid: u32,
    pub _pad: u32,
}

/// Indexes into the per-CPU counter array.
pub mod counter {
    /// Events that did not fit in the ring buffer.
    pub const RING_DROPS: u32 = 0;
    /// Events sent.
    pub const EVENTS: u32 = 1;
    /// Number of counters.
    pub const LEN: u32 = 2;
}

#[cfg(feature = "user")]
mod pod {
    // SAFETY: each type is #[repr(C)], Copy, made only of integers and byte arrays, and has
    // explicit padding fields, so every bit pattern is valid and there are no hidden bytes.
    unsafe impl aya::Pod for super::SockEvent {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::OwnerKey {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::Owner {}
    // SAFETY: as above (twelve u32s).
    unsafe impl aya::Pod for super::Layout {}

    impl super::SockEvent {
        /// An event from the bytes of one ring-buffer record; None if it is too short.
        pub fn from_record(record: &[u8]) -> Option<Self> {
            if record.len() < size_of::<Self>() {
                return None;
            }
            // SAFETY: the record holds at least size_of::<Self>() bytes (checked above);
            // read_unaligned makes no alignment assumption, and every bit pattern is a valid
            // SockEvent (the Pod reasoning above).
            Some(unsafe { record.as_ptr().cast::<Self>().read_unaligned() })
        }
    }
}
