//! Talking to inference servers: the pooled HTTP client (pass-through requests, the watchers'
//! polls), one exchange per queued request, and what guard reads of each server's API —
//! request fields, stream frames, status endpoints — in typed form, in one place.

pub mod api;
pub mod asks;
mod client;
pub mod exact;
pub mod exchange;
pub mod frames;
mod headers;
pub mod resume;
pub mod usage;

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full, combinators::BoxBody};

/// Also here: the request path calls it as `upstream::error_chain`.
pub use crate::error_chain::error_chain;
pub use client::{Client, UpstreamError, headers_of};
pub use headers::strip_hop_by_hop;

/// The error of any body guard relays.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Any request or response body guard relays.
pub type Body = BoxBody<Bytes, BoxError>;

/// A complete body from bytes.
pub fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into())
        .map_err(|never| match never {})
        .boxed()
}
