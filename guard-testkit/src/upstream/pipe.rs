//! In-memory connections to the scripted upstream, for a proxy in the test's own process: no
//! time passes on them, and guard's close is seen the moment it drops its end.

use std::{
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    task::{Context, Poll},
};

use tokio::io::{AsyncRead, AsyncWrite, DuplexStream, ReadBuf};

use super::{Link, Upstream, forget_closed};

/// A pipe's buffer, each way.
const PIPE: usize = 64 << 10;

/// guard's end of an in-memory connection: dropping it ends any exchange on it at once.
pub struct Pipe {
    inner: DuplexStream,
    upstream: Upstream,
    closed: Arc<AtomicBool>,
}

impl Upstream {
    /// Opens a connection for guard, served as a TCP one is.
    pub fn connect(&self) -> Pipe {
        self.dialed();
        let (guard_end, server_end) = tokio::io::duplex(PIPE);
        let closed = Arc::new(AtomicBool::new(false));
        let (server, link) = (self.clone(), Link::Pipe(Arc::clone(&closed)));
        tokio::spawn(async move {
            let (mut reader, mut writer) = tokio::io::split(server_end);
            // A reset is the pipe dropped mid-answer, as any end of serving drops it.
            server.serve(&mut reader, &mut writer, link).await;
        });
        Pipe {
            inner: guard_end,
            upstream: self.clone(),
            closed,
        }
    }
}

impl Drop for Pipe {
    fn drop(&mut self) {
        self.closed.store(true, Ordering::SeqCst);
        let mut record = self.upstream.lock();
        forget_closed(&mut record);
        record.connections -= 1;
    }
}

impl AsyncRead for Pipe {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for Pipe {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
