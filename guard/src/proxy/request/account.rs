//! What the access log says of a queued request, gathered on its way: its id, what it was, who
//! sent it, what it was sent back and what it used. Written once, when it concludes.

use std::{sync::Arc, time::Duration};

use http::request;

use super::{QueuedRequest, Shared, phases::client_process};
use crate::{
    access::{Identity, Record, RequestId, Tokens, Word},
    proxy::outcome::{Outcome, Stage},
    quote::quote,
    reap::registry::Connection,
};

/// The longest path or cgroup the log keeps (a longer one is cut at a character boundary).
const PATH_BYTES: usize = 256;

/// A request's facts for its access log line, beside what its owner keeps anyway.
#[derive(Debug, Default)]
pub(super) struct Account {
    /// Also sent to the client as `X-Guard-Request-Id`.
    pub(super) id: RequestId,
    method: Word,
    path: String,
    /// The rule, header or default that decided the class.
    pub(super) decided_by: Option<String>,
    /// The rule whose bearer token the request carried (never the token).
    pub(super) token: Option<String>,
    /// The status of the response head the client was sent, once sent.
    pub(super) status: Option<u16>,
    pub(super) bytes_in: u64,
    pub(super) bytes_out: u64,
    /// Time it held an upstream slot, over every segment.
    pub(super) slot: Duration,
    pub(super) energy: Option<f64>,
}

impl Account {
    pub(super) fn new(id: RequestId) -> Self {
        Self {
            id,
            ..Self::default()
        }
    }

    /// What the request is: its method and its path as the upstream decodes it.
    pub(super) fn head(&mut self, head: &request::Parts) {
        (self.method, self.path) = method_and_path(&head.method, &head.uri);
    }

    /// Adds what one hold of a slot used.
    pub(super) fn held(&mut self, held: &super::Used) {
        self.slot += held.time;
        if let Some(joules) = held.joules {
            *self.energy.get_or_insert(0.0) += joules;
        }
    }
}

/// At most `PATH_BYTES`, cut at a character boundary.
fn bounded(path: &str) -> &str {
    let mut end = path.len().min(PATH_BYTES);
    while !path.is_char_boundary(end) {
        end -= 1;
    }
    &path[..end]
}

/// The connection's own copy (no copy a request), unless it is too long to log whole.
fn shared_bounded(name: &Arc<str>) -> Arc<str> {
    match bounded(name) {
        whole if whole.len() == name.len() => Arc::clone(name),
        cut => Arc::from(cut),
    }
}

/// A client that left before any response head was sent (nginx's word for it).
const CLIENT_CLOSED: u16 = 499;

impl QueuedRequest {
    /// The request's access log line, as it concludes: the account's own words move into it
    /// (nothing reads them after), the rest is copied.
    pub(super) fn access_record(
        &mut self,
        outcome: &Outcome,
        stage: Stage,
        ended: tokio::time::Instant,
    ) -> Record {
        let elapsed = ended.saturating_duration_since(self.arrived);
        let (words, reason, ended_at) = outcome.words();
        let usage = self.usage.unwrap_or_default();
        let ms = crate::access::millis;
        let identity = identity(&self.shared, &self.connection, self.account.token.take());
        let model = self.model.as_ref().map(|_| self.model_label());
        let account = &mut self.account;
        Record {
            time: Some(crate::access::clock::wall(ended.into_std())),
            id: account.id,
            client: Some(self.connection.peer),
            identity,
            class: self.class.clone(),
            decided_by: account.decided_by.take(),
            method: std::mem::take(&mut account.method),
            path: std::mem::take(&mut account.path),
            model,
            status: account.status.unwrap_or(CLIENT_CLOSED),
            outcome: words.into(),
            reason: reason.map(Into::into),
            stage: ended_at.map(Into::into),
            queue_ms: (stage != Stage::Arrival).then(|| ms(self.waited.unwrap_or(elapsed))),
            ttft_ms: self.ttft.map(ms),
            duration_ms: ms(elapsed),
            tokens: Tokens {
                prompt: usage.prompt,
                computed: usage.prompt_computed,
                cached: usage.prompt_cached,
                generated: usage.generated,
            },
            preemptions: self.preemptions.pauses.len() as u64,
            bytes_in: account.bytes_in,
            bytes_out: account.bytes_out,
            slot_ms: self.waited.map(|_| ms(account.slot)),
            energy_joules: account.energy,
        }
    }
}

/// Who the client is: its process (the eBPF record, else /proc, looked up once per
/// connection) and the rule its token matched.
pub(in crate::proxy) fn identity(
    shared: &Shared,
    connection: &Connection,
    token: Option<String>,
) -> Identity {
    let Some(peer) = client_process(shared, connection) else {
        return Identity {
            token,
            ..Identity::default()
        };
    };
    Identity {
        uid: peer.uid,
        unit: peer.unit.as_ref().map(shared_bounded),
        cgroup: peer.cgroup.as_ref().map(shared_bounded),
        token,
    }
}

/// A request's method and path as the log says them: quoted, the path as the upstream
/// decodes it and bounded.
pub(in crate::proxy) fn method_and_path(method: &http::Method, uri: &http::Uri) -> (Word, String) {
    let raw = uri.path();
    let path = match crate::route::normalize(raw).unwrap_or_else(|_| raw.into()) {
        std::borrow::Cow::Owned(mut path) => {
            path.truncate(bounded(&path).len());
            path
        }
        std::borrow::Cow::Borrowed(path) => bounded(path).to_owned(),
    };
    (method_word(method), path)
}

/// A method's name: the standard ones borrowed, any other quoted.
fn method_word(method: &http::Method) -> Word {
    use http::Method;
    const NAMES: [&str; 7] = ["GET", "POST", "HEAD", "PUT", "DELETE", "OPTIONS", "PATCH"];
    let known = [
        Method::GET,
        Method::POST,
        Method::HEAD,
        Method::PUT,
        Method::DELETE,
        Method::OPTIONS,
        Method::PATCH,
    ];
    match known.iter().position(|m| m == method) {
        Some(at) => Word::Borrowed(NAMES[at]),
        None => Word::Owned(quote(method.as_str())),
    }
}
