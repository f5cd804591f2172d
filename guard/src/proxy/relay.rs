//! The response body of a queued request: relays the upstream's frames as they arrive, notes
//! the first byte (TTFT) and the end, and holds the upstream permit until then.

use std::{
    pin::Pin,
    task::{Context, Poll, ready},
};

use bytes::Bytes;
use http_body::{Body as HttpBody, Frame, SizeHint};
use hyper::body::Incoming;

use super::record::{Outcome, RequestRecord};
use crate::queue::Permit;

pub struct RelayBody {
    upstream: Incoming,
    permit: Option<Permit>,
    record: Option<RequestRecord>,
    upstream_failed: bool,
    first_byte_seen: bool,
}

impl RelayBody {
    /// `upstream_failed`: the upstream answered 5xx, so the end is a failure, not a completion.
    pub fn new(
        upstream: Incoming,
        permit: Permit,
        record: RequestRecord,
        upstream_failed: bool,
    ) -> Self {
        Self {
            upstream,
            permit: Some(permit),
            record: Some(record),
            upstream_failed,
            first_byte_seen: false,
        }
    }

    fn finish(&mut self, outcome: Outcome) {
        if let Some(record) = self.record.take() {
            record.finish(outcome);
        }
        if let Some(permit) = self.permit.take() {
            if self.upstream_failed {
                drop(permit);
            } else {
                permit.complete();
            }
        }
    }
}

impl RelayBody {
    fn end_outcome(&self) -> Outcome {
        if self.upstream_failed {
            Outcome::Failed
        } else {
            Outcome::Completed
        }
    }
}

impl Drop for RelayBody {
    fn drop(&mut self) {
        // A body that ended without being polled to None (empty, or known-length) completed;
        // anything else dropped early is left to the record's own drop: reaped.
        if self.record.is_some() && self.upstream.is_end_stream() {
            let outcome = self.end_outcome();
            self.finish(outcome);
        }
    }
}

impl HttpBody for RelayBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let frame = ready!(Pin::new(&mut self.upstream).poll_frame(cx));
        match &frame {
            Some(Ok(frame)) => {
                if !self.first_byte_seen && frame.data_ref().is_some_and(|d| !d.is_empty()) {
                    self.first_byte_seen = true;
                    if let Some(record) = &self.record {
                        record.first_byte();
                    }
                }
                // hyper stops polling once the body says it has ended.
                if self.upstream.is_end_stream() {
                    let outcome = self.end_outcome();
                    self.finish(outcome);
                }
            }
            Some(Err(_)) => self.finish(Outcome::Failed),
            None => {
                let outcome = self.end_outcome();
                self.finish(outcome);
            }
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.upstream.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.upstream.size_hint()
    }
}
