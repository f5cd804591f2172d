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

pub struct RelayBody {
    upstream: Incoming,
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
            upstream,
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
        // A body whose end had already arrived completed, even if hyper stopped polling it
        // (a known length) or the client left right after the last data (an SSE client that
        // closes after [DONE]). Anything else dropped early is left to the record: reaped.
        let ended = self.upstream.is_end_stream() || {
            let mut cx = Context::from_waker(std::task::Waker::noop());
            matches!(
                Pin::new(&mut self.upstream).poll_frame(&mut cx),
                Poll::Ready(None)
            )
        };
        if ended {
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
