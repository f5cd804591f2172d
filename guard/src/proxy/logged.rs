//! Access log lines for the requests that have no owner: those passed through, and those
//! refused before any owner existed (a bad path, framing, a method guard does not pass on, a
//! head hyper could not read).

use std::{borrow::Cow, net::SocketAddr, sync::Arc};

use compact_str::CompactString;

use http::{Method, Response, Uri};
use tokio::time::Instant;

use super::request::{Shared, client_process, identity, method_and_path};
use crate::{
    access::{LaterLine, Record, RequestId, Word},
    reap::{peer::Peer, registry::Connection},
};

/// A line begun when its request arrived; written by `finish`, once. What the arrival tells,
/// not a whole record: it moves with its request's future and answer body.
pub(super) struct Line {
    id: RequestId,
    client: SocketAddr,
    /// The client's process, whose names the line borrows.
    peer: Option<Arc<Peer>>,
    method: Word,
    path: CompactString,
    started: Instant,
    log: LaterLine,
}

impl Line {
    /// A line for this request, where the access log is on.
    pub(super) fn begin(
        shared: &Shared,
        connection: &Arc<Connection>,
        method: &Method,
        uri: &Uri,
    ) -> Option<Self> {
        let log = shared.access.later()?;
        let (method, path) = method_and_path(method, uri);
        Some(Self::new(shared, connection, method, path, log))
    }

    /// A line for a request head hyper could not read: no method or path (both empty).
    pub(super) fn unread(shared: &Shared, connection: &Arc<Connection>) -> Option<Self> {
        let log = shared.access.later()?;
        Some(Self::new(
            shared,
            connection,
            Word::Borrowed(""),
            CompactString::default(),
            log,
        ))
    }

    fn new(
        shared: &Shared,
        connection: &Arc<Connection>,
        method: Word,
        path: CompactString,
        log: LaterLine,
    ) -> Self {
        Self {
            id: crate::access::request_id(),
            client: connection.peer,
            peer: client_process(shared, connection).cloned(),
            method,
            path,
            started: Instant::now(),
            log,
        }
    }

    /// Adds `X-Guard-Request-Id` to the answer.
    pub(super) fn tag<B>(&self, response: &mut Response<B>) {
        crate::access::tag(response, self.id);
    }

    /// Writes the line: the answer's status, how it ended, and the bytes each way.
    pub(super) fn finish(self, end: End) {
        let ended = Instant::now();
        let record = Record {
            time: Some(crate::access::clock::wall(ended.into_std())),
            id: self.id,
            client: Some(self.client),
            identity: identity(self.peer.as_deref(), None),
            method: self.method,
            path: Cow::Borrowed(&self.path),
            status: end.status,
            outcome: end.outcome.into(),
            reason: end.reason.map(Into::into),
            bytes_in: end.bytes_in,
            bytes_out: end.bytes_out,
            duration_ms: crate::access::millis(ended.saturating_duration_since(self.started)),
            ..Record::default()
        };
        self.log.write(&record);
    }
}

/// How an owner-less request ended.
pub(super) struct End {
    pub status: u16,
    /// `passed` for a pass-through answer, `invalid` or `rejected` for a refusal.
    pub outcome: &'static str,
    pub reason: Option<&'static str>,
    pub bytes_in: u64,
    pub bytes_out: u64,
}
