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
    #[error("state directory {}: {source}", dir.display())]
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
    #[error("state file {}: {source}", file.display())]
    Io {
        file: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
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
#[derive(Debug, PartialEq, Eq)]
pub enum Restored {
    /// The control file has its original value again.
    Put {
        control: PathBuf,
        original: String,
    },
    /// A running guard holds the record's lock: it restores its own.
    Held {
        record: PathBuf,
    },
    Failed {
        record: PathBuf,
        reason: String,
    },
}

/// Puts back every value recorded in `dir` that no running guard holds, reading no config:
/// what `guard restore` (and `guard run`, first) does after a crash. A missing dir holds
/// nothing.
pub fn restore_dir(dir: &Path) -> Vec<Restored> {
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
        .filter_map(|record| restore_file(&record).transpose())
        .map(|result| result.unwrap_or_else(|failed| failed))
        .collect()
}

/// Restores one record file; None where it records nothing outstanding.
fn restore_file(record: &Path) -> Result<Option<Restored>, Restored> {
    let failed = |reason: String| Restored::Failed {
        record: record.to_owned(),
        reason,
    };
    let mut file = File::options()
        .read(true)
        .write(true)
        .open(record)
        .map_err(|e| failed(e.to_string()))?;
    match file.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            return Ok(Some(Restored::Held {
                record: record.to_owned(),
            }));
        }
        Err(std::fs::TryLockError::Error(e)) => return Err(failed(e.to_string())),
    }
    let mut text = String::new();
    file.read_to_string(&mut text)
        .map_err(|e| failed(e.to_string()))?;
    if text.is_empty() {
        return Ok(None);
    }
    let saved: Saved = serde_json::from_str(&text).map_err(|e| failed(e.to_string()))?;
    cgroup::write(
        &saved.control,
        &restore_value(&saved.control, &saved.original),
    )
    .map_err(|e| failed(e.to_string()))?;
    file.set_len(0).map_err(|e| failed(e.to_string()))?;
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
            assert!(matches!(restore_dir(&state)[..], [Restored::Held { .. }]));
            assert_eq!(std::fs::read_to_string(&control).expect("read"), "1");
            // A crash: the lock goes with the process, the record stays.
        }
        assert_eq!(
            restore_dir(&state),
            [Restored::Put {
                control: control.clone(),
                original: "0".to_owned()
            }]
        );
        assert_eq!(std::fs::read_to_string(&control).expect("read"), "0");
        assert_eq!(restore_dir(&state), [], "nothing is left to restore");
        std::fs::remove_dir_all(&dir).expect("clean up");
    }
}
