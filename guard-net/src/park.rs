//! What lets an idle keep-alive client connection leave hyper between requests: hyper keeps
//! a read and a write buffer (8 KiB each) and its connection state for as long as a
//! connection lives, so ten thousand idle clients would hold that much for nothing. Here each
//! request's two bodies carry a token, the socket says whether hyper's last write reached it,
//! and hyper's waiting for a new request head with nothing of an answer left unsent is seen
//! as it happens; `serve` then takes the socket back and holds only it until the client sends
//! again.

use std::{
    io::IoSlice,
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    task::{Context, Poll},
};

use bytes::{Buf as _, Bytes};
use http_body::{Body as HttpBody, Frame, SizeHint};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// A client connection's traffic as the parking decision needs it. A connection's parts run
/// on its serving thread (a request body may end in the upstream client's task there); the
/// atomics make the value shareable, and a late count only skips one chance to park.
#[derive(Default)]
pub struct Activity {
    /// Request bodies and answers hyper still holds.
    open: AtomicUsize,
    /// Request heads hyper has parsed in this session (a fresh value each time the
    /// connection comes out of parking).
    heads: AtomicUsize,
    /// A request body was let go before its end: hyper drains or closes, never parks.
    spoiled: AtomicBool,
    /// Bytes written that no flush has yet confirmed.
    unflushed: AtomicBool,
    /// hyper asked for more bytes with nothing open and everything flushed.
    waiting: AtomicBool,
    /// The connection is being taken out of hyper: its shutdown leaves the socket open.
    parking: AtomicBool,
}

impl Activity {
    /// A request head was parsed: its body and its answer are open until hyper drops them.
    pub fn begin(self: &Arc<Self>) -> (Token, Token) {
        self.open.fetch_add(2, Ordering::Relaxed);
        self.heads.fetch_add(1, Ordering::Relaxed);
        (Token(Arc::clone(self)), Token(Arc::clone(self)))
    }

    /// Whether hyper, in the poll that just returned, waited for a new request with nothing
    /// open (forgotten once asked), after at least one whole exchange: until its first, a
    /// hyper connection does not count itself idle, and asked to stop it would serve one more
    /// request and close rather than stop at once.
    pub fn take_waiting(&self) -> bool {
        self.waiting.swap(false, Ordering::Relaxed) && self.has_heads()
    }

    /// Whether hyper has parsed a request head in this session.
    pub fn has_heads(&self) -> bool {
        self.heads.load(Ordering::Relaxed) > 0
    }

    /// From now on hyper's shutdown of the socket leaves it open (or, with false, closes it).
    pub fn set_parking(&self, parking: bool) {
        self.parking.store(parking, Ordering::Relaxed);
    }

    fn idle(&self) -> bool {
        self.open.load(Ordering::Relaxed) == 0
            && !self.unflushed.load(Ordering::Relaxed)
            && !self.spoiled.load(Ordering::Relaxed)
    }
}

/// One open part of a request (its body or its answer); dropping it closes the part.
pub struct Token(Arc<Activity>);

impl Drop for Token {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A client request's body as hyper delivers it, with its token: dropped before its end, it
/// marks the connection as one that never parks (hyper drains or closes it).
pub struct Inbound {
    body: hyper::body::Incoming,
    ended: bool,
    token: Token,
}

impl Inbound {
    pub fn new(body: hyper::body::Incoming, token: Token) -> Self {
        Self {
            body,
            ended: false,
            token,
        }
    }
}

impl Drop for Inbound {
    fn drop(&mut self) {
        if !(self.ended || self.body.is_end_stream()) {
            self.token.0.spoiled.store(true, Ordering::Relaxed);
        }
    }
}

impl HttpBody for Inbound {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let frame = Pin::new(&mut self.body).poll_frame(cx);
        if let Poll::Ready(None) = frame {
            self.ended = true;
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        self.ended || self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// An answer to the client with its token: hyper drops it after its last frame.
pub struct Outbound<B> {
    body: B,
    _token: Token,
}

impl<B> Outbound<B> {
    pub fn new(body: B, token: Token) -> Self {
        Self {
            body,
            _token: token,
        }
    }
}

impl<B: HttpBody + Unpin> HttpBody for Outbound<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// The client's socket as hyper sees it: first what an earlier hyper read and left unparsed,
/// then the socket; writes and flushes noted; hyper's shutdown skipped while parking.
pub struct Watched<I> {
    inner: I,
    leftover: Bytes,
    activity: Arc<Activity>,
}

impl<I> Watched<I> {
    pub fn new(inner: I, leftover: Bytes, activity: Arc<Activity>) -> Self {
        Self {
            inner,
            leftover,
            activity,
        }
    }

    /// The stream, and what of the earlier read hyper has not yet taken.
    pub fn into_parts(self) -> (I, Bytes) {
        (self.inner, self.leftover)
    }
}

impl<I: AsyncRead + Unpin> AsyncRead for Watched<I> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if !self.leftover.is_empty() {
            let n = self.leftover.len().min(buf.remaining());
            buf.put_slice(&self.leftover[..n]);
            self.leftover.advance(n);
            return Poll::Ready(Ok(()));
        }
        let read = Pin::new(&mut self.inner).poll_read(cx, buf);
        if read.is_pending() && self.activity.idle() {
            self.activity.waiting.store(true, Ordering::Relaxed);
        }
        read
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for Watched<I> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        self.activity.unflushed.store(true, Ordering::Relaxed);
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        self.activity.unflushed.store(true, Ordering::Relaxed);
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let flushed = Pin::new(&mut self.inner).poll_flush(cx);
        if let Poll::Ready(Ok(())) = flushed {
            self.activity.unflushed.store(false, Ordering::Relaxed);
        }
        flushed
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        if self.activity.parking.load(Ordering::Relaxed) {
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// A client stream that can wait for bytes (or a close) without reading them; one that
/// cannot is never parked.
pub trait Parkable: AsyncRead + AsyncWrite + Send + Sync + Unpin + 'static {
    const PARKS: bool;

    /// Resolves once a read would not wait.
    fn readable(&self) -> impl Future<Output = std::io::Result<()>> + Send + '_;
}

impl Parkable for tokio::net::TcpStream {
    const PARKS: bool = true;

    fn readable(&self) -> impl Future<Output = std::io::Result<()>> + Send + '_ {
        tokio::net::TcpStream::readable(self)
    }
}

/// In-memory connections (unit tests) are served by hyper throughout.
impl Parkable for tokio::io::DuplexStream {
    const PARKS: bool = false;

    fn readable(&self) -> impl Future<Output = std::io::Result<()>> + Send + '_ {
        std::future::pending()
    }
}
