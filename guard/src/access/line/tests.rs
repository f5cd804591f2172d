use std::{borrow::Cow, net::SocketAddr};

use proptest::prelude::*;

use super::LineWriter;
use crate::access::{Identity, Record, RequestId, Tokens};

/// Text as the log's fields hold it, and worse: quotes, backslashes, control bytes, any
/// character.
fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-z/._-]{0,12}",
        any::<String>(),
        "[\"\\\\\u{0}-\u{1f}\u{7f}é]{0,6}",
    ]
}

fn float() -> impl Strategy<Value = f64> {
    prop_oneof![
        (0u64..10_000_000_000_000).prop_map(|nanos| nanos as f64 / 1e6),
        any::<f64>(),
        Just(f64::NAN),
        Just(f64::INFINITY),
        Just(0.0),
        Just(-0.0),
    ]
}

fn time() -> impl Strategy<Value = jiff::Timestamp> {
    let (min, max) = (jiff::Timestamp::MIN, jiff::Timestamp::MAX);
    prop_oneof![
        // Now, give or take a year, with fractions of every length.
        (1_750_000_000i64..1_800_000_000, 0i32..1_000_000_000),
        (min.as_second()..=max.as_second(), 0i32..1_000_000_000),
        (-10i64..10, 0i32..1_000_000_000),
    ]
    .prop_map(move |(second, nanos)| {
        jiff::Timestamp::new(second, nanos)
            .or_else(|_| jiff::Timestamp::new(second, 0))
            .unwrap_or(min)
    })
}

fn identity() -> impl Strategy<Value = Identity<'static>> {
    let name = || proptest::option::of(text());
    (proptest::option::of(any::<u32>()), name(), name(), name()).prop_map(
        |(uid, unit, cgroup, token)| Identity {
            uid,
            unit: unit.map(Cow::Owned),
            cgroup: cgroup.map(Cow::Owned),
            token: token.map(Cow::Owned),
        },
    )
}

fn tokens() -> impl Strategy<Value = Tokens> {
    let count = || proptest::option::of(any::<u64>());
    (count(), count(), count(), count()).prop_map(|(prompt, computed, cached, generated)| Tokens {
        prompt,
        computed,
        cached,
        generated,
    })
}

fn record() -> impl Strategy<Value = Record<'static>> {
    let word = || text().prop_map(Cow::Owned);
    let some_text = || proptest::option::of(text());
    let some_float = || proptest::option::of(float());
    (
        (
            proptest::option::of(time()),
            any::<u64>(),
            proptest::option::of(any::<SocketAddr>()),
            identity(),
            some_text(),
            some_text(),
            word(),
            text(),
        ),
        (
            some_text(),
            any::<u16>(),
            word(),
            proptest::option::of(word()),
            proptest::option::of(word()),
            some_float(),
            some_float(),
            float(),
        ),
        (
            tokens(),
            prop_oneof![Just(0u64), any::<u64>()],
            any::<u64>(),
            any::<u64>(),
            some_float(),
            some_float(),
        ),
    )
        .prop_map(|(head, middle, tail)| {
            let (time, id, client, identity, class, decided_by, method, path) = head;
            let (model, status, outcome, reason, stage, queue_ms, ttft_ms, duration_ms) = middle;
            let (tokens, preemptions, bytes_in, bytes_out, slot_ms, energy_joules) = tail;
            Record {
                time,
                id: RequestId::from(id),
                client,
                identity,
                who: None,
                class: class.map(Cow::Owned),
                decided_by: decided_by.map(Cow::Owned),
                method,
                path: path.into(),
                model: model.map(Cow::Owned),
                status,
                outcome,
                reason,
                stage,
                queue_ms,
                ttft_ms,
                duration_ms,
                tokens,
                preemptions,
                bytes_in,
                bytes_out,
                slot_ms,
                energy_joules,
            }
        })
}

fn serde_line(record: &Record<'_>) -> String {
    serde_json::to_string(record).expect("serialize")
}

fn our_line(writer: &mut LineWriter, record: &Record<'_>) -> String {
    let mut out = Vec::new();
    writer.write(record, &mut out);
    String::from_utf8(out).expect("utf-8")
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 4096,
        rng_seed: proptest::test_runner::RngSeed::Fixed(0x10c),
        ..ProptestConfig::default()
    })]

    /// One writer for every case, as the log keeps one: the second it keeps from a line never
    /// shows in another.
    #[test]
    fn a_line_is_the_bytes_serde_json_writes(records in proptest::collection::vec(record(), 1..4)) {
        thread_local! {
            static WRITER: std::cell::RefCell<LineWriter> = std::cell::RefCell::default();
        }
        for record in &records {
            let ours = WRITER.with_borrow_mut(|writer| our_line(writer, record));
            prop_assert_eq!(&ours, &serde_line(record));
            // With the client rendered once for its connection (its token aside): the same
            // bytes, token or none.
            let connection = Identity { token: None, ..record.identity.clone() };
            let rendered = super::who(record.client, &connection);
            let with_who = Record { who: Some(&rendered), ..record.clone() };
            let ours = WRITER.with_borrow_mut(|writer| our_line(writer, &with_who));
            prop_assert_eq!(ours, serde_line(record));
        }
    }
}

#[test]
fn lines_within_one_second_keep_its_text_and_differ_in_the_fraction() {
    let mut writer = LineWriter::default();
    for nanos in [
        0,
        1,
        10,
        100_000_000,
        123_456_789,
        999_999_999,
        500_000_000,
        0,
    ] {
        let record = Record {
            time: Some(jiff::Timestamp::new(1_765_000_000, nanos).expect("a time")),
            ..Record::default()
        };
        assert_eq!(our_line(&mut writer, &record), serde_line(&record));
    }
}

/// Milliseconds read off nanoseconds take the digits' own path: at the edges of its range
/// (where the shortest form turns to an exponent, or would need 16 digits) and a step either
/// side of each figure, what it writes is what serde_json writes.
#[test]
fn millisecond_figures_at_the_edges_of_the_digit_path_are_what_serde_json_writes() {
    let nanos: [u64; 14] = [
        0,
        1,
        9,
        10,
        11,
        99,
        999_999,
        1_000_000,
        1_000_001,
        418_554,
        123_456_789,
        999_999_999_999_999,
        1_000_000_000_000_000,
        9_007_199_254_740_993,
    ];
    for value in nanos.map(|n| n as f64 / 1e6) {
        let steps = [value, -value, f64::from_bits(value.to_bits() + 1)];
        let below = (value > 0.0).then(|| f64::from_bits(value.to_bits() - 1));
        for value in steps.into_iter().chain(below) {
            let mut ours = Vec::new();
            super::float(value, &mut ours);
            let theirs = serde_json::to_string(&value).expect("serialize");
            assert_eq!(String::from_utf8(ours).expect("utf-8"), theirs, "{value:e}");
        }
    }
}

/// Every byte, at every place of a name up to two steps and a remainder long, is found to
/// need escaping exactly when serde_json escapes it.
#[test]
fn a_byte_needs_escaping_wherever_it_stands_exactly_when_serde_json_escapes_it() {
    for len in 1..=19 {
        for at in 0..len {
            for byte in 0..=u8::MAX {
                let mut bytes = vec![b'a'; len];
                bytes[at] = byte;
                let escaped = serde_json::to_string(&char::from(byte).to_string())
                    .expect("a string")
                    .len()
                    > char::from(byte).len_utf8() + 2;
                assert_eq!(super::plain(&bytes), !escaped, "{byte:#x} at {at} of {len}");
            }
        }
    }
    assert!(super::plain(b""));
}
