//! One class's cgroup and how to hold it back: cgroup v2 (`cgroup.freeze`, `cpu.max`) or v1
//! (`freezer.state`, `cpu.cfs_quota_us`), chosen by the filesystem the path lives on.

use std::path::{Path, PathBuf};

use crate::config::Throttle;

#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error(
        "{}: not inside a cgroup filesystem (cgroup2, or a v1 hierarchy); {mounted}",
        path.display()
    )]
    NotCgroup { path: PathBuf, mounted: String },
    #[error(
        "{}: throttle \"{mode}\" needs {needs}, which this cgroup lacks{hint}",
        path.display()
    )]
    MissingController {
        path: PathBuf,
        mode: String,
        needs: &'static str,
        hint: &'static str,
    },
    #[error("{}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// The cgroup filesystems of this host: where each is mounted, and which kind.
#[derive(Clone, Debug)]
pub struct Mount {
    pub root: PathBuf,
    /// None for cgroup2; the v1 controllers for a v1 hierarchy.
    pub v1_controllers: Option<Vec<String>>,
}

/// This host's cgroup and cgroup2 mounts.
pub fn mounts() -> Vec<Mount> {
    crate::procs::mounts()
        .into_iter()
        .filter_map(|mount| match mount.fs_type.as_str() {
            "cgroup2" => Some(Mount {
                root: mount.point,
                v1_controllers: None,
            }),
            "cgroup" => Some(Mount {
                root: mount.point,
                v1_controllers: Some(mount.options),
            }),
            _ => None,
        })
        .collect()
}

/// A control file and the values that mean "held back" and (until read) "normal".
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Control {
    pub file: PathBuf,
    pub throttled: String,
}

/// A class's cgroup, resolved and checked.
#[derive(Clone, Debug)]
pub struct Cgroup {
    pub path: PathBuf,
    /// The file that holds processes (`cgroup.procs`).
    pub procs: PathBuf,
    pub control: Control,
}

impl Control {
    /// The file that throttles `path` in `mode`, and the value that does; else what is
    /// missing (what it needs, and how to get it).
    fn of(
        path: &Path,
        mount: &Mount,
        mode: Throttle,
    ) -> Result<Self, (&'static str, &'static str)> {
        Ok(match (&mount.v1_controllers, mode) {
            (None, Throttle::Freeze) => Control {
                file: path.join("cgroup.freeze"),
                throttled: "1".to_owned(),
            },
            (None, Throttle::Cpu(percent)) => {
                let parent = path.parent().unwrap_or(&mount.root);
                let enabled = std::fs::read_to_string(parent.join("cgroup.subtree_control"))
                    .unwrap_or_default();
                if !enabled.split_whitespace().any(|c| c == "cpu") {
                    return Err((
                        "the cgroup v2 cpu controller (cpu.max)",
                        ": enable it with `echo +cpu > PARENT/cgroup.subtree_control`, or use a v1 cpu hierarchy such as /sys/fs/cgroup/cpu/...",
                    ));
                }
                Control {
                    file: path.join("cpu.max"),
                    throttled: format!("{} 100000", percent * 1000),
                }
            }
            (Some(controllers), Throttle::Freeze) => {
                if !controllers.iter().any(|c| c == "freezer") {
                    return Err((
                        "the v1 freezer controller",
                        ": put the cgroup under the freezer hierarchy (e.g. /sys/fs/cgroup/freezer/...)",
                    ));
                }
                Control {
                    file: path.join("freezer.state"),
                    throttled: "FROZEN".to_owned(),
                }
            }
            (Some(controllers), Throttle::Cpu(percent)) => {
                if !controllers.iter().any(|c| c == "cpu") {
                    return Err((
                        "the v1 cpu controller",
                        ": put the cgroup under the cpu hierarchy (e.g. /sys/fs/cgroup/cpu/...)",
                    ));
                }
                // The period is 100 ms; N % of one CPU is N ms of it.
                Control {
                    file: path.join("cpu.cfs_quota_us"),
                    throttled: (percent * 1000).to_string(),
                }
            }
        })
    }
}

