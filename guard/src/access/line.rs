//! A record as its log line: the bytes `serde_json::to_writer` writes for it (a test holds the
//! two equal over generated records), in about a third of its time. serde's generic path
//! escaped every key anew and formatted the time whole, which took 2 % of a pass-through
//! request's CPU; here keys are constants and the time's date and second are kept from the
//! line before.

use std::{borrow::Cow, net::SocketAddr};

use super::{Identity, Record, Tokens, Word};

/// `,"key":` as bytes.
macro_rules! key {
    ($name:literal) => {
        concat!(",\"", $name, "\":").as_bytes()
    };
}

/// Writes lines; keeps the last line's second as text.
#[derive(Default)]
pub(super) struct LineWriter {
    clock: Clock,
}

impl LineWriter {
    /// Appends `record`'s JSON object (no newline) to `out`.
    pub(super) fn write(&mut self, record: &Record<'_>, out: &mut Vec<u8>) {
        out.extend_from_slice(b"{\"time\":");
        match record.time {
            Some(time) => self.clock.write(time, out),
            None => out.extend_from_slice(b"null"),
        }
        out.extend_from_slice(key!("id"));
        out.push(b'"');
        out.extend_from_slice(record.id.as_bytes());
        out.push(b'"');
        match record.who {
            Some(who) if record.identity.token.is_none() => out.extend_from_slice(who),
            _ => who_into(record.client, &record.identity, out),
        }
        optional(key!("class"), record.class.as_deref(), out);
        optional(key!("decided_by"), record.decided_by.as_deref(), out);
        word(key!("method"), &record.method, out);
        text(key!("path"), &record.path, out);
        optional(key!("model"), record.model.as_deref(), out);
        out.extend_from_slice(key!("status"));
        integer(record.status.into(), out);
        word(key!("outcome"), &record.outcome, out);
        if let Some(reason) = &record.reason {
            word(key!("reason"), reason, out);
        }
        if let Some(stage) = &record.stage {
            word(key!("stage"), stage, out);
        }
        optional_float(key!("queue_ms"), record.queue_ms, out);
        optional_float(key!("ttft_ms"), record.ttft_ms, out);
        out.extend_from_slice(key!("duration_ms"));
        float(record.duration_ms, out);
        tokens(&record.tokens, out);
        if record.preemptions != 0 {
            out.extend_from_slice(key!("preemptions"));
            integer(record.preemptions, out);
        }
        out.extend_from_slice(key!("bytes_in"));
        integer(record.bytes_in, out);
        out.extend_from_slice(key!("bytes_out"));
        integer(record.bytes_out, out);
        optional_float(key!("slot_ms"), record.slot_ms, out);
        optional_float(key!("energy_joules"), record.energy_joules, out);
        out.push(b'}');
    }
}

/// `,"client":…` and `,"identity":{…}` as a line writes them, for `Record::who`.
pub fn who(client: Option<SocketAddr>, identity: &Identity<'_>) -> Vec<u8> {
    let mut out = Vec::new();
    who_into(client, identity, &mut out);
    out
}

fn who_into(client: Option<SocketAddr>, identity: &Identity<'_>, out: &mut Vec<u8>) {
    out.extend_from_slice(key!("client"));
    self::client(client, out);
    self::identity(identity, out);
}

fn identity(identity: &Identity<'_>, out: &mut Vec<u8>) {
    if identity.is_empty() {
        return;
    }
    let mut object = Nested::open(key!("identity"), out);
    if let Some(uid) = identity.uid {
        integer(uid.into(), object.key(key!("uid")));
    }
    for (name, value) in [
        (key!("unit"), identity.unit.as_deref()),
        (key!("cgroup"), identity.cgroup.as_deref()),
        (key!("token"), identity.token.as_deref()),
    ] {
        if let Some(value) = value {
            string(value, object.key(name));
        }
    }
    object.close();
}

fn tokens(tokens: &Tokens, out: &mut Vec<u8>) {
    if tokens.is_empty() {
        return;
    }
    let mut object = Nested::open(key!("tokens"), out);
    for (name, value) in [
        (key!("prompt"), tokens.prompt),
        (key!("computed"), tokens.computed),
        (key!("cached"), tokens.cached),
        (key!("generated"), tokens.generated),
    ] {
        if let Some(value) = value {
            integer(value, object.key(name));
        }
    }
    object.close();
}

