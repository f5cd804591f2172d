//! The reaper: turns the kernel's "this client's socket closed" into "drop that connection's
//! requests", through the connection registry.

use std::sync::Arc;

use tokio::sync::mpsc;

use super::{event::ConnEvent, registry::Registry};

/// Events handled in one go.
const BATCH: usize = 1_024;

/// Consumes kernel events until the stream ends.
pub async fn run(
    mut events: mpsc::Receiver<ConnEvent>,
    registry: Arc<Registry>,
    listen_ports: Vec<u16>,
) {
    let mut batch = Vec::with_capacity(BATCH);
    // Mark every departed client of a burst before any of their tasks runs again, so that a
    // permit freed by one is not handed to another that has also left.
    while events.recv_many(&mut batch, BATCH).await > 0 {
        for event in batch.drain(..) {
            if let Some(connection) = registry.apply(&event, &listen_ports) {
                tracing::trace!(peer = %connection.peer, state = ?event.new, "client left");
            }
        }
    }
}
