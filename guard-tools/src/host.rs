//! What a config asks of this host that the file alone cannot say: class cgroups that are
//! cgroups this user can write, a state directory it can make, an access log it can open,
//! listening addresses that are free. `guard check-config` and `guard doctor` ask; `guard run` meets the same at start.

use std::{
    io::ErrorKind,
    net::{SocketAddr, TcpListener},
    path::Path,
};

use guard::{
    config::{Config, overlap},
    error_chain,
    throttle::cgroup::{Cgroup, CgroupError},
};

/// One thing the host does not give the config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    /// The key it is about (`class.batch.cgroup`, `server.listen`).
    pub key: String,
    /// Whether `guard run` would refuse to start over it (else only a warning).
    pub fatal: bool,
    pub why: String,
}

impl Finding {
    fn fatal(key: impl Into<String>, why: String) -> Self {
        Self {
            key: key.into(),
            fatal: true,
            why,
        }
    }

    fn warning(key: impl Into<String>, why: String) -> Self {
        Self {
            key: key.into(),
            fatal: false,
            why,
        }
    }
}

/// Everything this host refuses the config, checked without changing anything.
pub fn check(config: &Config) -> Vec<Finding> {
    let mut found = files(config);
    found.extend(addresses(config).filter_map(|(key, addr)| listen(key, addr)));
    found
}

/// What `check` finds in the file system: the class cgroups, the state directory, the
/// access log.
pub fn files(config: &Config) -> Vec<Finding> {
    let mut found = cgroups(config);
    found.extend(access_log(config));
    found
}

/// A refusal `guard run` would meet; one that is only a lack of permission is a warning where
/// this is not root (the shipped unit runs guard as root, which may well have it).
fn refused(key: impl Into<String>, why: String, permission: bool) -> Finding {
    let uid = nix::unistd::geteuid();
    if permission && !uid.is_root() {
        return Finding::warning(
            key,
            format!(
                "{why} (checked as uid {uid}; guard runs as root under the shipped unit: \
                 check as that user)"
            ),
        );
    }
    Finding::fatal(key, why)
}

/// The access log's file: `guard run` opens (or creates) it at start, and stops if it cannot.
fn access_log(config: &Config) -> Option<Finding> {
    let path = Path::new(config.log.access.as_deref().filter(|p| *p != "-")?);
    let target = match path.parent() {
        _ if path.exists() => path,
        Some(dir) if dir.is_dir() => dir,
        _ => {
            let why = format!("{}: its folder does not exist", path.display());
            return Some(Finding::fatal("log.access", why));
        }
    };
    let err = nix::unistd::access(target, nix::unistd::AccessFlags::W_OK).err()?;
    let why = format!(
        "{}: {}",
        target.display(),
        error_chain(&std::io::Error::from(err))
    );
    Some(refused("log.access", why, true))
}

