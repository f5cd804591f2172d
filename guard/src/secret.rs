//! Bearer tokens, held only as SHA-256 digests and compared in constant time: the config may
//! name a digest or a file instead of the token, and no comparison leaks how much matched.

use std::path::{Path, PathBuf};

use http::{HeaderMap, header};
use sha2::{Digest as _, Sha256};
use subtle::ConstantTimeEq as _;

/// Tokens longer than this are not read from a file (a misnamed file, say).
const MAX_TOKEN_FILE_BYTES: u64 = 4096;

#[derive(Clone, PartialEq, Eq)]
pub struct Secret([u8; 32]);

/// Why a configured secret cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error("not a SHA-256 digest: give 64 hex digits")]
    NotDigest(#[source] hex::FromHexError),
    #[error("cannot read {}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{} is longer than {MAX_TOKEN_FILE_BYTES} bytes: not a token file", path.display())]
    TooLong { path: PathBuf },
    #[error("{} holds no token", path.display())]
    Empty { path: PathBuf },
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

impl Secret {
    /// The secret whose token is `token`.
    pub fn of(token: &str) -> Self {
        Self(Sha256::digest(token.as_bytes()).into())
    }

    /// A secret given as the hex SHA-256 digest of its token (`echo -n TOKEN | sha256sum`).
    pub fn from_hex(digest: &str) -> Result<Self, SecretError> {
        let mut bytes = [0u8; 32];
        hex::decode_to_slice(digest.trim(), &mut bytes).map_err(SecretError::NotDigest)?;
        Ok(Self(bytes))
    }

    /// A secret whose token is the first line of a file (surrounding whitespace dropped).
    pub fn from_file(path: &Path) -> Result<Self, SecretError> {
        use std::io::Read as _;
        let read = |source| SecretError::Read {
            path: path.to_owned(),
            source,
        };
        let file = std::fs::File::open(path).map_err(read)?;
        let mut text = String::new();
        file.take(MAX_TOKEN_FILE_BYTES + 1)
            .read_to_string(&mut text)
            .map_err(read)?;
        if text.len() as u64 > MAX_TOKEN_FILE_BYTES {
            return Err(SecretError::TooLong {
                path: path.to_owned(),
            });
        }
        let token = text.lines().next().unwrap_or_default().trim();
        if token.is_empty() {
            return Err(SecretError::Empty {
                path: path.to_owned(),
            });
        }
        Ok(Self::of(token))
    }

    /// Whether `presented` is the token, in time that does not depend on how much matches.
    pub fn matches(&self, presented: &str) -> bool {
        Self::of(presented).0.ct_eq(&self.0).into()
    }

    /// Whether the request's `Authorization: Bearer TOKEN` carries the token (never an empty
    /// one).
    pub fn authorizes(&self, headers: &HeaderMap) -> bool {
        bearer(headers).is_some_and(|token| !token.is_empty() && self.matches(token))
    }
}

/// The token of an `Authorization: Bearer TOKEN` header (the scheme in any case).
pub fn bearer(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_matches_by_value_by_digest_and_by_file() {
        let secret = Secret::of("nightly");
        assert!(secret.matches("nightly"));
        assert!(!secret.matches("nightl") && !secret.matches("nightly ") && !secret.matches(""));
        let digest = hex::encode(Sha256::digest(b"nightly"));
        assert_eq!(Secret::from_hex(&digest).expect("a digest"), secret);
        assert!(matches!(
            Secret::from_hex("abc"),
            Err(SecretError::NotDigest(_))
        ));
        let dir = std::env::temp_dir().join(format!("guard-secret-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let file = dir.join("token");
        std::fs::write(&file, "nightly\n").expect("write");
        assert_eq!(Secret::from_file(&file).expect("a token file"), secret);
        std::fs::write(&file, "\n").expect("write");
        assert!(matches!(
            Secret::from_file(&file),
            Err(SecretError::Empty { .. })
        ));
        let missing = dir.join("missing");
        let err = Secret::from_file(&missing).expect_err("no such file");
        assert_eq!(
            crate::error_chain(&err),
            format!(
                "cannot read {}: no such file or directory",
                missing.display()
            )
        );
        std::fs::remove_dir_all(&dir).expect("clean up");
        assert_eq!(format!("{secret:?}"), "Secret(..)");
    }

    #[test]
    fn the_bearer_scheme_is_read_in_any_case() {
        let mut headers = HeaderMap::new();
        headers.insert(header::AUTHORIZATION, "bearer nightly".parse().expect("v"));
        assert!(Secret::of("nightly").authorizes(&headers));
        headers.insert(header::AUTHORIZATION, "Basic nightly".parse().expect("v"));
        assert!(!Secret::of("nightly").authorizes(&headers));
    }
}
