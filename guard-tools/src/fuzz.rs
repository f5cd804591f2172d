//! Entry points for fuzzers and the property tests that run them briefly: each takes any
//! bytes, drives one part of guard that reads hostile input, and checks what must hold. A
//! panic is a finding. `cargo xtask bench fuzz` runs them under libFuzzer (the `fuzz/` crate).

use std::sync::LazyLock;

use guard::{
    config::{Api, Config},
    jsonscan,
    proxy::error_shape,
    quote::quote,
    reap::event::ConnEvent,
    route::{DEFAULT_QUEUED, QueuedPaths},
    upstream::strip_hop_by_hop,
};

static QUEUED: LazyLock<QueuedPaths> =
    LazyLock::new(|| QueuedPaths::new(DEFAULT_QUEUED.iter().copied()));

/// A request head as a client sends it: parsed as hyper parses it, then the path decision,
/// the hop-by-hop headers and the quoting of client text.
pub fn request_head(data: &[u8]) {
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut request = httparse::Request::new(&mut headers);
    let Ok(httparse::Status::Complete(_)) = request.parse(data) else {
        return;
    };
    let path = request.path.unwrap_or("/");
    if let Ok(normalized) = guard::route::normalize(path) {
        // What a router would match: rooted, without dot or empty segments.
        assert!(normalized.starts_with('/'), "{path:?}");
        let segments: Vec<&str> = normalized.split('/').skip(1).collect();
        let clean = normalized == "/" || segments.iter().all(|s| !matches!(*s, "" | "." | ".."));
        assert!(clean, "{path:?} -> {normalized:?}");
        assert!(QUEUED.contains(path).is_ok());
    }
    let _ = error_shape(path, Api::Openai);
    let mut map = http::HeaderMap::new();
    for header in request.headers.iter() {
        if let (Ok(name), Ok(value)) = (
            http::HeaderName::from_bytes(header.name.as_bytes()),
            http::HeaderValue::from_bytes(header.value),
        ) {
            map.append(name, value);
        }
    }
    strip_hop_by_hop(&mut map);
    assert!(!map.contains_key(http::header::CONNECTION));
    assert!(quote(path).len() <= 64 + '…'.len_utf8());
}

/// A request body: the fields guard reads from it.
pub fn model_field(data: &[u8]) {
    let mut members = 0usize;
    let scanned = jsonscan::members(data, |key, value| {
        members += 1;
        assert!(key.first() == Some(&b'"') && key.last() == Some(&b'"'));
        assert!(!value.is_empty());
    });
    if scanned.is_err() {
        return;
    }
    // Whatever serde_json accepts as an object, the scan reads with the same members.
    if let Ok(serde_json::Value::Object(object)) = serde_json::from_slice(data) {
        assert!(members >= object.len());
    }
    let _ = guard::proxy::read_asks(data);
}

/// A config file: loaded, and where accepted, used.
pub fn config(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(config) = Config::parse(text, std::path::Path::new("fuzz.toml")) {
        let _ = config.named_models();
        for class in config.class.values() {
            let _ = class.timeouts();
        }
    }
}

/// A ring-buffer record of the eBPF program: decoded, then asked what it means.
pub fn ebpf_event(data: &[u8]) {
    let Some(event) = ConnEvent::decode(data) else {
        return;
    };
    let _ = event.is_client_gone(&[event.local.port()]);
    assert_eq!(event.local.ip(), event.local.ip().to_canonical());
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn head() -> impl Strategy<Value = Vec<u8>> {
        let path = prop_oneof![
            Just("/api/generate".to_owned()),
            "/[a-z%0-9./]{0,24}",
            any::<String>(),
        ];
        let header = "[A-Za-z-]{1,12}: [ -~]{0,24}";
        (path, proptest::collection::vec(header, 0..6)).prop_map(|(path, headers)| {
            format!(
                "POST {path} HTTP/1.1\r\n{}\r\n",
                headers
                    .iter()
                    .map(|h| format!("{h}\r\n"))
                    .collect::<String>()
            )
            .into_bytes()
        })
    }

    proptest! {
        // Seeded: the same inputs on every run (libFuzzer explores; `cargo xtask bench fuzz`).
        #![proptest_config(ProptestConfig {
            cases: 2_000,
            rng_seed: proptest::test_runner::RngSeed::Fixed(0x5eed),
            ..ProptestConfig::default()
        })]

        #[test]
        fn request_heads(data in head()) { request_head(&data); }

        #[test]
        fn random_bytes_as_request_heads(data in proptest::collection::vec(any::<u8>(), 0..256)) {
            request_head(&data);
        }

        #[test]
        fn bodies(data in "[\\\\{}\\[\\]\":,a-z0-9 ]{0,64}") { model_field(data.as_bytes()); }

        #[test]
        fn random_bytes_as_bodies(data in proptest::collection::vec(any::<u8>(), 0..256)) {
            model_field(&data);
        }

        #[test]
        fn configs(data in "[a-z_.\\[\\]=\" 0-9\n-]{0,128}") { config(data.as_bytes()); }

        #[test]
        fn ebpf_events(data in proptest::collection::vec(any::<u8>(), 0..128)) { ebpf_event(&data); }
    }
}
