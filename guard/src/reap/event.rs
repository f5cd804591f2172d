//! Connection events in user-space types: socket addresses and named TCP states.

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    time::Duration,
};

use guard_common::{AF_INET, SockEvent, tcp_state};

/// A TCP state, as the kernel names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TcpState {
    Established,
    SynSent,
    SynRecv,
    FinWait1,
    FinWait2,
    TimeWait,
    Close,
    CloseWait,
    LastAck,
    Listen,
    Closing,
    NewSynRecv,
    Unknown(i32),
}

impl From<i32> for TcpState {
    fn from(state: i32) -> Self {
        match state {
            tcp_state::ESTABLISHED => Self::Established,
            tcp_state::SYN_SENT => Self::SynSent,
            tcp_state::SYN_RECV => Self::SynRecv,
            tcp_state::FIN_WAIT1 => Self::FinWait1,
            tcp_state::FIN_WAIT2 => Self::FinWait2,
            tcp_state::TIME_WAIT => Self::TimeWait,
            tcp_state::CLOSE => Self::Close,
            tcp_state::CLOSE_WAIT => Self::CloseWait,
            tcp_state::LAST_ACK => Self::LastAck,
            tcp_state::LISTEN => Self::Listen,
            tcp_state::CLOSING => Self::Closing,
            tcp_state::NEW_SYN_RECV => Self::NewSynRecv,
            other => Self::Unknown(other),
        }
    }
}

/// One state change of a socket on a watched port, seen from that socket's side.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnEvent {
    /// CLOCK_MONOTONIC time of the change in the kernel.
    pub at: Duration,
    /// The kernel's socket address: tells apart two sockets of one connection.
    pub socket: u64,
    /// This socket's own end.
    pub local: SocketAddr,
    /// The other end.
    pub remote: SocketAddr,
    pub old: TcpState,
    pub new: TcpState,
}

impl ConnEvent {
    /// Whether this is the accepted (server) side of a connection to one of `listen_ports`
    /// learning that its client has gone: a FIN (CLOSE_WAIT) or a reset (CLOSE) while
    /// established.
    pub fn is_client_gone(&self, listen_ports: &[u16]) -> bool {
        listen_ports.contains(&self.local.port())
            && self.old == TcpState::Established
            && matches!(self.new, TcpState::CloseWait | TcpState::Close)
    }
}

impl ConnEvent {
    /// An event from the bytes of one ring-buffer record; None if it is too short.
    pub fn decode(record: &[u8]) -> Option<Self> {
        SockEvent::from_record(record).map(|raw| Self::from(&raw))
    }
}

impl From<&SockEvent> for ConnEvent {
    fn from(raw: &SockEvent) -> Self {
        Self {
            at: Duration::from_nanos(raw.timestamp_ns),
            socket: raw.skaddr,
            local: socket_addr(raw.family, raw.saddr, raw.sport),
            remote: socket_addr(raw.family, raw.daddr, raw.dport),
            old: raw.oldstate.into(),
            new: raw.newstate.into(),
        }
    }
}

/// Builds an address from the kernel's 16 bytes; IPv4-mapped IPv6 becomes plain IPv4, so a
/// dual-stack listener's view and the kernel's view of one connection compare equal.
pub fn socket_addr(family: u16, bytes: [u8; 16], port: u16) -> SocketAddr {
    let ip = if family == AF_INET {
        IpAddr::V4(Ipv4Addr::new(bytes[0], bytes[1], bytes[2], bytes[3]))
    } else {
        IpAddr::V6(Ipv6Addr::from(bytes))
    };
    SocketAddr::new(ip.to_canonical(), port)
}

/// The same normalisation for addresses that come from user space (accept, getpeername).
pub fn canonical(addr: SocketAddr) -> SocketAddr {
    SocketAddr::new(addr.ip().to_canonical(), addr.port())
}

/// CLOCK_MONOTONIC now, the clock of [`ConnEvent::at`].
pub fn monotonic_now() -> Duration {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
        .map(Duration::from)
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use guard_common::AF_INET6;

    #[test]
    fn v4_mapped_addresses_become_v4() {
        let mut bytes = [0u8; 16];
        bytes[10] = 0xff;
        bytes[11] = 0xff;
        bytes[12..].copy_from_slice(&[127, 0, 0, 1]);
        let addr = socket_addr(AF_INET6, bytes, 80);
        assert_eq!(addr, "127.0.0.1:80".parse().expect("addr"));
        assert_eq!(
            canonical("[::ffff:127.0.0.1]:80".parse().expect("addr")),
            addr
        );
    }

    #[test]
    fn client_gone_is_fin_or_reset_on_the_server_side() {
        let event = |local: &str, old, new| ConnEvent {
            at: Duration::ZERO,
            socket: 1,
            local: local.parse().expect("addr"),
            remote: "127.0.0.1:5000".parse().expect("addr"),
            old,
            new,
        };
        use TcpState::*;
        assert!(event("127.0.0.1:80", Established, CloseWait).is_client_gone(&[80]));
        assert!(event("127.0.0.1:80", Established, Close).is_client_gone(&[80]));
        assert!(!event("127.0.0.1:80", Established, FinWait1).is_client_gone(&[80]));
        assert!(!event("127.0.0.1:81", Established, CloseWait).is_client_gone(&[80]));
    }
}
