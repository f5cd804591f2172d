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
    #[error("{}: the file sets no key; a reload keeps the running config (a truncated write?)", file.display())]
    Empty { file: PathBuf },
    #[error("{}{}: {key}", file.display(), line.map(|l| format!(":{l}")).unwrap_or_default())]
    Invalid {
        file: PathBuf,
        line: Option<usize>,
        key: String,
        #[source]
        problem: Problem,
    },
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
    pub(super) fn invalid(
        file: &Path,
        text: &str,
        key: &str,
        span: Option<std::ops::Range<usize>>,
        problem: Problem,
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
            problem,
        }
    }
}
