//! Crash-safe throttling: before guard changes a cgroup control file it records the file and
//! its original value in a state file of its own, locked for as long as guard runs. A later
//! start, or `guard restore` with no config at all, finds a record left by a crash and puts
//! the value back. The lock also keeps two guards off one cgroup.

use std::{
    fs::File,
    io::{Read as _, Seek as _, Write as _},
    path::{Path, PathBuf},
};

use super::cgroup::{self, CgroupError};

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("state directory {}", dir.display())]
    Dir {
        dir: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "cgroup {} is already throttled by another guard (lock {} held); run one guard per cgroup",
        cgroup.display(),
        lock.display()
    )]
    Locked { cgroup: PathBuf, lock: PathBuf },
    #[error("state file {}", file.display())]
    Io {
        file: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
}

/// Why a record left behind could not be put back.
#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    #[error(
        "{} must be a directory of uid {uid} that group and others cannot write",
        dir.display()
    )]
    Untrusted { dir: PathBuf, uid: u32 },
    #[error("cannot read the record")]
    Read(#[source] std::io::Error),
    #[error("the record is not one guard wrote")]
    NotJson(#[source] serde_json::Error),
    #[error("{} is not a cgroup control file guard changes", control.display())]
    NotAControl { control: PathBuf },
    #[error("the recorded value is not one guard wrote")]
    Value,
    #[error(transparent)]
    Put(#[from] CgroupError),
    #[error("cannot clear the record")]
    Clear(#[source] std::io::Error),
}

/// The locked record of one control file's original value.
pub struct Record {
    file: File,
    path: PathBuf,
    control: PathBuf,
}

/// What a record file holds while a change is outstanding.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Saved {
    /// The control file guard changed.
    control: PathBuf,
    /// Its value before.
    original: String,
}

/// State files end in this.
const SUFFIX: &str = ".orig";

impl Record {
    /// Locks the record for `control` in `dir`; restores a value a crashed guard left behind.
    pub fn open(dir: &Path, cgroup: &Path, control: &Path) -> Result<Self, StateError> {
        std::fs::create_dir_all(dir).map_err(|source| StateError::Dir {
            dir: dir.to_owned(),
            source,
        })?;
        let name: String = control
            .to_string_lossy()
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect();
        let path = dir.join(format!("{name}{SUFFIX}"));
        let io = |source| StateError::Io {
            file: path.clone(),
            source,
        };
        let file = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(io)?;
        // An exclusive flock(2), held for as long as the file is open.
        match file.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                return Err(StateError::Locked {
                    cgroup: cgroup.to_owned(),
                    lock: path,
                });
            }
            Err(std::fs::TryLockError::Error(source)) => return Err(io(source)),
        }
        let mut record = Self {
            file,
            path,
            control: control.to_owned(),
        };
        if let Some(original) = record.saved()? {
            cgroup::write(control, &restore_value(control, &original))?;
            tracing::warn!(file = %control.display(), %original, "restored a cgroup value left changed by an earlier guard that did not exit cleanly");
            record.clear()?;
        }
        Ok(record)
    }

    /// The recorded original, if a change is outstanding.
    pub fn saved(&mut self) -> Result<Option<String>, StateError> {
        let mut text = String::new();
        self.file
            .rewind()
            .and_then(|()| self.file.read_to_string(&mut text))
            .map_err(|source| StateError::Io {
                file: self.path.clone(),
                source,
            })?;
        if text.is_empty() {
            return Ok(None);
        }
        let saved: Saved = serde_json::from_str(&text).map_err(|err| StateError::Io {
            file: self.path.clone(),
            source: std::io::Error::new(std::io::ErrorKind::InvalidData, err),
        })?;
        Ok(Some(saved.original))
    }

    /// Records `original` durably, before the control file is changed.
    pub fn save(&mut self, original: &str) -> Result<(), StateError> {
        let io = |source| StateError::Io {
            file: self.path.clone(),
            source,
        };
        let saved = Saved {
            control: self.control.clone(),
            original: original.to_owned(),
        };
        let text = serde_json::to_string(&saved).map_err(|err| io(std::io::Error::other(err)))?;
        self.file.set_len(0).map_err(io)?;
        self.file.rewind().map_err(io)?;
        self.file.write_all(text.as_bytes()).map_err(io)?;
        self.file.sync_all().map_err(io)
    }

    /// Forgets the record once the original is back.
    pub fn clear(&mut self) -> Result<(), StateError> {
        self.file.set_len(0).map_err(|source| StateError::Io {
            file: self.path.clone(),
            source,
        })
    }
}

/// The value to write back: what was read, in the form the file accepts. (cpu.max reads as
/// "max 100000" and accepts that; freezer.state reads FREEZING mid-transition.)
pub fn restore_value(control: &Path, original: &str) -> String {
    if control.ends_with("freezer.state") && original != "FROZEN" {
        "THAWED".to_owned()
    } else {
        original.to_owned()
    }
}

/// What `restore_dir` did with one record.
#[derive(Debug)]
pub enum Restored {
    /// The control file has its original value again.
    Put { control: PathBuf, original: String },
    /// A running guard holds the record's lock: it restores its own.
    Held { record: PathBuf },
    Failed {
        record: PathBuf,
        reason: RestoreError,
    },
}

/// Puts back every value recorded in `dir` that no running guard holds, reading no config:
/// what `guard restore` (and `guard run`, first) does after a crash. A missing dir holds
/// nothing.
pub fn restore_dir(dir: &Path) -> Vec<Restored> {
    restore_dir_checked(dir, is_cgroup_control)
}

