//! Requests to endpoints guard does not queue (model lists, pulls, the upstream's own
//! metrics): relayed as they are, at most `upstream.max_passthrough` at once.

use std::{
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicU32, AtomicU64, Ordering},
    },
    task::{Context, Poll},
};

use bytes::Bytes;
use http::{Request, Response};
use http_body::{Body as HttpBody, Frame, SizeHint};
use http_body_util::BodyExt as _;

use guard_net::{park::Inbound, workers};

use super::{
    ErrorShape, ProxyError,
    logged::{End, Line},
};
use crate::{
    config::UpstreamConfig,
    metrics::{
        Counters, Metrics,
        labels::{ByCode, Code},
    },
    upstream::{Body, BoxError, Client},
};

/// One pass-through request in flight; the count falls when its answer's body is done.
struct Slot(Arc<AtomicU32>);

impl Slot {
    fn take(count: &Arc<AtomicU32>, limit: u32) -> Option<Self> {
        count
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < limit).then_some(n + 1)
            })
            .ok()
            .map(|_| Self(Arc::clone(count)))
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// An answer's body that holds its request's slot until it is dropped, and writes its access
/// log line then (the bytes it carried, how long it took).
struct Holding {
    body: Body,
    _slot: Slot,
    line: Option<Logged>,
}

/// A pass-through request's line, and the bytes that went each way.
struct Logged {
    line: Line,
    status: u16,
    bytes_in: Arc<AtomicU64>,
    bytes_out: u64,
}

impl Drop for Holding {
    fn drop(&mut self) {
        if let Some(logged) = self.line.take() {
            logged.line.finish(End {
                status: logged.status,
                outcome: "passed",
                reason: None,
                bytes_in: logged.bytes_in.load(Ordering::Relaxed),
                bytes_out: logged.bytes_out,
            });
        }
    }
}

impl HttpBody for Holding {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let polled = Pin::new(&mut self.body).poll_frame(cx);
        if let (Poll::Ready(Some(Ok(frame))), Some(logged)) = (&polled, self.line.as_mut()) {
            logged.bytes_out += frame.data_ref().map_or(0, |data| data.len() as u64);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// The pass-through path: its connection pools, and how many of its requests are in flight.
pub(super) struct Passthrough {
    /// A pool per serving thread: a pooled connection is served by the thread that made it,
    /// and one thread's request on another's connection would cross threads at every step.
    clients: Box<[Client]>,
    /// For a request served off the serving threads.
    shared: Client,
    passing: Arc<AtomicU32>,
    answered: Counters<ByCode>,
}

impl Passthrough {
    pub(super) fn new(config: &UpstreamConfig, metrics: &Metrics) -> Self {
        Self {
            clients: (0..workers::per_cpu_count())
                .map(|_| Client::new(config))
                .collect(),
            shared: Client::new(config),
            passing: Arc::default(),
            answered: metrics.passthrough_requests_total.clone(),
        }
    }

    /// Relays one request, unless `limit` are in flight already (503). `line`, where the
    /// access log is on, is written when the answer's body is done.
    pub(super) async fn handle(
        &self,
        limit: u32,
        request: Request<Inbound>,
        shape: ErrorShape,
        line: Option<Line>,
    ) -> Response<Body> {
        let bytes_in = Arc::new(AtomicU64::new(0));
        let response = match Slot::take(&self.passing, limit) {
            Some(slot) => {
                let mut response = self.relay(request, shape, &bytes_in).await;
                if let Some(line) = &line {
                    line.tag(&mut response);
                }
                let status = response.status().as_u16();
                let line = line.map(|line| Logged {
                    line,
                    status,
                    bytes_in,
                    bytes_out: 0,
                });
                response.map(|body| {
                    Holding {
                        body,
                        _slot: slot,
                        line,
                    }
                    .boxed()
                })
            }
            None => {
                let mut response = ProxyError::PassthroughFull { limit }.into_response(shape);
                if let Some(line) = line {
                    line.tag(&mut response);
                    line.finish(End {
                        status: response.status().as_u16(),
                        outcome: "rejected",
                        reason: Some("passthrough_full"),
                        bytes_in: 0,
                        bytes_out: 0,
                    });
                }
                response
            }
        };
        let status = response.status();
        let code = status.as_str();
        self.answered.of(&Code { code }).inc();
        response
    }

    /// The pool of the serving thread this runs on (the shared one elsewhere).
    fn client(&self) -> &Client {
        workers::current()
            .and_then(|index| self.clients.get(index))
            .unwrap_or(&self.shared)
    }

    async fn relay(
        &self,
        request: Request<Inbound>,
        shape: ErrorShape,
        bytes_in: &Arc<AtomicU64>,
    ) -> Response<Body> {
        // A request without a body (GET /api/tags, /v1/models) can be sent again safely.
        let sent = if request.body().is_end_stream() {
            let (head, _) = request.into_parts();
            self.client().send_buffered(&head, Bytes::new()).await
        } else {
            let counted = Arc::clone(bytes_in);
            let request = request.map(|body| {
                body.map_frame(move |frame| {
                    let length = frame.data_ref().map_or(0, |data| data.len() as u64);
                    counted.fetch_add(length, Ordering::Relaxed);
                    frame
                })
                .map_err(Into::into)
                .boxed()
            });
            self.client().send(request).await
        };
        match sent {
            Ok(response) => response.map(|body| body.map_err(Into::into).boxed()),
            Err(err) => ProxyError::from(err).into_response(shape),
        }
    }
}
