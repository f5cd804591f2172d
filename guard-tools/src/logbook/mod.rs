//! The benchmark logbook (docs/design.md §9): `guard bench` records a baseline run as one JSON
//! line; `guard logbook` lists entries, flags due retests, compares two, and writes a report.

mod axis;
mod chart;
pub mod compare;
pub mod entry;
pub mod figures;
mod page;
pub mod report;
pub mod run;

use std::{
    io::{BufRead as _, Write as _},
    path::{Path, PathBuf},
};

pub use entry::Entry;

/// Where the logbook lives unless `--logbook` says otherwise.
pub const DEFAULT_PATH: &str = "/var/lib/guard/logbook.jsonl";

#[derive(Debug, thiserror::Error)]
pub enum LogbookError {
    #[error("logbook {}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("logbook {}:{line}: not an entry", path.display())]
    Parse {
        path: PathBuf,
        line: usize,
        source: serde_json::Error,
    },
    #[error("no entry `{0}` in the logbook (see `guard logbook list`)")]
    NoEntry(String),
    #[error("input set {}:{line}: {reason}", path.display())]
    Input {
        path: PathBuf,
        line: usize,
        reason: String,
    },
    #[error("request to {path} failed")]
    Request {
        path: String,
        #[source]
        source: guard::upstream::BoxError,
    },
    #[error("{path} answered {status}: {said}")]
    Answer {
        path: String,
        status: http::StatusCode,
        said: String,
    },
    #[error("the restart command failed: {command}")]
    Restart { command: String },
    #[error("the server did not come back within {waited:?} of the restart command")]
    NotBack { waited: std::time::Duration },
    #[error("an entry cannot be written")]
    Encode(#[source] serde_json::Error),
    #[error("the comparison cannot be written as csv")]
    Csv(#[source] csv::Error),
}

impl LogbookError {
    /// A request to `path` that failed on the way.
    fn request(path: &str, source: impl Into<guard::upstream::BoxError>) -> Self {
        Self::Request {
            path: path.to_owned(),
            source: source.into(),
        }
    }
}

/// Every entry, in the order recorded.
pub fn read(path: &Path) -> Result<Vec<Entry>, LogbookError> {
    let file = match std::fs::File::open(path) {
        Ok(file) => file,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => {
            return Err(LogbookError::Io {
                path: path.to_owned(),
                source,
            });
        }
    };
    std::io::BufReader::new(file)
        .lines()
        .enumerate()
        .filter(|(_, line)| line.as_ref().map_or(true, |l| !l.trim().is_empty()))
        .map(|(index, line)| {
            let line_text = line.map_err(|source| LogbookError::Io {
                path: path.to_owned(),
                source,
            })?;
            serde_json::from_str(&line_text).map_err(|source| LogbookError::Parse {
                path: path.to_owned(),
                line: index + 1,
                source,
            })
        })
        .collect()
}

/// Appends one entry as one line.
pub fn append(path: &Path, entry: &Entry) -> Result<(), LogbookError> {
    let io = |source| LogbookError::Io {
        path: path.to_owned(),
        source,
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(io)?;
    }
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(io)?;
    let line = serde_json::to_string(entry).map_err(LogbookError::Encode)?;
    writeln!(file, "{line}").map_err(io)
}

/// The entry with this id (or unique id prefix).
pub fn find<'a>(entries: &'a [Entry], id: &str) -> Result<&'a Entry, LogbookError> {
    let matches: Vec<&Entry> = entries.iter().filter(|e| e.id.starts_with(id)).collect();
    match matches.as_slice() {
        [one] => Ok(one),
        _ => Err(LogbookError::NoEntry(id.to_owned())),
    }
}

/// `guard logbook list`: one line per entry, due retests marked.
pub fn list(entries: &[Entry], today: jiff::civil::Date) -> String {
    let mut out = format!(
        "{:<10} {:<20} {:<22} {:<12} {:>9} {:>9} {:<10} {:<12} {}\n",
        "id", "recorded", "model", "runtime", "ttft p95", "done p95", "owner", "retest", "decision"
    );
    for e in entries {
        let due = if e.is_due(today) { " DUE" } else { "" };
        out.push_str(&format!(
            "{:<10} {:<20} {:<22} {:<12} {:>7.0}ms {:>7.0}ms {:<10} {:<12} {}{due}\n",
            e.short_id(),
            e.recorded_at.strftime("%Y-%m-%dT%H:%M:%S").to_string(),
            truncate(&e.model, 22),
            truncate(&e.runtime, 12),
            e.ttft_ms.p95,
            e.completion_ms.p95,
            truncate(&e.owner, 10),
            e.retest_date,
            e.decision
        ));
    }
    out
}

/// Entries whose retest date is today or earlier.
pub fn due(entries: &[Entry], today: jiff::civil::Date) -> Vec<&Entry> {
    entries.iter().filter(|e| e.is_due(today)).collect()
}

fn truncate(text: &str, width: usize) -> String {
    text.chars().take(width).collect()
}

/// Today (UTC).
pub fn today() -> jiff::civil::Date {
    date_after(jiff::Timestamp::now(), 0)
}

/// The date `days` after `from` (UTC).
pub fn date_after(from: jiff::Timestamp, days: u16) -> jiff::civil::Date {
    use jiff::ToSpan;
    from.to_zoned(jiff::tz::TimeZone::UTC)
        .date()
        .saturating_add(i64::from(days).days())
}