/// The control files guard changes (and so may put back).
const CONTROLS: [&str; 4] = [
    "cgroup.freeze",
    "cpu.max",
    "freezer.state",
    "cpu.cfs_quota_us",
];

/// The longest value guard records (`max 100000`, `FROZEN`, ...).
const MAX_VALUE: usize = 64;

/// Whether a record may name `control`: one of the files guard changes, inside a mounted
/// cgroup filesystem, named without symlinks. A record is data in a directory: it must not
/// turn into a root write anywhere else.
fn is_cgroup_control(control: &Path) -> bool {
    let named = control
        .file_name()
        .and_then(|name| name.to_str())
        .is_some_and(|name| CONTROLS.contains(&name));
    let Ok(canonical) = control.canonicalize() else {
        return false;
    };
    named
        && canonical == control
        && crate::procs::mounts().iter().any(|mount| {
            matches!(mount.fs_type.as_str(), "cgroup" | "cgroup2")
                && canonical.starts_with(&mount.point)
                && canonical != mount.point
        })
}

/// `restore_dir`, with the check each record's control file must pass.
fn restore_dir_checked(dir: &Path, allowed: fn(&Path) -> bool) -> Vec<Restored> {
    if let Err(reason) = trusted(dir) {
        return vec![Restored::Failed {
            record: dir.to_owned(),
            reason,
        }];
    }
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut records: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.to_string_lossy().ends_with(SUFFIX))
        .collect();
    records.sort();
    records
        .into_iter()
        .filter_map(|record| restore_file(&record, allowed).transpose())
        .map(|result| result.unwrap_or_else(|failed| failed))
        .collect()
}

/// A state directory only its owner can write, and that owner this process's user (a
/// directory others can write could hold records naming any file).
fn trusted(dir: &Path) -> Result<(), RestoreError> {
    use std::os::unix::fs::MetadataExt as _;
    let Ok(meta) = std::fs::symlink_metadata(dir) else {
        return Ok(()); // nothing there: nothing to restore
    };
    let me = nix::unistd::geteuid().as_raw();
    if !meta.is_dir() || meta.uid() != me || meta.mode() & 0o022 != 0 {
        return Err(RestoreError::Untrusted {
            dir: dir.to_owned(),
            uid: me,
        });
    }
    Ok(())
}

/// Restores one record file; None where it records nothing outstanding.
fn restore_file(record: &Path, allowed: fn(&Path) -> bool) -> Result<Option<Restored>, Restored> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let failed = |reason: RestoreError| Restored::Failed {
        record: record.to_owned(),
        reason,
    };
    let mut file = File::options()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(record)
        .map_err(|e| failed(RestoreError::Read(e)))?;
    match file.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            return Ok(Some(Restored::Held {
                record: record.to_owned(),
            }));
        }
        Err(std::fs::TryLockError::Error(e)) => return Err(failed(RestoreError::Read(e))),
    }
    let mut text = String::new();
    file.read_to_string(&mut text)
        .map_err(|e| failed(RestoreError::Read(e)))?;
    if text.is_empty() {
        return Ok(None);
    }
    let saved: Saved = serde_json::from_str(&text).map_err(|e| failed(RestoreError::NotJson(e)))?;
    if !allowed(&saved.control) {
        return Err(failed(RestoreError::NotAControl {
            control: saved.control,
        }));
    }
    if saved.original.len() > MAX_VALUE || saved.original.contains('\n') {
        return Err(failed(RestoreError::Value));
    }
    cgroup::write(
        &saved.control,
        &restore_value(&saved.control, &saved.original),
    )
    .map_err(|e| failed(e.into()))?;
    file.set_len(0)
        .map_err(|e| failed(RestoreError::Clear(e)))?;
    Ok(Some(Restored::Put {
        control: saved.control,
        original: saved.original,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_left_behind_is_put_back_with_no_config_and_a_held_one_is_left_alone() {
        let dir = std::env::temp_dir().join(format!("guard-state-{}", std::process::id()));
        let state = dir.join("state");
        std::fs::create_dir_all(&state).expect("dir");
        let control = dir.join("cgroup.freeze");
        std::fs::write(&control, "0").expect("control");
        {
            let mut record = Record::open(&state, &dir, &control).expect("record");
            record.save("0").expect("save");
            std::fs::write(&control, "1").expect("throttle");
            // While a guard holds it, restore leaves it to that guard.
            let restore = |dir: &Path| restore_dir_checked(dir, |_| true);
            assert!(matches!(restore(&state)[..], [Restored::Held { .. }]));
            assert_eq!(std::fs::read_to_string(&control).expect("read"), "1");
            // A crash: the lock goes with the process, the record stays.
        }
        // The real check refuses a file outside a cgroup filesystem.
        assert!(matches!(
            restore_dir(&state)[..],
            [Restored::Failed {
                reason: RestoreError::NotAControl { .. },
                ..
            }]
        ));
        assert_eq!(std::fs::read_to_string(&control).expect("read"), "1");
        let restore = |dir: &Path| restore_dir_checked(dir, |_| true);
        match &restore(&state)[..] {
            [
                Restored::Put {
                    control: put,
                    original,
                },
            ] => {
                assert_eq!((put, original.as_str()), (&control, "0"));
            }
            other => panic!("expected the one value put back, got {other:?}"),
        }
        assert_eq!(std::fs::read_to_string(&control).expect("read"), "0");
        assert!(restore(&state).is_empty(), "nothing is left to restore");
        std::fs::remove_dir_all(&dir).expect("clean up");
    }
}
