//! The connections guard has accepted, by client address, so that a close the kernel reports
//! can be matched to the requests riding on that connection.

use std::{
    collections::HashMap,
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::Duration,
};

use tokio_util::sync::CancellationToken;

use super::event::{ConnEvent, TcpState, canonical, monotonic_now};

/// One accepted client connection.
pub struct Connection {
    pub peer: SocketAddr,
    /// The listener's address the client reached (one of `server.listen`'s).
    pub local: SocketAddr,
    /// CLOCK_MONOTONIC at accept: older kernel events for the same 4-tuple are ignored.
    pub accepted_at: Duration,
    cancel: CancellationToken,
    /// CLOCK_MONOTONIC of the kernel event that said the client left.
    gone_at: Mutex<Option<Duration>>,
    /// Close by reading (and dropping) what the client still sends, for a while.
    linger: std::sync::atomic::AtomicBool,
    /// The client's process, looked up once, when a rule first asks.
    process: std::sync::OnceLock<Option<Arc<super::peer::Peer>>>,
    /// The client (address and process) as the access log writes it, rendered once.
    logged_as: std::sync::OnceLock<Box<[u8]>>,
}

impl guard_net::linger::Lingers for Connection {
    fn lingers(&self) -> bool {
        Connection::lingers(self)
    }
}

impl Connection {
    /// Resolves when the client is known to have left or the connection has ended: the
    /// connection's task then closes the socket, and each request on it concludes.
    pub async fn gone(&self) {
        self.cancel.cancelled().await;
    }

    /// Whether the client is known to have left or the connection has ended.
    pub fn is_gone(&self) -> bool {
        self.cancel.is_cancelled()
    }

