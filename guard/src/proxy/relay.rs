//! The response body of a queued request: relays the upstream's frames as they arrive, notes
//! the first byte (TTFT) and the end, and holds the upstream permit until then.

use std::{
    pin::Pin,
    task::{Context, Poll, ready},
};

use bytes::Bytes;
use http_body::{Body as HttpBody, Frame, SizeHint};
use http_body_util::BodyExt as _;
use hyper::body::Incoming;

use super::record::{Outcome, RequestRecord};
use crate::{metrics::Metrics, queue::Permit, watch::coldload};

/// Watches an Ollama answer's end for a cold load of its model.
pub struct ColdLoadProbe {
    pub model: String,
    pub threshold: std::time::Duration,
    pub metrics: Metrics,
    pub tail: Vec<u8>,
}

impl ColdLoadProbe {
    fn finish(&self) {
        if let Some(load) = coldload::load_duration(&self.tail) {
            let model = self.model.as_str();
            self.metrics
                .model_last_load_seconds
                .with_label_values(&[model])
                .set(load.as_secs_f64());
            if load > self.threshold {
                self.metrics
                    .model_cold_loads_total
                    .with_label_values(&[model])
                    .inc();
                tracing::info!(
                    model,
                    load_ms = load.as_millis() as u64,
                    "cold load: the model was loaded for this request"
                );
            }
        }
    }
}

/// How long a body whose client has gone waits for the upstream's end before it counts as reaped.
const END_GRACE: std::time::Duration = std::time::Duration::from_millis(50);
const UPSTREAM_HELD: &str = "the upstream body is held until drop";

pub struct RelayBody {
    /// Taken only by `drop`, to look for the end after the client has gone.
    upstream: Option<Incoming>,
    permit: Option<Permit>,
    record: Option<RequestRecord>,
    upstream_failed: bool,
    first_byte_seen: bool,
    cold_load: Option<ColdLoadProbe>,
}

impl RelayBody {
    /// `upstream_failed`: the upstream answered 5xx, so the end is a failure, not a completion.
    pub fn new(
        upstream: Incoming,
        permit: Permit,
        record: RequestRecord,
        upstream_failed: bool,
        cold_load: Option<ColdLoadProbe>,
    ) -> Self {
        Self {
            upstream: Some(upstream),
            permit: Some(permit),
            record: Some(record),
            upstream_failed,
            first_byte_seen: false,
            cold_load,
        }
    }

    fn finish(&mut self, outcome: Outcome) {
        if let (Outcome::Completed, Some(probe)) = (&outcome, self.cold_load.take()) {
            probe.finish();
        }
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
        if self.record.is_none() {
            return;
        }
        let Some(mut upstream) = self.upstream.take() else {
            return;
        };
        // A body whose end had already arrived completed, even if hyper stopped polling it
        // (a known length). Anything else dropped early is left to the record: reaped.
        let ended = upstream.is_end_stream() || {
            let mut cx = Context::from_waker(std::task::Waker::noop());
            matches!(
                Pin::new(&mut upstream).poll_frame(&mut cx),
                Poll::Ready(None)
            )
        };
        if ended {
            let outcome = self.end_outcome();
            self.finish(outcome);
            return;
        }
        // An SSE client closes on `data: [DONE]`, a moment before the server's chunked
        // terminator: when the end follows at once with no more data, the client had its whole
        // answer. A client that left mid-answer meets the next data frame (or the grace runs
        // out), and only then is it reaped and the upstream request closed.
        let (Ok(runtime), true) = (tokio::runtime::Handle::try_current(), self.first_byte_seen)
        else {
            return;
        };
        let mut rest = RelayBody {
            upstream: None,
            permit: self.permit.take(),
            record: self.record.take(),
            upstream_failed: self.upstream_failed,
            first_byte_seen: true,
            cold_load: self.cold_load.take(),
        };
        runtime.spawn(async move {
            let next = tokio::time::timeout(END_GRACE, upstream.frame()).await;
            if matches!(next, Ok(None)) {
                let outcome = rest.end_outcome();
                rest.finish(outcome);
            }
            // Otherwise `rest` drops unfinished, without an upstream: reaped.
        });
    }
}

impl HttpBody for RelayBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let frame = ready!(Pin::new(self.upstream.as_mut().expect(UPSTREAM_HELD)).poll_frame(cx));
        match &frame {
            Some(Ok(frame)) => {
                if let (Some(probe), Some(data)) = (self.cold_load.as_mut(), frame.data_ref()) {
                    coldload::keep_tail(&mut probe.tail, data);
                }
                if !self.first_byte_seen && frame.data_ref().is_some_and(|d| !d.is_empty()) {
                    self.first_byte_seen = true;
                    if let Some(record) = &self.record {
                        record.first_byte();
                    }
                }
                // hyper stops polling once the body says it has ended.
                if self.upstream.as_ref().is_some_and(HttpBody::is_end_stream) {
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
        self.upstream.as_ref().is_none_or(HttpBody::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        self.upstream
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), HttpBody::size_hint)
    }
}
