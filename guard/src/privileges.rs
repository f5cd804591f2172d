//! The capabilities guard holds, and giving up those it no longer needs once its eBPF program
//! is attached. Capabilities belong to each thread, so the drop happens before the runtime
//! starts any: every thread then inherits the smaller sets.

use caps::{CapSet, Capability, CapsHashSet};

use crate::config::{Config, FairBy};

#[derive(Debug, thiserror::Error)]
#[error("cannot drop capabilities ({set:?})")]
pub struct PrivilegeError {
    set: CapSet,
    #[source]
    source: caps::errors::CapsError,
}

/// The capabilities in this thread's effective set, by name (`CAP_BPF`), sorted.
pub fn held() -> Vec<String> {
    let mut names: Vec<String> = caps::read(None, CapSet::Effective)
        .unwrap_or_default()
        .iter()
        .map(ToString::to_string)
        .collect();
    names.sort();
    names
}

/// What guard still needs once its eBPF program is attached (or failed to attach), and why:
/// only reading another user's /proc/PID/fd and /proc/PID/exe, which the kernel gates behind
/// a ptrace-read check (CAP_SYS_PTRACE) on a directory of mode 0500 (CAP_DAC_READ_SEARCH).
/// That is needed to find the upstream by its listening port (`watch.upstream_pid = 0`), for
/// `exe` rules, and, without eBPF, to find which process opened a connection.
pub fn needed(config: &Config, ebpf_attached: bool) -> CapsHashSet {
    let exe_rules = config.classify.rule.iter().any(|rule| rule.exe.is_some());
    let peer_flows = config.class.values().any(|class| {
        matches!(
            class.fair_by,
            Some(FairBy::Uid | FairBy::Unit | FairBy::Cgroup)
        )
    });
    let proc_scan = config.watch.upstream_pid == 0
        || exe_rules
        || (!ebpf_attached
            && (config.classify.rule.iter().any(|r| r.reads_process()) || peer_flows));
    let mut needed = CapsHashSet::new();
    if proc_scan {
        needed.extend([Capability::CAP_SYS_PTRACE, Capability::CAP_DAC_READ_SEARCH]);
    }
    // Before Linux 5.19, with unprivileged BPF disabled, every bpf() call needs CAP_BPF, map
    // lookups on guard's own descriptors included.
    if ebpf_attached && kernel_before(5, 19) {
        needed.insert(Capability::CAP_BPF);
    }
    needed
}

/// Whether the running kernel is older than `major.minor`.
fn kernel_before(major: u32, minor: u32) -> bool {
    let Ok(uname) = nix::sys::utsname::uname() else {
        return true;
    };
    let release = uname.release().to_string_lossy().into_owned();
    let mut parts = release
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|p| p.parse::<u32>().ok());
    let version = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    version < (major, minor)
}

/// Keeps only `keep` (where held) in every set of this thread, and in the bounding set where
/// this thread may change it; returns what it dropped from the effective set.
pub fn keep_only(keep: &CapsHashSet) -> Result<Vec<String>, PrivilegeError> {
    let fail = |set: CapSet| move |source| PrivilegeError { set, source };
    let before = held();
    // The bounding set first: changing it needs CAP_SETPCAP, which the next steps drop.
    if caps::has_cap(None, CapSet::Effective, Capability::CAP_SETPCAP).unwrap_or(false) {
        let bounding = caps::read(None, CapSet::Bounding).map_err(fail(CapSet::Bounding))?;
        for cap in bounding.difference(keep) {
            caps::drop(None, CapSet::Bounding, *cap).map_err(fail(CapSet::Bounding))?;
        }
    }
    caps::clear(None, CapSet::Ambient).map_err(fail(CapSet::Ambient))?;
    // Effective before permitted: the effective set must stay within the permitted one.
    for set in [CapSet::Inheritable, CapSet::Effective, CapSet::Permitted] {
        let now = caps::read(None, set).map_err(fail(set))?;
        let kept: CapsHashSet = now.intersection(keep).copied().collect();
        caps::set(None, set, &kept).map_err(fail(set))?;
    }
    let after = held();
    Ok(before.into_iter().filter(|c| !after.contains(c)).collect())
}
