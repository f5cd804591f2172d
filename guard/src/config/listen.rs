//! A `listen` key: one address or a list of them (IPv6 too), and when two of them would
//! take the same socket.

use std::{fmt, net::SocketAddr};

use serde::{Deserialize, Deserializer, Serialize, Serializer, de};

/// Addresses one listener key names; never empty, at most `MAX` (each is a socket guard
/// holds open).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Listen(Vec<SocketAddr>);

impl Listen {
    /// The most addresses one key may name.
    pub const MAX: usize = 16;

    pub fn one(addr: SocketAddr) -> Self {
        Self(vec![addr])
    }

    pub fn addrs(&self) -> &[SocketAddr] {
        &self.0
    }
}

impl fmt::Display for Listen {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (n, addr) in self.0.iter().enumerate() {
            if n > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{addr}")?;
        }
        Ok(())
    }
}

/// Whether `a` and `b` would take the same socket: one port (a port of 0 is the kernel's
/// choice, each its own) and the same address, or one of them is the same family's wildcard.
/// IPv6 listeners are bound IPv6-only, so `[::]` does not cover `0.0.0.0`.
pub fn overlap(a: SocketAddr, b: SocketAddr) -> bool {
    let same_family = a.is_ipv4() == b.is_ipv4();
    a.port() == b.port()
        && a.port() != 0
        && same_family
        && (a.ip() == b.ip() || a.ip().is_unspecified() || b.ip().is_unspecified())
}

impl Serialize for Listen {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self.0.as_slice() {
            [one] => one.serialize(serializer),
            many => many.serialize(serializer),
        }
    }
}

impl<'de> Deserialize<'de> for Listen {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(ListenVisitor)
    }
}

struct ListenVisitor;

impl<'de> de::Visitor<'de> for ListenVisitor {
    type Value = Listen;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "an address (\"127.0.0.1:11434\", \"[::1]:11434\") or a list of 1 to {} of them",
            Listen::MAX
        )
    }

    fn visit_str<E: de::Error>(self, text: &str) -> Result<Listen, E> {
        parse(text).map(Listen::one)
    }

    fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<Listen, A::Error> {
        let mut addrs = Vec::new();
        while let Some(text) = seq.next_element::<String>()? {
            if addrs.len() == Listen::MAX {
                return Err(de::Error::invalid_length(Listen::MAX + 1, &self));
            }
            addrs.push(parse(&text)?);
        }
        if addrs.is_empty() {
            return Err(de::Error::invalid_length(0, &self));
        }
        Ok(Listen(addrs))
    }
}

fn parse<E: de::Error>(text: &str) -> Result<SocketAddr, E> {
    text.parse().map_err(|_| {
        E::custom(format_args!(
            "`{}` is not an address with a port (\"127.0.0.1:11434\", \"[::1]:11434\")",
            crate::quote::quote(text)
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(text: &str) -> SocketAddr {
        text.parse().expect("address")
    }

    #[test]
    fn overlaps_are_the_same_socket_or_a_wildcard_of_the_same_family() {
        assert!(overlap(addr("127.0.0.1:80"), addr("127.0.0.1:80")));
        assert!(overlap(addr("0.0.0.0:80"), addr("127.0.0.1:80")));
        assert!(overlap(addr("[::1]:80"), addr("[::]:80")));
        assert!(!overlap(addr("[::]:80"), addr("0.0.0.0:80")), "v6 only");
        assert!(!overlap(addr("127.0.0.1:80"), addr("[::1]:80")));
        assert!(!overlap(addr("127.0.0.1:80"), addr("127.0.0.2:80")));
        assert!(!overlap(addr("127.0.0.1:80"), addr("127.0.0.1:81")));
        assert!(
            !overlap(addr("127.0.0.1:0"), addr("127.0.0.1:0")),
            "kernel's choice"
        );
    }

    #[test]
    fn one_address_reads_back_as_one_and_a_list_as_a_list() {
        #[derive(Deserialize, Serialize)]
        struct Key {
            listen: Listen,
        }
        let one: Key = toml::from_str("listen = \"[::1]:80\"").expect("one");
        assert_eq!(one.listen.addrs(), [addr("[::1]:80")]);
        assert_eq!(
            toml::to_string(&one).expect("out").trim(),
            "listen = \"[::1]:80\""
        );
        let many: Key = toml::from_str("listen = [\"127.0.0.1:80\", \"[::1]:80\"]").expect("many");
        assert_eq!(many.listen.to_string(), "127.0.0.1:80, [::1]:80");
        for bad in ["listen = []", "listen = [\"localhost\"]", "listen = 80"] {
            assert!(toml::from_str::<Key>(bad).is_err(), "{bad}");
        }
        let too_many = format!("listen = [{}]", vec!["\"127.0.0.1:0\""; 17].join(","));
        assert!(toml::from_str::<Key>(&too_many).is_err());
    }
}
