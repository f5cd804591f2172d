//! HAProxy's agent check: on each connection guard writes one line (`up ready weight:N%`,
//! `drain`, `maint`, `down #reason`) and closes. HAProxy sends nothing first.

use std::{sync::Arc, time::Duration};

use prometheus::IntCounter;
use tokio::{io::AsyncWriteExt as _, net::TcpListener};

use guard_net::listen::{Accepted, Acceptor, Arrival};

/// Produces the line, from the owners' state at that moment.
pub type LineFn = Arc<dyn Fn() -> String + Send + Sync>;

/// Agent connections open at once; a balancer checks every few hundred milliseconds.
const MAX_CONNECTIONS: usize = 64;
/// A checker that does not take its line within this is dropped.
const WRITE_BOUND: Duration = Duration::from_secs(1);

/// Answers agent checks until the task is dropped.
pub async fn serve(listener: TcpListener, line: LineFn, refused: IntCounter) {
    let mut acceptor = Acceptor::new(vec![listener], "agent", MAX_CONNECTIONS, refused);
    loop {
        let Arrival::Accepted(Accepted {
            mut stream, place, ..
        }) = acceptor.next().await
        else {
            // Over the cap: closed as it is dropped.
            continue;
        };
        let text = format!("{}\n", line());
        tokio::spawn(async move {
            let written = async {
                stream.write_all(text.as_bytes()).await?;
                stream.shutdown().await
            };
            if let Err(err) = tokio::time::timeout(WRITE_BOUND, written)
                .await
                .unwrap_or_else(|_| Err(std::io::ErrorKind::TimedOut.into()))
            {
                tracing::debug!(%err, "agent check connection ended early");
            }
            drop(place);
        });
    }
}
