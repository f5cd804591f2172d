//! The kernel half of guard: one program on `sock/inet_sock_set_state`.
//!
//! For every TCP state change of a connection whose local or remote port is in `WATCHED_PORTS`,
//! it sends a [`SockEvent`] into `EVENTS`. On a client's own `connect()` (its move to SYN_SENT,
//! which runs in the client's task) it notes the task's pid, tgid, uid and cgroup id; when that
//! socket reaches ESTABLISHED (its port now assigned) the note moves into `OWNERS`, keyed by the
//! client's address and port, where user space looks it up for an accepted connection.
// Built for bpfel-unknown-none by guard's build script; on the host (clippy, `cargo test
// --workspace`) it is an empty program, so the workspace's std-using crates can coexist.
#![cfg_attr(target_arch = "bpf", no_std)]
#![cfg_attr(target_arch = "bpf", no_main)]

use aya_ebpf::{
    helpers::{
        bpf_get_current_cgroup_id, bpf_get_current_pid_tgid, bpf_get_current_uid_gid,
        bpf_ktime_get_ns,
    },
    macros::{map, tracepoint},
    maps::{HashMap, LruHashMap, PerCpuArray, RingBuf},
    programs::TracePointContext,
};
use aya_log_ebpf::warn;
use guard_common::{
    AF_INET, AF_INET6, IPPROTO_TCP, Layout, MAX_OWNERS, MAX_WATCHED_PORTS, Owner, OwnerKey,
    RING_BUFFER_BYTES, SockEvent, counter, tcp_state,
};

/// Where this kernel puts each field of the record: set by user space from the tracepoint's
/// format file when it loads the program (aya's loader globals).
#[unsafe(no_mangle)]
static LAYOUT: Layout = Layout::KNOWN;

/// Local ports guard serves on; the value is 1.
#[map]
static WATCHED_PORTS: HashMap<u16, u8> = HashMap::with_max_entries(MAX_WATCHED_PORTS, 0);

/// State changes of watched connections, for user space.
#[map]
static EVENTS: RingBuf = RingBuf::with_byte_size(RING_BUFFER_BYTES, 0);

/// Who is connecting, by socket, between SYN_SENT and ESTABLISHED.
#[map]
static CONNECTING: LruHashMap<u64, Owner> = LruHashMap::with_max_entries(MAX_OWNERS, 0);

/// Who connected, by the client's address and port.
#[map]
static OWNERS: LruHashMap<OwnerKey, Owner> = LruHashMap::with_max_entries(MAX_OWNERS, 0);

/// Per-CPU counters, indexed by `guard_common::counter`.
#[map]
static COUNTERS: PerCpuArray<u64> = PerCpuArray::with_max_entries(counter::LEN, 0);

#[tracepoint]
pub fn inet_sock_set_state(ctx: TracePointContext) -> u32 {
    // A failed read means a record we cannot interpret; there is nothing useful to do with it.
    let _ = try_inet_sock_set_state(&ctx);
    0
}

/// The layout user space set. A volatile read: the compiler must not fold in the value the
/// object was built with, since the loader rewrites it.
fn layout() -> Layout {
    // SAFETY: a read of a plain static that nothing writes once the program runs.
    unsafe { core::ptr::read_volatile(&LAYOUT) }
}

