//! Access log lines for the requests that have no owner: those passed through, and those
//! refused before any owner existed (a bad path, framing, a method guard does not pass on, a
//! head hyper could not read).

use std::{borrow::Cow, sync::Arc};

use compact_str::CompactString;

use http::{Method, Response};
use tokio::time::Instant;

use super::request::{Shared, client_process, logged, who};
use crate::{
    access::{LaterLine, Record, RequestId, Word},
    reap::registry::Connection,
};

/// A line begun when its request arrived; written by `finish`, once. What the arrival tells,
/// not a whole record: it moves with its request's future and answer body.
pub(super) struct Line {
    id: RequestId,
    /// The client's, whose address, process and their rendering the line borrows.
    connection: Arc<Connection>,
    method: Word,
    path: CompactString,
    started: Instant,
    log: LaterLine,
}

impl Line {
    /// A line for this request, where the access log is on: `path` as the upstream decodes
    /// it (else as sent).
    pub(super) fn begin(
        shared: &Shared,
        connection: &Arc<Connection>,
        method: &Method,
        path: &str,
    ) -> Option<Self> {
        let log = shared.access.later()?;
        let (method, path) = logged(method, path);
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
        // Looked up on arrival, while the client's process surely still exists.
        client_process(shared, connection);
        Self {
            id: crate::access::request_id(),
            connection: Arc::clone(connection),
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
        let (client, identity, who) = who(&self.connection, None);
        let record = Record {
            time: Some(crate::access::clock::wall(ended.into_std())),
            id: self.id,
            client,
            identity,
            who: Some(who),
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
