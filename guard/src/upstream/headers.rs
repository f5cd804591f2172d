//! Headers that describe one hop, not the message (RFC 9110 §7.6.1): never forwarded, either
//! way.

/// Removes the fixed hop-by-hop headers and every header the `Connection` header names.
pub fn strip_hop_by_hop(headers: &mut http::HeaderMap) {
    use http::{HeaderName, header};
    // Names made once: removing by `&str` parses the name on every request.
    const HOP_BY_HOP: [HeaderName; 8] = [
        header::CONNECTION,
        HeaderName::from_static("keep-alive"),
        header::PROXY_AUTHENTICATE,
        header::PROXY_AUTHORIZATION,
        HeaderName::from_static("proxy-connection"),
        header::TE,
        header::TRAILER,
        header::UPGRADE,
    ];
    // Most heads carry none: one pass over the names, rather than eight lookups, says so.
    if !headers.keys().any(|name| HOP_BY_HOP.contains(name)) {
        return;
    }
    let named: Vec<http::HeaderName> = headers
        .get_all(http::header::CONNECTION)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .filter_map(|name| http::HeaderName::try_from(name.trim()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in &HOP_BY_HOP {
        headers.remove(name);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_named_in_connection_are_not_forwarded() {
        let mut headers = http::HeaderMap::new();
        headers.insert("connection", "X-Secret, keep-alive".parse().expect("value"));
        headers.append("connection", "x-other".parse().expect("value"));
        headers.insert("x-secret", "1".parse().expect("value"));
        headers.insert("x-other", "1".parse().expect("value"));
        headers.insert("te", "trailers".parse().expect("value"));
        headers.insert("authorization", "Bearer t".parse().expect("value"));
        strip_hop_by_hop(&mut headers);
        let left: Vec<_> = headers.keys().map(http::HeaderName::as_str).collect();
        assert_eq!(left, ["authorization"]);
    }
}
