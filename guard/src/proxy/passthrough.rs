//! Requests to endpoints guard does not queue (model lists, pulls, the upstream's own
//! metrics): relayed as they are, at most `upstream.max_passthrough` at once.

use std::{
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicU32, Ordering},
    },
    task::{Context, Poll},
};

use bytes::Bytes;
use http::{Request, Response};
use http_body::{Body as HttpBody, Frame, SizeHint};
use http_body_util::BodyExt as _;

use guard_net::{park::Inbound, workers};

use super::{ErrorShape, ProxyError};
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

/// An answer's body that holds its request's slot until it is dropped.
struct Holding {
    body: Body,
    _slot: Slot,
}

impl HttpBody for Holding {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        Pin::new(&mut self.body).poll_frame(cx)
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

    /// Relays one request, unless `limit` are in flight already (503).
    pub(super) async fn handle(
        &self,
        limit: u32,
        request: Request<Inbound>,
        shape: ErrorShape,
    ) -> Response<Body> {
        let response = match Slot::take(&self.passing, limit) {
            Some(slot) => self
                .relay(request, shape)
                .await
                .map(|body| Holding { body, _slot: slot }.boxed()),
            None => ProxyError::PassthroughFull { limit }.into_response(shape),
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

    async fn relay(&self, request: Request<Inbound>, shape: ErrorShape) -> Response<Body> {
        // A request without a body (GET /api/tags, /v1/models) can be sent again safely.
        let sent = if request.body().is_end_stream() {
            let (head, _) = request.into_parts();
            self.client().send_buffered(&head, Bytes::new()).await
        } else {
            let request = request.map(|body| body.map_err(Into::into).boxed());
            self.client().send(request).await
        };
        match sent {
            Ok(response) => response.map(|body| body.map_err(Into::into).boxed()),
            Err(err) => ProxyError::from(err).into_response(shape),
        }
    }
}