fn try_inet_sock_set_state(ctx: &TracePointContext) -> Result<(), i32> {
    let off = layout();
    let at = |offset: u32| offset as usize;
    // SAFETY (all reads below): offsets and sizes come from this kernel's format file, read by
    // user space at load time; bpf_probe_read_kernel faults safely on anything else.
    let protocol: u16 = unsafe { ctx.read_at(at(off.protocol))? };
    if protocol != IPPROTO_TCP {
        return Ok(());
    }
    let sport: u16 = unsafe { ctx.read_at(at(off.sport))? };
    let dport: u16 = unsafe { ctx.read_at(at(off.dport))? };
    let local_is_watched = is_watched(sport);
    let remote_is_watched = is_watched(dport);
    if !local_is_watched && !remote_is_watched {
        return Ok(());
    }

    let family: u16 = unsafe { ctx.read_at(at(off.family))? };
    let mut saddr = [0u8; 16];
    let mut daddr = [0u8; 16];
    match family {
        AF_INET => {
            let s: [u8; 4] = unsafe { ctx.read_at(at(off.saddr))? };
            let d: [u8; 4] = unsafe { ctx.read_at(at(off.daddr))? };
            saddr[..4].copy_from_slice(&s);
            daddr[..4].copy_from_slice(&d);
        }
        AF_INET6 => {
            saddr = unsafe { ctx.read_at(at(off.saddr_v6))? };
            daddr = unsafe { ctx.read_at(at(off.daddr_v6))? };
        }
        _ => return Ok(()),
    }
    let skaddr: u64 = unsafe { ctx.read_at(at(off.skaddr))? };
    let oldstate: i32 = unsafe { ctx.read_at(at(off.oldstate))? };
    let newstate: i32 = unsafe { ctx.read_at(at(off.newstate))? };

    if remote_is_watched {
        note_owner(skaddr, oldstate, newstate, family, saddr, sport);
    }

    let event = SockEvent {
        // SAFETY: a plain helper call with no arguments.
        timestamp_ns: unsafe { bpf_ktime_get_ns() },
        skaddr,
        saddr,
        daddr,
        sport,
        dport,
        family,
        _pad: 0,
        oldstate,
        newstate,
    };
    match EVENTS.reserve::<SockEvent>(0) {
        Some(mut entry) => {
            entry.write(event);
            entry.submit(0);
            count(counter::EVENTS);
        }
        None => {
            count(counter::RING_DROPS);
            warn!(
                ctx,
                "events ring buffer full: dropped a state change on port {}", sport
            );
        }
    }
    Ok(())
}

/// Follows a client's socket from its `connect()` to ESTABLISHED, recording its owner.
fn note_owner(skaddr: u64, oldstate: i32, newstate: i32, family: u16, addr: [u8; 16], port: u16) {
    if newstate == tcp_state::SYN_SENT {
        // The kernel is running the client's connect(): the current task is the client. Its
        // port is not assigned yet (inet_hash_connect runs after this state change), so key by
        // socket until ESTABLISHED.
        let pid_tgid = bpf_get_current_pid_tgid();
        let owner = Owner {
            pid: pid_tgid as u32,
            tgid: (pid_tgid >> 32) as u32,
            // SAFETY: a plain helper call with no arguments.
            cgroup_id: unsafe { bpf_get_current_cgroup_id() },
            // The low half is the real uid.
            uid: bpf_get_current_uid_gid() as u32,
            _pad: 0,
        };
        let _ = CONNECTING.insert(skaddr, owner, 0);
    } else if oldstate == tcp_state::SYN_SENT {
        // SAFETY: the value is copied out at once; no reference outlives this statement.
        let owner = unsafe { CONNECTING.get(skaddr) }.copied();
        let _ = CONNECTING.remove(skaddr);
        if let (Some(owner), tcp_state::ESTABLISHED) = (owner, newstate) {
            let key = OwnerKey {
                addr,
                port,
                family,
                _pad: 0,
            };
            let _ = OWNERS.insert(key, owner, 0);
        }
    }
}

fn is_watched(port: u16) -> bool {
    // Read the stored 1 rather than test the pointer: the compiler would otherwise OR two
    // map-value pointers together, which the verifier refuses.
    // SAFETY: the value is copied out at once.
    unsafe { WATCHED_PORTS.get(port) }.map_or(0, |watched| *watched) != 0
}

fn count(index: u32) {
    if let Some(slot) = COUNTERS.get_ptr_mut(index) {
        // SAFETY: a per-CPU slot is only written by this CPU, and programs do not nest here.
        unsafe { *slot += 1 };
    }
}

#[cfg(target_arch = "bpf")]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo<'_>) -> ! {
    // eBPF programs cannot unwind; the verifier rejects any path that would reach here.
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";

#[cfg(not(target_arch = "bpf"))]
fn main() {}
