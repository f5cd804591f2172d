//! Accepting connections so that neither a flood nor a full descriptor table takes guard
//! down: a cap on the connections a listener keeps open (more are closed at once), a pause
//! when accept fails (`EMFILE` leaves the connection queued; spinning would only log), and at
//! most one log line a second about it.

use std::{net::SocketAddr, sync::Arc, task::Poll, time::Duration};

use prometheus::IntCounter;
use tokio::{
    net::{TcpListener, TcpStream},
    sync::{OwnedSemaphorePermit, Semaphore},
    time::Instant,
};

/// How long accept pauses after a failure.
const BACKOFF: Duration = Duration::from_millis(100);
/// Accept failures are logged at most this often.
const LOG_EVERY: Duration = Duration::from_secs(1);

/// Listeners (one key's addresses) with one cap on their open connections together.
pub struct Acceptor {
    listeners: Vec<TcpListener>,
    /// Which listener is asked first next time, so a busy one cannot starve the others.
    first: usize,
    name: &'static str,
    open: Arc<Semaphore>,
    refused: IntCounter,
    last_log: Option<Instant>,
    unlogged: u64,
}

/// An accepted connection: its place under the cap goes when this is dropped.
pub struct Accepted {
    pub stream: TcpStream,
    pub peer: SocketAddr,
    pub place: OwnedSemaphorePermit,
}

/// What accept gave: a connection within the cap, or one over it (to be refused).
pub enum Arrival {
    Accepted(Accepted),
    OverCap(TcpStream),
}

impl Acceptor {
    pub fn new(
        listeners: Vec<TcpListener>,
        name: &'static str,
        cap: usize,
        refused: IntCounter,
    ) -> Self {
        Self {
            listeners,
            first: 0,
            name,
            open: Arc::new(Semaphore::new(cap)),
            refused,
            last_log: None,
            unlogged: 0,
        }
    }

    /// The next connection; failures pause and retry.
    pub async fn next(&mut self) -> Arrival {
        loop {
            match self.accept().await {
                Ok((stream, peer)) => {
                    return match Arc::clone(&self.open).try_acquire_owned() {
                        Ok(place) => Arrival::Accepted(Accepted {
                            stream,
                            peer,
                            place,
                        }),
                        Err(_) => {
                            self.refused.inc();
                            Arrival::OverCap(stream)
                        }
                    };
                }
                Err(err) => {
                    self.note_failure(&err);
                    tokio::time::sleep(BACKOFF).await;
                }
            }
        }
    }

    /// The next connection on any of the listeners, asking each in turn.
    async fn accept(&mut self) -> std::io::Result<(TcpStream, SocketAddr)> {
        std::future::poll_fn(|cx| {
            let count = self.listeners.len();
            for n in 0..count {
                let at = (self.first + n) % count;
                if let Poll::Ready(result) = self.listeners[at].poll_accept(cx) {
                    self.first = (at + 1) % count;
                    return Poll::Ready(result);
                }
            }
            Poll::Pending
        })
        .await
    }

    fn note_failure(&mut self, err: &std::io::Error) {
        let due = self.last_log.is_none_or(|at| at.elapsed() >= LOG_EVERY);
        if !due {
            self.unlogged += 1;
            return;
        }
        tracing::warn!(
            listener = self.name,
            %err,
            failures_since_last_line = self.unlogged,
            "accept failed; pausing {} ms",
            BACKOFF.as_millis()
        );
        self.last_log = Some(Instant::now());
        self.unlogged = 0;
    }
}
