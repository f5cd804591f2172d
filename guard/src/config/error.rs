//! Configuration errors: each names the file, the line where it knows it, and the key, then
//! what is wrong with the value (its cause, in the chain `crate::error_chain` prints).

use std::path::{Path, PathBuf};

use super::locate;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{}: cannot read", file.display())]
    Read {
        file: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "{}: the file sets no key (empty, or comments only), as a truncated write leaves it: \
         guard will not run on it (a reload keeps the running config); to run on the built-in \
         defaults give it one table, such as [server]",
        file.display()
    )]
    Empty { file: PathBuf },
    #[error("{}{}: {key}", file.display(), line.map(|l| format!(":{l}")).unwrap_or_default())]
    Invalid {
        file: PathBuf,
        line: Option<usize>,
        key: String,
        #[source]
        problem: Problem,
    },
    /// More than one key is wrong: each of them, in the file's order.
    #[error("{}", several(errors))]
    Several { errors: Vec<ConfigError> },
}

fn several(errors: &[ConfigError]) -> String {
    let each: Vec<String> = errors.iter().map(|e| crate::error_chain(e)).collect();
    format!("{} problems: {}", errors.len(), each.join("; "))
}

/// What is wrong with one key's value.
#[derive(Debug, thiserror::Error)]
pub enum Problem {
    /// guard's own words, or the TOML reader's.
    #[error("{0}")]
    Said(String),
    #[error(transparent)]
    Secret(#[from] crate::secret::SecretError),
    #[error(transparent)]
    Cidr(#[from] CidrError),
    #[error(transparent)]
    Glob(#[from] globset::Error),
    #[error(transparent)]
    Path(#[from] crate::route::PathError),
}

/// A `source` that is neither an address nor a CIDR block.
#[derive(Debug, thiserror::Error)]
#[error("`{text}` is not an address or CIDR block")]
pub struct CidrError {
    pub text: String,
    #[source]
    pub source: std::net::AddrParseError,
}

/// Why `upstream.url` cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum UrlError {
    #[error("`{url}` is not a URL")]
    NotUrl {
        url: String,
        #[source]
        source: http::uri::InvalidUri,
    },
    #[error("`{url}`: only http:// upstreams are supported")]
    NotHttp { url: String },
    #[error("`{url}`: give scheme, host and port only, no path")]
    HasPath { url: String },
    #[error("`{url}` has no host")]
    NoHost { url: String },
    #[error("`{url}` has no port")]
    NoPort { url: String },
}

/// A `throttle` that names no mode.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown throttle mode `{text}`: use \"freeze\" or \"cpu:N\" (N percent of one CPU, 1 or more)"
)]
pub struct ThrottleModeError {
    pub text: String,
}

impl ConfigError {
    /// Each problem on its own: the one, or every one of `Several`.
    pub fn problems(&self) -> Vec<&ConfigError> {
        match self {
            Self::Several { errors } => errors.iter().collect(),
            one => vec![one],
        }
    }

    /// One error for a list of them (none of which is `Several`), sorted by line.
    pub(super) fn all(mut errors: Vec<ConfigError>) -> Self {
        errors.sort_by_key(|e| match e {
            Self::Invalid { line, .. } => line.unwrap_or(usize::MAX),
            _ => usize::MAX,
        });
        match errors.len() {
            1 => errors.remove(0),
            _ => Self::Several { errors },
        }
    }

    /// The key's error: its line from the value's span where the reader gave one, else from
    /// where the key is written, else from where `place` is (what made the key wrong).
    pub(super) fn invalid(
        file: &Path,
        text: &str,
        key: &str,
        span: Option<std::ops::Range<usize>>,
        place: Option<&str>,
        problem: Problem,
    ) -> Self {
        let line = span
            .as_ref()
            .map(|span| locate::line_of_offset(text, span.start))
            .or_else(|| locate::line_of_written_key(text, key))
            .or_else(|| place.and_then(|place| locate::line_of_key(text, place)))
            .or_else(|| locate::line_of_key(text, key));
        Self::Invalid {
            file: file.to_owned(),
            line,
            key: key_named(text, key, span.as_ref()),
            problem,
        }
    }
}

/// The key a reader's error is about. A value TOML itself refuses (too large a number, say)
/// has a span but no path: the key is the one written there.
pub(super) fn key_named(text: &str, key: &str, span: Option<&std::ops::Range<usize>>) -> String {
    match (key.is_empty() || key == ".", span) {
        (false, _) => key.to_owned(),
        (true, Some(span)) => {
            locate::key_at_offset(text, span.start).unwrap_or_else(|| "(top level)".to_owned())
        }
        (true, None) => "(top level)".to_owned(),
    }
}