impl Cgroup {
    /// Resolves `path` against the host's cgroup mounts and checks that `mode` can be applied
    /// there. Creates the cgroup directory where it is missing.
    pub fn resolve(path: &Path, mode: Throttle) -> Result<Self, CgroupError> {
        let mount = mount_of(path)?;
        let missing = |needs, hint| CgroupError::MissingController {
            path: path.to_owned(),
            mode: mode.to_string(),
            needs,
            hint,
        };
        let control =
            Control::of(path, &mount, mode).map_err(|(needs, hint)| missing(needs, hint))?;
        std::fs::create_dir_all(path).map_err(|source| CgroupError::Io {
            path: path.to_owned(),
            source,
        })?;
        if !control.file.exists() {
            return Err(missing(
                "its control file",
                ": the kernel does not offer it here",
            ));
        }
        // Writing needs permission: check now rather than at the first risk.
        nix::unistd::access(&control.file, nix::unistd::AccessFlags::W_OK).map_err(|err| {
            CgroupError::Io {
                path: control.file.clone(),
                source: std::io::Error::from(err),
            }
        })?;
        Ok(Self {
            procs: path.join("cgroup.procs"),
            path: path.to_owned(),
            control,
        })
    }

    /// Whether `resolve` with `mode`, or a process joining the cgroup (`guard exec`) without
    /// one, would work on `path`, changing nothing: where the directory is missing, whether it
    /// could be made.
    pub fn check(path: &Path, mode: Option<Throttle>) -> Result<(), CgroupError> {
        let mount = mount_of(path)?;
        let file = match mode {
            Some(mode) => {
                Control::of(path, &mount, mode)
                    .map_err(|(needs, hint)| CgroupError::MissingController {
                        path: path.to_owned(),
                        mode: mode.to_string(),
                        needs,
                        hint,
                    })?
                    .file
            }
            None => path.join("cgroup.procs"),
        };
        let writable = |target: &Path| {
            nix::unistd::access(target, nix::unistd::AccessFlags::W_OK).map_err(|err| {
                CgroupError::Io {
                    path: target.to_owned(),
                    source: std::io::Error::from(err),
                }
            })
        };
        if path.is_dir() {
            return writable(&file);
        }
        match path.ancestors().find(|dir| dir.is_dir()) {
            Some(dir) => writable(dir),
            None => Ok(()),
        }
    }

    pub fn read(&self) -> Result<String, CgroupError> {
        std::fs::read_to_string(&self.control.file)
            .map(|v| v.trim().to_owned())
            .map_err(|source| CgroupError::Io {
                path: self.control.file.clone(),
                source,
            })
    }

    pub fn write(&self, value: &str) -> Result<(), CgroupError> {
        write(&self.control.file, value)
    }

    /// Moves a process into this cgroup.
    pub fn add(&self, pid: u32) -> Result<(), CgroupError> {
        write(&self.procs, &pid.to_string())
    }
}

/// The cgroup mount `path` lies in (the deepest), else why it is not a cgroup.
fn mount_of(path: &Path) -> Result<Mount, CgroupError> {
    let all = mounts();
    let found = all
        .iter()
        .filter(|m| path.starts_with(&m.root) && path != m.root)
        .max_by_key(|m| m.root.components().count())
        .cloned();
    found.ok_or_else(|| CgroupError::NotCgroup {
        path: path.to_owned(),
        mounted: mounted(&all),
    })
}

/// Where this host mounts the hierarchies guard can use, in words.
fn mounted(all: &[Mount]) -> String {
    let useful: Vec<String> = all
        .iter()
        .filter_map(|m| match &m.v1_controllers {
            None => Some(format!("cgroup2 at {}", m.root.display())),
            Some(controllers) => controllers
                .iter()
                .find(|c| *c == "cpu" || *c == "freezer")
                .map(|c| format!("v1 {c} at {}", m.root.display())),
        })
        .collect();
    if useful.is_empty() {
        "this host mounts none".to_owned()
    } else {
        format!("this host has {}", useful.join(", "))
    }
}

/// Writes a cgroup control file.
pub fn write(file: &Path, value: &str) -> Result<(), CgroupError> {
    std::fs::write(file, value).map_err(|source| CgroupError::Io {
        path: file.to_owned(),
        source,
    })
}
