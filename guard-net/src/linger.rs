//! A client connection that closes the way nginx's lingering close does: when guard answered
//! before reading the request body (413, 503), closing at once would make the kernel answer the
//! client's remaining bytes with a reset, and many clients (Python's `requests`, `http.client`,
//! httpx) would report the reset instead of the answer. So guard sends its FIN, then reads and
//! drops what the client still sends, until it stops, for at most `LINGER_TOTAL`, and at most
//! `LINGER_IDLE` between reads.

use std::{
    pin::Pin,
    sync::Arc,
    task::{Context, Poll, ready},
    time::Duration,
};

use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    time::Sleep,
};

/// What a lingering connection asks of its owner.
pub trait Lingers {
    /// Whether the connection is to linger when it closes (an answer went before its body).
    fn lingers(&self) -> bool;
}

const LINGER_TOTAL: Duration = Duration::from_secs(30);
const LINGER_IDLE: Duration = Duration::from_secs(5);

pub struct Lingering<I, C> {
    inner: I,
    connection: Arc<C>,
    drain: Option<Drain>,
}

struct Drain {
    total: Pin<Box<Sleep>>,
    idle: Pin<Box<Sleep>>,
}

impl<I, C> Lingering<I, C> {
    pub fn new(inner: I, connection: Arc<C>) -> Self {
        Self {
            inner,
            connection,
            drain: None,
        }
    }

    pub fn get_ref(&self) -> &I {
        &self.inner
    }
}

impl<I: AsyncRead + Unpin, C> Lingering<I, C> {
    /// Reads and drops what the client sends; ready when it stops or time is up.
    fn poll_drain(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let Some(drain) = self.drain.as_mut() else {
            return Poll::Ready(());
        };
        let mut scratch = [0u8; 16 << 10];
        loop {
            if drain.total.as_mut().poll(cx).is_ready() || drain.idle.as_mut().poll(cx).is_ready() {
                return Poll::Ready(());
            }
            let mut buf = ReadBuf::new(&mut scratch);
            match Pin::new(&mut self.inner).poll_read(cx, &mut buf) {
                Poll::Ready(Ok(())) if buf.filled().is_empty() => return Poll::Ready(()),
                Poll::Ready(Ok(())) => {
                    let deadline = tokio::time::Instant::now() + LINGER_IDLE;
                    drain.idle.as_mut().reset(deadline);
                }
                Poll::Ready(Err(_)) => return Poll::Ready(()),
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

impl<I: AsyncRead + Unpin, C: Lingers> AsyncRead for Lingering<I, C> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<I: AsyncRead + AsyncWrite + Unpin, C: Lingers> AsyncWrite for Lingering<I, C> {
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
        if !self.connection.lingers() {
            return Pin::new(&mut self.inner).poll_shutdown(cx);
        }
        if self.drain.is_none() {
            ready!(Pin::new(&mut self.inner).poll_shutdown(cx))?;
            self.drain = Some(Drain {
                total: Box::pin(tokio::time::sleep(LINGER_TOTAL)),
                idle: Box::pin(tokio::time::sleep(LINGER_IDLE)),
            });
        }
        ready!(self.poll_drain(cx));
        Poll::Ready(Ok(()))
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}
