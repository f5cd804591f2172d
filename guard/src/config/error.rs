//! Configuration errors: each names the file, the line where it knows it, and the key.

use std::path::{Path, PathBuf};

use super::locate;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{}: cannot read: {source}", file.display())]
    Read {
        file: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: the file sets no key; a reload keeps the running config (a truncated write?)", file.display())]
    Empty { file: PathBuf },
    #[error("{}{}: {key}: {message}", file.display(), line.map(|l| format!(":{l}")).unwrap_or_default())]
    Invalid {
        file: PathBuf,
        line: Option<usize>,
        key: String,
        message: String,
    },
}

impl ConfigError {
    pub(super) fn invalid(
        file: &Path,
        text: &str,
        key: &str,
        span: Option<std::ops::Range<usize>>,
        message: String,
    ) -> Self {
        let line = span
            .as_ref()
            .map(|span| locate::line_of_offset(text, span.start))
            .or_else(|| locate::line_of_key(text, key));
        // A value TOML itself refuses (too large a number, say) has a span but no path: the
        // key is the one written on that line.
        let key = match (key.is_empty() || key == ".", &span) {
            (false, _) => key.to_owned(),
            (true, Some(span)) => {
                locate::key_at_offset(text, span.start).unwrap_or_else(|| "(top level)".to_owned())
            }
            (true, None) => "(top level)".to_owned(),
        };
        Self::Invalid {
            file: file.to_owned(),
            line,
            key,
            message,
        }
    }
}