/// An object inside the line: its first key has no comma before it.
struct Nested<'a> {
    out: &'a mut Vec<u8>,
    first: bool,
}

impl<'a> Nested<'a> {
    fn open(key: &[u8], out: &'a mut Vec<u8>) -> Self {
        out.extend_from_slice(key);
        out.push(b'{');
        Self { out, first: true }
    }

    /// Writes `key` (`,"name":`, its comma left out for the first); the value goes after.
    fn key(&mut self, key: &[u8]) -> &mut Vec<u8> {
        let key = if std::mem::take(&mut self.first) {
            &key[1..]
        } else {
            key
        };
        self.out.extend_from_slice(key);
        self.out
    }

    fn close(self) {
        self.out.push(b'}');
    }
}

fn text(key: &[u8], value: &str, out: &mut Vec<u8>) {
    out.extend_from_slice(key);
    string(value, out);
}

/// A word: one of guard's own literals (a method, an outcome, a reason, a stage), which
/// need no escaping, as it is; any other (an unknown method, quoted; a line read back) as a
/// string.
fn word(key: &[u8], value: &Word, out: &mut Vec<u8>) {
    out.extend_from_slice(key);
    match value {
        Cow::Borrowed(literal) => {
            debug_assert!(plain(literal.as_bytes()), "{literal:?}");
            quoted(literal, out);
        }
        Cow::Owned(text) => string(text, out),
    }
}

fn optional(key: &[u8], value: Option<&str>, out: &mut Vec<u8>) {
    if let Some(value) = value {
        text(key, value, out);
    }
}

fn optional_float(key: &[u8], value: Option<f64>, out: &mut Vec<u8>) {
    if let Some(value) = value {
        out.extend_from_slice(key);
        float(value, out);
    }
}

/// As serde_json writes an f64: its shortest form by the same crate, null where not finite;
/// a whole number of millionths (milliseconds read off nanoseconds) from its digits.
fn float(value: f64, out: &mut Vec<u8>) {
    if let Some(millionths) = millionths(value) {
        integer(millionths / 1_000_000, out);
        match millionths % 1_000_000 {
            0 => out.extend_from_slice(b".0"),
            fraction => decimals::<6>(fraction, out),
        }
    } else if value.is_finite() {
        out.extend_from_slice(zmij::Buffer::new().format_finite(value).as_bytes());
    } else {
        out.extend_from_slice(b"null");
    }
}

/// `.` and the N decimals of `fraction` (below 10^N, not 0), its trailing zeros left out:
/// the digits of 10^N + fraction, their leading `1` left out.
fn decimals<const N: u32>(fraction: u64, out: &mut Vec<u8>) {
    let mut buffer = itoa::Buffer::new();
    let digits = buffer.format(10u64.pow(N) + fraction).as_bytes();
    let digits = digits.get(1..).unwrap_or_default();
    let end = digits
        .iter()
        .rposition(|d| *d != b'0')
        .map_or(0, |at| at + 1);
    out.push(b'.');
    out.extend_from_slice(&digits[..end]);
}

/// `value` as n millionths, where it is exactly the double nearest n / 10^6 (one n at most:
/// below 10^9 a double's step is under 10^-6) and the shortest form writes it as that
/// decimal: with at most 15 significant digits no other decimal as short names the same
/// double (so n's digits are the shortest form), and from 10^-5 up to 10^16 that form is
/// plain, not an exponent (0 is written `0.0`; -0 is left to zmij).
fn millionths(value: f64) -> Option<u64> {
    if !(value.is_sign_positive() && value < 1e9) {
        return None;
    }
    // The nearest n (`round` is a library call on baseline x86-64); checked just below.
    let n = (value * 1e6 + 0.5) as u64;
    (n as f64 / 1e6 == value && (n == 0 || n >= 10)).then_some(n)
}

fn integer(value: u64, out: &mut Vec<u8>) {
    out.extend_from_slice(itoa::Buffer::new().format(value).as_bytes());
}

/// A JSON string: as it is where nothing in it needs escaping (the values guard writes are
/// quoted already), else escaped by serde_json.
fn string(value: &str, out: &mut Vec<u8>) {
    if plain(value.as_bytes()) {
        quoted(value, out);
    } else if serde_json::to_writer(&mut *out, value).is_err() {
        // A write into a Vec does not fail.
        out.extend_from_slice(b"null");
    }
}

