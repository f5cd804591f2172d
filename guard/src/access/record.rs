//! One request as the access log says it: one JSON object a line, written when it concludes.
//! Who sent it, what decided its class, how it ended and what it used; never a prompt, an
//! answer or a token.

use std::{borrow::Cow, net::SocketAddr};

use serde::{Deserialize, Serialize};

/// A word from a fixed set (an outcome, a reason, a stage, a method): borrowed where guard
/// writes it, owned where a reader reads it back.
pub type Word = Cow<'static, str>;

/// One line of the access log (docs/design.md §7a).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Record {
    /// When the request concluded (RFC 3339, UTC).
    pub time: Option<jiff::Timestamp>,
    /// The request's id, also sent to the client as `X-Guard-Request-Id`.
    pub id: String,
    pub client: Option<SocketAddr>,
    #[serde(default, skip_serializing_if = "Identity::is_empty")]
    pub identity: Identity,
    /// Absent for a pass-through request, or one refused before it had a class.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub class: Option<String>,
    /// What decided the class: a rule's name, `header` or `default`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decided_by: Option<String>,
    pub method: Word,
    /// The path as the upstream decodes it (bounded, quoted where it cannot be read).
    pub path: String,
    /// Within the metric labels' bounded set (`other` beyond it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    pub status: u16,
    /// completed | rejected | reaped | failed | timed_out | invalid | refused | passed
    pub outcome: Word,
    /// Why it was rejected, failed, timed out or invalid (a metric label value).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<Word>,
    /// Where it was when it ended: arrival | queued | running.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stage: Option<Word>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_ms: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttft_ms: Option<f64>,
    pub duration_ms: f64,
    #[serde(default, skip_serializing_if = "Tokens::is_empty")]
    pub tokens: Tokens,
    /// Times it was stopped for a more urgent request.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub preemptions: u64,
    /// Body bytes from the client, and to it.
    pub bytes_in: u64,
    pub bytes_out: u64,
    /// Milliseconds it held an upstream slot (over every segment).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slot_ms: Option<f64>,
    /// Its share of the energy the box measured while it held its slot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub energy_joules: Option<f64>,
}

/// Who the client is, as the kernel and the classifier say: never the token itself.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Identity {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<u32>,
    /// The last component of its cgroup (a systemd unit or scope).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unit: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cgroup: Option<String>,
    /// The name of the rule whose bearer token the request carried.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
}

impl Identity {
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }
}

/// What the server said the request read and generated.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tokens {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt: Option<u64>,
    /// Of the prompt, read anew and taken from the server's cache.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub computed: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cached: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generated: Option<u64>,
}

impl Tokens {
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}
