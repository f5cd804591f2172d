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

use guard_net::park::Inbound;

use super::{ErrorShape, Proxy, ProxyError, Settings};
use crate::upstream::{Body, BoxError};

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

pub(super) async fn handle(
    proxy: &Proxy,
    settings: &Settings,
    request: Request<Inbound>,
    shape: ErrorShape,
) -> Response<Body> {
    let response = match Slot::take(&proxy.passing, settings.max_passthrough) {
        Some(slot) => relay(proxy, request, shape)
            .await
            .map(|body| Holding { body, _slot: slot }.boxed()),
        None => ProxyError::PassthroughFull {
            limit: settings.max_passthrough,
        }
        .into_response(shape),
    };
    proxy
        .queued
        .metrics
        .passthrough_requests_total
        .of(&crate::metrics::labels::Code {
            code: response.status().as_str(),
        })
        .inc();
    response
}

async fn relay(proxy: &Proxy, request: Request<Inbound>, shape: ErrorShape) -> Response<Body> {
    // A request without a body (GET /api/tags, /v1/models) can be sent again safely.
    let sent = if request.body().is_end_stream() {
        let (head, _) = request.into_parts();
        proxy
            .passthrough_client()
            .send_buffered(&head, Bytes::new())
            .await
    } else {
        let request = request.map(|body| body.map_err(Into::into).boxed());
        proxy.passthrough_client().send(request).await
    };
    match sent {
        Ok(response) => response.map(|body| body.map_err(Into::into).boxed()),
        Err(err) => ProxyError::from(err).into_response(shape),
    }
}
