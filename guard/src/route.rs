//! Which requests are generation work, decided on the path as the upstream's router reads it:
//! Ollama (Go) and llama-server (cpp-httplib) route on the percent-decoded path, `%2F`
//! included, so `/api/%67enerate` is `/api/generate` to them. guard decodes the same way,
//! then removes dot segments (RFC 3986 §5.2.4) and empty segments, so that every spelling a
//! router might take for a generation endpoint is queued: erring that way only queues a request
//! the upstream will refuse. The request is forwarded with its original bytes.

use std::borrow::Cow;
use std::collections::BTreeSet;

/// Every generation endpoint of Ollama, OpenAI-style servers and llama-server (docs/design.md §6).
pub const DEFAULT_QUEUED: &[&str] = &[
    "/api/generate",
    "/api/chat",
    "/api/embed",
    "/api/embeddings",
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/messages",
    "/v1/rerank",
    "/completion",
    "/completions",
    "/chat/completions",
    "/infill",
    "/rerank",
    "/embedding",
    "/embeddings",
];

/// The path cannot be read as the upstream would: an escape that is not `%` and two hex
/// digits, or bytes that are not UTF-8 once decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the request path cannot be decoded: {reason}")]
pub struct PathError {
    pub reason: &'static str,
}

/// The paths whose POSTs wait in the class queues.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueuedPaths(BTreeSet<String>);

impl QueuedPaths {
    /// From the config's list (already checked to be absolute paths), normalized as requests
    /// are.
    pub fn new<'a>(paths: impl IntoIterator<Item = &'a str>) -> Self {
        Self(
            paths
                .into_iter()
                .filter_map(|p| normalize(p).ok().map(Cow::into_owned))
                .collect(),
        )
    }

    /// Whether a request for `raw` (its path as sent) is generation work.
    pub fn contains(&self, raw: &str) -> Result<bool, PathError> {
        Ok(self.contains_normalized(&normalize(raw)?))
    }

    /// Whether a request for `path`, as `normalize` made it, is generation work.
    pub fn contains_normalized(&self, path: &str) -> bool {
        self.0.contains(path)
    }
}

/// Whether `raw` is already what `normalize` would make of it (no escape, no empty or dot
/// segment, no trailing `/`): the common case, read without allocating.
fn is_normal(raw: &str) -> bool {
    raw == "/"
        || raw.strip_prefix('/').is_some_and(|rest| {
            !raw.contains('%') && rest.split('/').all(|s| !matches!(s, "" | "." | ".."))
        })
}

/// The path a router sees: percent-decoded, dot segments and empty segments removed, with a
/// leading `/` and no trailing one. A path already so (the common case) is borrowed as it is.
pub fn normalize(raw: &str) -> Result<Cow<'_, str>, PathError> {
    if is_normal(raw) {
        return Ok(Cow::Borrowed(raw));
    }
    let decoded = decode(raw)?;
    let mut segments: Vec<&str> = Vec::new();
    for segment in decoded.split('/') {
        match segment {
            "" | "." => {}
            ".." => {
                segments.pop();
            }
            other => segments.push(other),
        }
    }
    Ok(Cow::Owned(format!("/{}", segments.join("/"))))
}

/// Percent-decodes every escape, refusing malformed ones and non-UTF-8 results.
fn decode(raw: &str) -> Result<String, PathError> {
    let bytes = raw.as_bytes();
    let malformed = bytes.iter().enumerate().any(|(at, byte)| {
        *byte == b'%'
            && !bytes
                .get(at + 1..at + 3)
                .is_some_and(|hex| hex.iter().all(u8::is_ascii_hexdigit))
    });
    if malformed {
        return Err(PathError {
            reason: "a `%` not followed by two hex digits",
        });
    }
    percent_encoding::percent_decode_str(raw)
        .decode_utf8()
        .map(std::borrow::Cow::into_owned)
        .map_err(|_| PathError {
            reason: "it is not UTF-8 once decoded",
        })
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_path_read_as_normal_is_what_normalize_makes_of_it() {
        for raw in [
            "/",
            "/api/chat",
            "/api/chat/",
            "//api",
            "/api/./chat",
            "/api/../x",
            "/a%2Fb",
            "api/chat",
            "",
            "/v1/chat/completions",
            "/a/b/c",
            "/.",
            "/..",
            "/a.b/c..d",
        ] {
            if is_normal(raw) {
                assert_eq!(normalize(raw).as_deref(), Ok(raw), "{raw}");
            }
        }
        assert!(is_normal("/api/chat") && is_normal("/a.b/c..d"));
        assert!(!is_normal("/api/chat/") && !is_normal("/api//chat") && !is_normal("/a%2Fb"));
    }

    use super::*;

    fn queued(raw: &str) -> bool {
        QueuedPaths::new(DEFAULT_QUEUED.iter().copied())
            .contains(raw)
            .expect("decodes")
    }

    #[test]
    fn every_spelling_of_a_generation_path_is_queued() {
        for raw in [
            "/api/generate",
            "/api/%67enerate",
            "/%61%70%69/generate",
            "/api%2Fgenerate",
            "/api%2fgenerate",
            "//api///generate/",
            "/api/./generate",
            "/v1/x/../chat/completions",
            "/v1/%2e%2e/completion",
            "/%63ompletion",
            "/completions",
            "/chat/completions",
            "/v1/responses",
            "/v1/messages",
        ] {
            assert!(queued(raw), "{raw}");
        }
    }

    #[test]
    fn other_paths_pass_through() {
        for raw in [
            "/api/tags",
            "/v1/models",
            "/health",
            "/api/generatex",
            "/API/GENERATE",
            "/",
        ] {
            assert!(!queued(raw), "{raw}");
        }
    }

    #[test]
    fn an_undecodable_path_is_an_error() {
        let paths = QueuedPaths::new(DEFAULT_QUEUED.iter().copied());
        assert!(paths.contains("/api/gen%zzerate").is_err());
        assert!(paths.contains("/api/generate%").is_err());
        assert!(paths.contains("/api/%ff%fe").is_err(), "not UTF-8");
    }

    #[test]
    fn dot_segments_never_climb_above_the_root() {
        assert_eq!(normalize("/../../api/chat").as_deref(), Ok("/api/chat"));
        assert_eq!(normalize("").as_deref(), Ok("/"));
    }
}