/// Every listening address of the config, with its key.
pub fn addresses(config: &Config) -> impl Iterator<Item = (&'static str, SocketAddr)> + '_ {
    [
        ("server.listen", config.server.listen.addrs()),
        ("metrics.listen", config.metrics.listen.addrs()),
        (
            "cluster.agent_listen",
            config.cluster.agent_listen.as_slice(),
        ),
    ]
    .into_iter()
    .flat_map(|(key, addrs)| addrs.iter().map(move |addr| (key, *addr)))
}

/// Each class cgroup: one that is throttled must be usable as `guard run` uses it (it refuses
/// to start otherwise); one that is not is used only by `guard exec`, a warning.
fn cgroups(config: &Config) -> Vec<Finding> {
    let mut found = Vec::new();
    let mut throttled = false;
    for (name, class) in &config.class {
        let Some(path) = &class.cgroup else { continue };
        let key = format!("class.{name}.cgroup");
        throttled |= class.throttle.is_some();
        let Err(err) = Cgroup::check(path, class.throttle) else {
            continue;
        };
        let permission = matches!(&err, CgroupError::Io { source, .. }
            if source.kind() == ErrorKind::PermissionDenied);
        found.push(match class.throttle {
            Some(_) => refused(key, error_chain(&err), permission),
            None => Finding::warning(
                key,
                format!(
                    "{}; `guard exec --class {name}` would refuse it",
                    error_chain(&err)
                ),
            ),
        });
    }
    if throttled && let Err(why) = creatable(&config.risk.state_dir) {
        found.push(refused("risk.state_dir", why, true));
    }
    found
}

/// Whether this user can write in `dir`, or make it.
fn creatable(dir: &Path) -> Result<(), String> {
    let Some(existing) = dir.ancestors().find(|a| a.is_dir()) else {
        return Ok(());
    };
    nix::unistd::access(existing, nix::unistd::AccessFlags::W_OK).map_err(|err| {
        format!(
            "{}: {} (guard records cgroup values there before it changes them)",
            existing.display(),
            error_chain(&std::io::Error::from(err))
        )
    })
}

/// Whether guard could listen on `addr`: free, or held by a guard (a reload keeps it).
pub fn listen(key: &'static str, addr: SocketAddr) -> Option<Finding> {
    let err = match TcpListener::bind(addr) {
        Ok(_) => return None,
        Err(err) => err,
    };
    Some(match err.kind() {
        ErrorKind::AddrInUse => match holder(addr) {
            Some((pid, name)) if name == "guard" => Finding::warning(
                key,
                format!(
                    "{addr} is held by a running guard (pid {pid}): a reload (SIGHUP) keeps \
                     it; `guard run` needs that guard stopped first"
                ),
            ),
            Some((pid, name)) => Finding::fatal(
                key,
                format!(
                    "{addr} is taken by {name} (pid {pid}): move it elsewhere, or change {key}"
                ),
            ),
            None => Finding::fatal(
                key,
                format!("{addr} is taken by a process this user cannot see: change {key}"),
            ),
        },
        ErrorKind::PermissionDenied => Finding::warning(
            key,
            format!(
                "{addr}: a port under 1024 needs CAP_NET_BIND_SERVICE, which this process \
                 lacks; `guard run` needs it"
            ),
        ),
        _ => Finding::fatal(
            key,
            format!("cannot listen on {addr}: {}", error_chain(&err)),
        ),
    })
}

/// The pid and program name of the process listening on `addr`'s port there (or on a
/// wildcard of its family), where this user can see it.
fn holder(addr: SocketAddr) -> Option<(i32, String)> {
    let socket = guard::procs::tcp_sockets().find(|entry| {
        let local = entry.local_address;
        entry.state == procfs::net::TcpState::Listen
            && local.port() == addr.port()
            && overlap(local, addr)
    })?;
    let pid = guard::procs::socket_holder(socket.inode)?;
    let name = guard::procs::exe_of(pid)
        .and_then(|exe| Some(exe.file_name()?.to_string_lossy().into_owned()))
        .or_else(|| {
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).ok()?;
            Some(comm.trim().to_owned())
        })?;
    Some((pid, name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_taken_port_names_its_holder_and_a_free_one_passes() {
        let taken = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = taken.local_addr().expect("addr");
        let finding = listen("server.listen", addr).expect("taken");
        let me = std::process::id();
        assert!(finding.fatal, "{finding:?}");
        assert!(
            finding.why.contains(&format!("(pid {me})")) && finding.why.contains("server.listen"),
            "{finding:?}"
        );
        drop(taken);
        assert_eq!(listen("server.listen", addr), None);
    }

    #[test]
    fn an_access_log_in_a_folder_that_does_not_exist_is_fatal() {
        let mut config = Config::default();
        config.log.access = Some("/nonexistent-guard-dir/access.log".to_owned());
        let found = access_log(&config).expect("refused");
        assert!(
            found.fatal && found.why.contains("does not exist"),
            "{found:?}"
        );
        config.log.access = Some(
            std::env::temp_dir()
                .join("guard-access.log")
                .display()
                .to_string(),
        );
        assert_eq!(access_log(&config), None);
        config.log.access = Some("-".to_owned());
        assert_eq!(access_log(&config), None);
    }

    #[test]
    fn a_cgroup_outside_any_cgroup_filesystem_is_fatal_only_when_throttled() {
        let mut config = Config::default();
        let batch = config.class.get_mut("batch").expect("batch");
        batch.cgroup = Some(std::env::temp_dir().join("guard-not-a-cgroup"));
        let found = cgroups(&config);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(
            !found[0].fatal && found[0].why.contains("not inside a cgroup filesystem"),
            "{found:?}"
        );
        let batch = config.class.get_mut("batch").expect("batch");
        batch.throttle = Some(guard::config::Throttle::Freeze);
        let found = cgroups(&config);
        assert!(
            found
                .iter()
                .any(|f| f.fatal && f.key == "class.batch.cgroup")
        );
    }
}
