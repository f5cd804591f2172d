//! Crash-safe throttling: before guard changes a cgroup control file it records the original
//! value in a state file of its own, locked for as long as guard runs. A later start finds a
//! record left by a crash and restores it. The lock also keeps two guards off one cgroup.

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
}

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
        let path = dir.join(format!("{name}.orig"));
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
        let mut record = Self { file, path };
        if let Some(original) = record.saved()? {
            cgroup::write(control, &original)?;
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
        Ok((!text.is_empty()).then(|| text.trim_end_matches('\n').to_owned()))
    }

    /// Records `original` durably, before the control file is changed.
    pub fn save(&mut self, original: &str) -> Result<(), StateError> {
        let io = |source| StateError::Io {
            file: self.path.clone(),
            source,
        };
        self.file.set_len(0).map_err(io)?;
        self.file.rewind().map_err(io)?;
        self.file.write_all(original.as_bytes()).map_err(io)?;
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