/// `value` in quotes, as it is.
fn quoted(value: &str, out: &mut Vec<u8>) {
    out.push(b'"');
    out.extend_from_slice(value.as_bytes());
    out.push(b'"');
}

/// Whether no byte of `bytes` needs escaping in JSON (a control byte, `"` or `\`). Eight
/// bytes a step, the last few padded with spaces: a line's names are mostly under the sixteen
/// a vector loop takes, and byte by byte they cost more than the rest of the line's text.
fn plain(bytes: &[u8]) -> bool {
    let mut chunks = bytes.chunks_exact(8);
    let mut special = 0;
    for chunk in &mut chunks {
        let mut word = [0; 8];
        word.copy_from_slice(chunk);
        special |= special_bytes(u64::from_le_bytes(word));
    }
    let rest = chunks.remainder();
    let last = std::array::from_fn(|at| rest.get(at).copied().unwrap_or(b' '));
    special |= special_bytes(u64::from_le_bytes(last));
    special == 0
}

/// Not zero where one of the eight bytes of `word` is below 0x20, `"` or `\`. (A byte
/// below n, for n up to 0x80, is one whose subtraction of n borrows into its top bit while
/// that bit was clear; equal to c, one that XOR c makes zero: a byte under 1.)
fn special_bytes(word: u64) -> u64 {
    const ONES: u64 = u64::from_le_bytes([1; 8]);
    const TOPS: u64 = ONES << 7;
    let below = |word: u64, n: u8| word.wrapping_sub(ONES * u64::from(n)) & !word & TOPS;
    below(word, 0x20)
        | below(word ^ (ONES * u64::from(b'"')), 1)
        | below(word ^ (ONES * u64::from(b'\\')), 1)
}

/// `"ip:port"` as `SocketAddr`'s Display writes it; an IPv4 one from its numbers, any other
/// (or none) by serde_json.
fn client(client: Option<SocketAddr>, out: &mut Vec<u8>) {
    let Some(SocketAddr::V4(v4)) = client else {
        if serde_json::to_writer(&mut *out, &client).is_err() {
            // A write into a Vec does not fail.
            out.extend_from_slice(b"null");
        }
        return;
    };
    out.push(b'"');
    for (at, octet) in v4.ip().octets().into_iter().enumerate() {
        small(octet, out);
        out.push(if at < 3 { b'.' } else { b':' });
    }
    integer(v4.port().into(), out);
    out.push(b'"');
}

/// A byte's decimal digits, pushed one by one: a call to copy one to three of them cost more
/// than the digits.
fn small(n: u8, out: &mut Vec<u8>) {
    if n >= 100 {
        out.push(b'0' + n / 100);
    }
    if n >= 10 {
        out.push(b'0' + n / 10 % 10);
    }
    out.push(b'0' + n % 10);
}

/// The time as jiff writes it (RFC 3339, UTC, the fraction's trailing zeros left out); its
/// date and second are formatted by jiff once a second and kept.
struct Clock {
    second: i64,
    /// `YYYY-MM-DDTHH:MM:SS`.
    text: [u8; 19],
}

impl Default for Clock {
    fn default() -> Self {
        Self {
            second: i64::MIN,
            text: [0; 19],
        }
    }
}

impl Clock {
    fn write(&mut self, time: jiff::Timestamp, out: &mut Vec<u8>) {
        let nanos = time.subsec_nanosecond();
        if nanos < 0 || !self.keep(time.as_second()) {
            // Before 1970 or beyond year 9999: jiff's Display, whole.
            return string(&time.to_string(), out);
        }
        out.push(b'"');
        out.extend_from_slice(&self.text);
        if nanos > 0 {
            decimals::<9>(nanos.unsigned_abs().into(), out);
        }
        out.extend_from_slice(b"Z\"");
    }

    /// Makes `second`'s text the one kept; false where it is not `YYYY-MM-DDTHH:MM:SSZ`.
    fn keep(&mut self, second: i64) -> bool {
        if second == self.second {
            return true;
        }
        if second < 0 {
            return false;
        }
        let Ok(whole) = jiff::Timestamp::from_second(second) else {
            return false;
        };
        let text = whole.to_string();
        let Some(date_and_second) = text.strip_suffix('Z').filter(|t| t.len() == 19) else {
            return false;
        };
        self.text.copy_from_slice(date_and_second.as_bytes());
        self.second = second;
        true
    }
}

#[cfg(test)]
mod tests;
