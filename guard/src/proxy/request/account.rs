//! What the access log says of a queued request, gathered on its way: its id, what it was, who
//! sent it, what it was sent back and what it used. Written once, when it concludes.

use std::{borrow::Cow, net::SocketAddr, time::Duration};

use compact_str::CompactString;
use tokio::time::Instant;

use super::{QueuedRequest, phases::client_process};
use crate::{
    access::{Identity, Record, RequestId, Tokens, Word},
    classify::DecidedBy,
    proxy::outcome::{Outcome, Stage},
    quote::quote,
    reap::{peer::Peer, registry::Connection},
};

/// The longest path or cgroup the log keeps (a longer one is cut at a character boundary).
const PATH_BYTES: usize = 256;

/// A request's facts for its access log line, beside what its owner keeps anyway.
#[derive(Debug, Default)]
pub(super) struct Account {
    /// Also sent to the client as `X-Guard-Request-Id`.
    pub(super) id: RequestId,
    method: Word,
    /// Inline up to 24 bytes: most paths take no allocation.
    path: CompactString,
    /// The rule, header or default that decided the class (named by the request's own
    /// settings when the line is written).
    pub(super) decided_by: Option<DecidedBy>,
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

    /// What the request is: its method, and its path as the upstream decodes it (else as
    /// it was sent).
    pub(super) fn head(&mut self, method: &http::Method, path: &str) {
        (self.method, self.path) = logged(method, path);
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

/// A client that left before any response head was sent (nginx's word for it).
const CLIENT_CLOSED: u16 = 499;

impl QueuedRequest {
    /// Writes the request's access log line, as it concludes.
    pub(super) fn write_access_line(&self, outcome: &Outcome, stage: Stage, ended: Instant) {
        self.shared
            .access
            .write(&self.access_record(outcome, stage, ended));
    }

    /// The line's record, its names borrowed from the request.
    fn access_record(&self, outcome: &Outcome, stage: Stage, ended: Instant) -> Record<'_> {
        let elapsed = ended.saturating_duration_since(self.arrived);
        let (words, reason, ended_at) = outcome.words();
        let usage = self.usage.unwrap_or_default();
        let ms = crate::access::millis;
        let account = &self.account;
        client_process(&self.shared, &self.connection);
        let (client, identity, who) = who(&self.connection, account.token.as_deref());
        let classifier = &self.settings.classifier;
        Record {
            time: Some(crate::access::clock::wall(ended.into_std())),
            id: account.id,
            client,
            identity,
            who: Some(who),
            class: self.class.as_deref().map(Cow::Borrowed),
            decided_by: account.decided_by.map(|by| classifier.label(by).into()),
            method: account.method.clone(),
            path: Cow::Borrowed(&account.path),
            model: self.model.as_deref().map(|_| self.model_label().into()),
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

/// Who the client is, as a line says it: its address, its process and the rule its token
/// matched; with them, the connection's rendering of the first two. Called once the process
/// was looked up (on arrival): the rendering is kept for the connection's every line.
pub(in crate::proxy) fn who<'c>(
    connection: &'c Connection,
    token: Option<&'c str>,
) -> (Option<SocketAddr>, Identity<'c>, &'c [u8]) {
    let client = Some(connection.peer);
    let peer = connection.known_process().map(|peer| &**peer);
    let identity = identity(peer, None);
    let rendered = connection.logged_as(|| crate::access::who(client, &identity));
    let identity = Identity {
        token: token.map(Cow::Borrowed),
        ..identity
    };
    (client, identity, rendered)
}

/// Who the client is: its process (the eBPF record, else /proc, looked up once per
/// connection) and the rule its token matched; the process's names borrowed, bounded.
pub(in crate::proxy) fn identity<'a>(
    peer: Option<&'a Peer>,
    token: Option<&'a str>,
) -> Identity<'a> {
    let token = token.map(Cow::Borrowed);
    let Some(peer) = peer else {
        return Identity {
            token,
            ..Identity::default()
        };
    };
    let name = |name: &'a Option<std::sync::Arc<str>>| name.as_deref().map(|n| bounded(n).into());
    Identity {
        uid: peer.uid,
        unit: name(&peer.unit),
        cgroup: name(&peer.cgroup),
        token,
    }
}

/// A request's method and path as the log says them: the method quoted, the path (as the
/// upstream decodes it, else as sent) bounded.
pub(in crate::proxy) fn logged(method: &http::Method, path: &str) -> (Word, CompactString) {
    (method_word(method), CompactString::from(bounded(path)))
}

/// A method's name: the standard ones borrowed, any other quoted.
fn method_word(method: &http::Method) -> Word {
    const NAMES: [&str; 7] = ["GET", "POST", "HEAD", "PUT", "DELETE", "OPTIONS", "PATCH"];
    let name = method.as_str();
    match NAMES.into_iter().find(|known| *known == name) {
        Some(known) => Word::Borrowed(known),
        None => Word::Owned(quote(name)),
    }
}
