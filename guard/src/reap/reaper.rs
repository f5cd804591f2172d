//! The reaper: turns the kernel's "this client's socket closed" into "drop that connection's
//! requests", through the connection registry.

use std::sync::{
    Arc,
    atomic::{AtomicBool, Ordering},
};

use tokio::sync::mpsc;

use super::{event::ConnEvent, registry::Registry};

/// Consumes kernel events until the stream ends.
pub async fn run(
    mut events: mpsc::Receiver<ConnEvent>,
    registry: Arc<Registry>,
    listen_port: u16,
    half_close_means_gone: Arc<AtomicBool>,
) {
    while let Some(event) = events.recv().await {
        let half_close = half_close_means_gone.load(Ordering::Relaxed);
        if let Some(connection) = registry.apply(&event, listen_port, half_close) {
            tracing::trace!(peer = %connection.peer, state = ?event.new, "client left");
        }
    }
}
