//! Without eBPF: notices a departed client from user space by peeking at a duplicate of its
//! socket. Slower than the kernel's event (it waits for readiness and a peek), and it cannot
//! see a close while unread request bytes are pending, but it needs no privileges.

use std::{os::fd::AsFd as _, sync::Arc, time::Duration};

use tokio::net::TcpStream;

use super::{event::monotonic_now, registry::Connection};

/// How often to look again while bytes the server has not read yet sit in the socket (a
/// pipelined request): readiness cannot tell a close behind them.
const PENDING_DATA_RECHECK: Duration = Duration::from_millis(50);

/// A second handle on an accepted socket, for watching it beside hyper.
pub fn duplicate(stream: &TcpStream) -> std::io::Result<std::net::TcpStream> {
    let fd = stream.as_fd().try_clone_to_owned()?;
    // The duplicate shares the file description, which is already non-blocking; the thread
    // that watches it registers it with its own reactor.
    Ok(std::net::TcpStream::from(fd))
}

/// Returns once the client has gone (EOF or reset), after marking the connection so.
/// With `half_close_means_gone` false, an EOF (the client's FIN) is not enough: only a reset.
pub async fn watch(socket: TcpStream, connection: &Arc<Connection>, half_close_means_gone: bool) {
    let mut byte = [0u8; 1];
    loop {
        match socket.peek(&mut byte).await {
            Ok(0) if half_close_means_gone => break,
            // Half-closed on purpose, or data waiting for hyper: look again shortly.
            Ok(_) => tokio::time::sleep(PENDING_DATA_RECHECK).await,
            Err(_) => break,
        }
    }
    connection.mark_gone(monotonic_now());
}