    /// Asks that the connection, when it closes, first drain what the client is still sending
    /// (an answer sent before the request body was read).
    pub fn linger(&self) {
        self.linger
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// The client's process: `look_up` runs once per connection, on first ask.
    pub fn process(
        &self,
        look_up: impl FnOnce() -> Option<super::peer::Peer>,
    ) -> Option<&Arc<super::peer::Peer>> {
        self.process
            .get_or_init(|| look_up().map(Arc::new))
            .as_ref()
    }

    /// The client's process, where it was looked up already.
    pub fn known_process(&self) -> Option<&Arc<super::peer::Peer>> {
        self.process.get().and_then(Option::as_ref)
    }

    /// The client as the access log writes it: `render` runs once per connection, whose
    /// address and process do not change while it lasts.
    pub fn logged_as(&self, render: impl FnOnce() -> Vec<u8>) -> &[u8] {
        self.logged_as.get_or_init(|| render().into_boxed_slice())
    }

    pub fn lingers(&self) -> bool {
        self.linger.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Ends the connection from guard's side (it ended, or guard cuts a client that stopped
    /// reading); unlike `mark_gone` no departure time is recorded.
    pub fn end(&self) {
        self.cancel.cancel();
    }

    /// When the client left, by the kernel's clock, if it has.
    pub fn gone_at(&self) -> Option<Duration> {
        *self
            .gone_at
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Marks the client gone at `at` (a kernel timestamp, or now for user-space detection).
    pub fn mark_gone(&self, at: Duration) {
        let mut gone_at = self
            .gone_at
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if gone_at.is_none() {
            *gone_at = Some(at);
        }
        drop(gone_at);
        self.cancel.cancel();
    }
}

/// Open client connections by peer address.
#[derive(Default)]
pub struct Registry {
    by_peer: Mutex<HashMap<SocketAddr, Arc<Connection>>>,
    /// Whether a client's FIN alone (a half-close) means it has gone; from the config, which a
    /// reload may change.
    half_close_means_gone: std::sync::atomic::AtomicBool,
}

impl Registry {
    /// Records a just-accepted connection.
    pub fn register(&self, peer: SocketAddr, local: SocketAddr) -> Arc<Connection> {
        let peer = canonical(peer);
        let connection = Arc::new(Connection {
            peer,
            local: canonical(local),
            accepted_at: monotonic_now(),
            cancel: CancellationToken::new(),
            gone_at: Mutex::new(None),
            linger: std::sync::atomic::AtomicBool::new(false),
            process: std::sync::OnceLock::new(),
            logged_as: std::sync::OnceLock::new(),
        });
        self.lock().insert(peer, Arc::clone(&connection));
        connection
    }

    /// Forgets a finished connection (unless its 4-tuple has been reused meanwhile).
    pub fn unregister(&self, connection: &Arc<Connection>) {
        let mut by_peer = self.lock();
        if by_peer
            .get(&connection.peer)
            .is_some_and(|current| Arc::ptr_eq(current, connection))
        {
            by_peer.remove(&connection.peer);
        }
        // After a flood of connections, give the table's room back.
        if by_peer.capacity() > 256 && by_peer.len() < by_peer.capacity() / 4 {
            let keep = by_peer.len() * 2;
            by_peer.shrink_to(keep);
        }
    }

    /// A (re)loaded config's `server.half_close_means_gone`.
    pub fn set_half_close_means_gone(&self, gone: bool) {
        self.half_close_means_gone
            .store(gone, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether a client's FIN alone means it has gone.
    pub fn half_close_means_gone(&self) -> bool {
        self.half_close_means_gone
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Applies a kernel event for a connection to one of `listen_ports`; returns the
    /// connection it marked gone, if any. Unless a half-close means gone, only a reset counts.
    pub fn apply(&self, event: &ConnEvent, listen_ports: &[u16]) -> Option<Arc<Connection>> {
        if !event.is_client_gone(listen_ports) {
            return None;
        }
        if event.new == TcpState::CloseWait && !self.half_close_means_gone() {
            return None;
        }
        let connection = self.lock().get(&event.remote).cloned()?;
        // The same client address may reach two listeners; only this one's is gone.
        if connection.local != event.local {
            return None;
        }
        // An event from before this connection was accepted belongs to an earlier
        // connection on the same 4-tuple.
        if event.at < connection.accepted_at {
            return None;
        }
        connection.mark_gone(event.at);
        Some(connection)
    }

    /// The open connection from `peer`, if there is one.
    pub fn find(&self, peer: SocketAddr) -> Option<Arc<Connection>> {
        self.lock().get(&canonical(peer)).cloned()
    }

    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<SocketAddr, Arc<Connection>>> {
        self.by_peer
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(remote: SocketAddr, at: Duration, new: TcpState) -> ConnEvent {
        ConnEvent {
            at,
            socket: 1,
            local: local(),
            remote,
            old: TcpState::Established,
            new,
        }
    }

    /// The listener every test connection reached.
    fn local() -> SocketAddr {
        "127.0.0.1:80".parse().expect("addr")
    }

    fn registry(half_close_means_gone: bool) -> Registry {
        let registry = Registry::default();
        registry.set_half_close_means_gone(half_close_means_gone);
        registry
    }

    #[test]
    fn a_close_marks_its_connection_gone() {
        let registry = registry(true);
        let peer: SocketAddr = "127.0.0.1:5000".parse().expect("addr");
        let connection = registry.register(peer, local());
        let later = connection.accepted_at + Duration::from_millis(1);
        assert!(
            registry
                .apply(&event(peer, later, TcpState::CloseWait), &[81])
                .is_none(),
            "other port"
        );
        let other: SocketAddr = "127.0.0.1:5001".parse().expect("addr");
        assert!(
            registry
                .apply(&event(other, later, TcpState::CloseWait), &[80])
                .is_none()
        );
        let gone = registry.apply(&event(peer, later, TcpState::CloseWait), &[80]);
        assert!(gone.is_some_and(|c| Arc::ptr_eq(&c, &connection)));
        assert_eq!(connection.gone_at(), Some(later));
    }

    #[test]
    fn a_close_on_another_listener_leaves_this_connection() {
        let registry = registry(true);
        let peer: SocketAddr = "127.0.0.1:5000".parse().expect("addr");
        let connection = registry.register(peer, "127.0.0.1:81".parse().expect("addr"));
        let later = connection.accepted_at + Duration::from_millis(1);
        let elsewhere = event(peer, later, TcpState::Close);
        assert!(registry.apply(&elsewhere, &[80, 81]).is_none());
        assert_eq!(connection.gone_at(), None);
    }

    #[test]
    fn an_old_event_on_a_reused_4_tuple_is_ignored() {
        let registry = registry(true);
        let peer: SocketAddr = "127.0.0.1:5000".parse().expect("addr");
        let connection = registry.register(peer, local());
        let before = connection.accepted_at - Duration::from_millis(1);
        assert!(
            registry
                .apply(&event(peer, before, TcpState::Close), &[80])
                .is_none()
        );
        assert_eq!(connection.gone_at(), None);
    }

    #[test]
    fn half_close_counts_only_when_configured() {
        let registry = registry(false);
        let peer: SocketAddr = "127.0.0.1:5000".parse().expect("addr");
        let connection = registry.register(peer, local());
        let later = connection.accepted_at + Duration::from_millis(1);
        assert!(
            registry
                .apply(&event(peer, later, TcpState::CloseWait), &[80])
                .is_none()
        );
        assert!(
            registry
                .apply(&event(peer, later, TcpState::Close), &[80])
                .is_some(),
            "a reset still counts"
        );
    }

    #[test]
    fn unregister_keeps_a_newer_connection_on_the_same_4_tuple() {
        let registry = Registry::default();
        let peer: SocketAddr = "127.0.0.1:5000".parse().expect("addr");
        let old = registry.register(peer, local());
        let new = registry.register(peer, local());
        registry.unregister(&old);
        assert_eq!(registry.len(), 1);
        registry.unregister(&new);
        assert!(registry.is_empty());
    }
}
