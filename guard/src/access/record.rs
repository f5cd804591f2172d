//! One request as the access log says it: one JSON object a line, written when it concludes.
//! Who sent it, what decided its class, how it ended and what it used; never a prompt, an
//! answer or a token.

use std::{borrow::Cow, fmt, net::SocketAddr, str::FromStr};

use serde::{Deserialize, Serialize};

/// A name or a path: borrowed from the request where guard writes its line (no copy, no
/// count taken on a shared name), owned where a reader reads it back.
pub type Text<'a> = Cow<'a, str>;

/// A word from a fixed set (an outcome, a reason, a stage, a method): borrowed where guard
/// writes it, owned where a reader reads it back.
pub type Word = Text<'static>;

/// One line of the access log (docs/design.md §7a).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Record<'a> {
    /// When the request concluded (RFC 3339, UTC).
    pub time: Option<jiff::Timestamp>,
    /// The request's id, also sent to the client as `X-Guard-Request-Id`.
    pub id: RequestId,
    pub client: Option<SocketAddr>,
    #[serde(default, skip_serializing_if = "Identity::is_empty")]
    pub identity: Identity<'a>,
    /// `client` and `identity` as the line writes them, its token aside, where the request's
    /// connection keeps them rendered (`access::who`): copied, not written anew each request.
    #[serde(skip)]
    pub who: Option<&'a [u8]>,
    /// Absent for a pass-through request, or one refused before it had a class.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub class: Option<Text<'a>>,
    /// What decided the class: a rule's name, `header` or `default`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decided_by: Option<Text<'a>>,
    pub method: Word,
    /// The path as the upstream decodes it (bounded, quoted where it cannot be read).
    pub path: Text<'a>,
    /// Within the metric labels' bounded set (`other` beyond it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<Text<'a>>,
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

/// A request's id: 16 lowercase hex digits, kept as the text they are (spelled once, for
/// its header and its line alike).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RequestId([u8; 16]);

impl RequestId {
    /// Its 16 hex digits.
    pub fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }

    pub fn as_str(&self) -> &str {
        // Hex digits are ASCII.
        std::str::from_utf8(&self.0).unwrap_or_default()
    }
}

impl From<u64> for RequestId {
    /// Its digits, the most significant first: a digit a nibble, no loop over an iterator
    /// of byte pairs (the hex crate's encoder took three times as long, on every request).
    fn from(n: u64) -> Self {
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        Self(std::array::from_fn(|at| {
            DIGITS[(n >> (60 - 4 * at)) as usize & 0xf]
        }))
    }
}

impl Default for RequestId {
    fn default() -> Self {
        Self::from(0)
    }
}

impl fmt::Debug for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("RequestId").field(&self.as_str()).finish()
    }
}

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a request id could not be read.
#[derive(Debug, thiserror::Error)]
#[error("a request id is 16 hex digits")]
pub struct RequestIdError;

impl FromStr for RequestId {
    type Err = RequestIdError;

    /// Any case read; kept lowercase, as guard writes it.
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let digits: [u8; 16] = text.as_bytes().try_into().map_err(|_| RequestIdError)?;
        if !digits.iter().all(u8::is_ascii_hexdigit) {
            return Err(RequestIdError);
        }
        Ok(Self(digits.map(|d| d.to_ascii_lowercase())))
    }
}

impl Serialize for RequestId {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for RequestId {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = Cow::<str>::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// Who the client is, as the kernel and the classifier say: never the token itself.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Identity<'a> {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<u32>,
    /// The last component of its cgroup (a systemd unit or scope).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unit: Option<Text<'a>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cgroup: Option<Text<'a>>,
    /// The name of the rule whose bearer token the request carried.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<Text<'a>>,
}

impl Identity<'_> {
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

#[cfg(test)]
mod tests {
    use super::{Record, RequestId};

    #[test]
    fn a_request_id_is_written_as_16_hex_digits_and_read_back() {
        let every_digit_everywhere =
            (0..16).map(|shift| 0x0123_4567_89ab_cdef_u64.rotate_left(4 * shift));
        let some = [0, 1, 9, 10, 0xdead_beef, u64::MAX, 0x9a9a_9a9a_9a9a_9a9a];
        for n in some.into_iter().chain(every_digit_everywhere) {
            let id = RequestId::from(n);
            assert_eq!(id.to_string(), format!("{n:016x}"));
            let json = serde_json::to_string(&id).expect("serialize");
            assert_eq!(json, format!("\"{n:016x}\""));
            assert_eq!(serde_json::from_str::<RequestId>(&json).expect("read"), id);
            // Read in capitals, it is the same id, written as guard writes it.
            let shouted = format!("{n:016X}").parse::<RequestId>().expect("read");
            assert_eq!(shouted, id);
        }
        for bad in [
            "",
            "123",
            "+123456789abcdef",
            "0123456789abcdeg",
            "00000000000000000",
            "0123456789abcdé",
        ] {
            assert!(bad.parse::<RequestId>().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_client_address_is_written_as_display_writes_it_and_read_back() {
        for client in [
            "0.0.0.0:0",
            "127.0.0.1:11434",
            "255.255.255.255:65535",
            "[::1]:8080",
        ] {
            let record = Record {
                client: Some(client.parse().expect("an address")),
                ..Record::default()
            };
            let json = serde_json::to_value(&record).expect("serialize");
            assert_eq!(json["client"], client);
            let back: Record<'_> = serde_json::from_value(json).expect("read back");
            assert_eq!(back, record);
        }
        let none = serde_json::to_value(Record::default()).expect("serialize");
        assert!(none["client"].is_null());
    }
}
