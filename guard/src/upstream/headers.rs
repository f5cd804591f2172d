//! Headers that describe one hop, not the message (RFC 9110 §7.6.1): never forwarded, either
//! way.

/// Removes the fixed hop-by-hop headers and every header the `Connection` header names.
pub fn strip_hop_by_hop(headers: &mut http::HeaderMap) {
    const HOP_BY_HOP: &[&str] = &[
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "upgrade",
    ];
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
    for name in HOP_BY_HOP {
        headers.remove(*name);
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
