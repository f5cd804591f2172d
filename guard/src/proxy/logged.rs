//! Access log lines for the requests that have no owner: those passed through, and those
//! refused before any owner existed (a bad path, framing, a method guard does not pass on).

use std::sync::Arc;

use http::{Method, Response, Uri};
use tokio::time::Instant;

use super::request::{Shared, identity, method_and_path};
use crate::{
    access::{AccessLog, Record},
    reap::registry::Connection,
};

/// A line begun when its request arrived; written by `finish`, once.
pub(super) struct Line {
    record: Record,
    started: Instant,
    access: AccessLog,
}

impl Line {
    /// A line for this request, where the access log is on.
    pub(super) fn begin(
        shared: &Shared,
        connection: &Arc<Connection>,
        method: &Method,
        uri: &Uri,
    ) -> Option<Self> {
        if !shared.access.is_on() {
            return None;
        }
        let (method, path) = method_and_path(method, uri);
        let record = Record {
            id: crate::access::request_id(),
            client: Some(connection.peer),
            identity: identity(shared, connection, None),
            method,
            path,
            ..Record::default()
        };
        Some(Self {
            record,
            started: Instant::now(),
            access: shared.access.clone(),
        })
    }

    /// Adds `X-Guard-Request-Id` to the answer.
    pub(super) fn tag<B>(&self, response: &mut Response<B>) {
        crate::access::tag(response, self.record.id);
    }

    /// Writes the line: the answer's status, how it ended, and the bytes each way.
    pub(super) fn finish(self, end: End) {
        let Self {
            mut record,
            started,
            access,
        } = self;
        record.time = Some(jiff::Timestamp::now());
        record.status = end.status;
        record.outcome = end.outcome.into();
        record.reason = end.reason.map(Into::into);
        record.bytes_in = end.bytes_in;
        record.bytes_out = end.bytes_out;
        record.duration_ms = crate::access::millis(started.elapsed());
        access.write(record);
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
