//! The body of a queued request's response as hyper sees it: the frames its owner hands over
//! through a short channel, then how the answer ends. The owner keeps the upstream exchange,
//! so it notices a client that stops reading (the channel stays full) while hyper waits on
//! the socket, and it can end the answer without waiting for the client.

use std::{
    pin::Pin,
    task::{Context, Poll},
};

use bytes::Bytes;
use http_body::{Body as HttpBody, Frame, SizeHint};
use tokio::sync::{mpsc, oneshot};

/// Frames in flight between the owner and hyper: enough to overlap one read with one write.
pub const DEPTH: usize = 2;

/// How an answer ends after its last frame.
#[derive(Debug)]
pub enum Finish {
    /// Cleanly: hyper writes the final chunk.
    Clean,
    /// With one more piece (the API's error event), then cleanly.
    Error(Bytes),
}

/// The answer was cut short: hyper closes the connection rather than end it cleanly, so the
/// client cannot take a truncated answer for a whole one.
#[derive(Debug, thiserror::Error)]
#[error("guard cut this answer short")]
pub struct Cut;

/// The client has gone: hyper dropped the body.
#[derive(Debug)]
pub struct Gone;

/// Why a frame could not be handed over at once.
#[derive(Debug)]
pub enum Offer {
    /// The channel is full: here is the frame back.
    Full(Frame<Bytes>),
    Gone,
}

pub struct ClientBody {
    frames: mpsc::Receiver<Frame<Bytes>>,
    finish: oneshot::Receiver<Finish>,
    hint: SizeHint,
    ended: bool,
}

/// The owner's side of a `ClientBody`.
pub struct Feed {
    frames: mpsc::Sender<Frame<Bytes>>,
    finish: oneshot::Sender<Finish>,
}

impl ClientBody {
    /// A body and the feed its owner fills; `hint` is the upstream answer's size hint.
    pub fn channel(hint: SizeHint) -> (Self, Feed) {
        let (frames_in, frames) = mpsc::channel(DEPTH);
        let (finish_in, finish) = oneshot::channel();
        let body = Self {
            frames,
            finish,
            hint,
            ended: false,
        };
        let feed = Feed {
            frames: frames_in,
            finish: finish_in,
        };
        (body, feed)
    }
}

impl Feed {
    /// Waits for room for one frame. Cancel-safe: a frame waiting for room stays with its
    /// owner, who may stop waiting (a preemption, the client's time running out) and keep it.
    pub async fn room(&self) -> Result<mpsc::Permit<'_, Frame<Bytes>>, Gone> {
        self.frames.reserve().await.map_err(|_| Gone)
    }

    /// Hands a frame over if there is room now.
    pub fn try_send(&self, frame: Frame<Bytes>) -> Result<(), Offer> {
        self.frames.try_send(frame).map_err(|err| match err {
            mpsc::error::TrySendError::Full(frame) => Offer::Full(frame),
            mpsc::error::TrySendError::Closed(_) => Offer::Gone,
        })
    }

    /// Ends the answer after the frames already handed over; `None` cuts it.
    pub fn finish(self, finish: Option<Finish>) {
        if let Some(finish) = finish {
            let _ = self.finish.send(finish);
        }
    }
}

impl HttpBody for ClientBody {
    type Data = Bytes;
    type Error = Cut;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Cut>>> {
        if self.ended {
            return Poll::Ready(None);
        }
        match self.frames.poll_recv(cx) {
            Poll::Ready(Some(frame)) => return Poll::Ready(Some(Ok(frame))),
            Poll::Pending => return Poll::Pending,
            // The feed is finished: how?
            Poll::Ready(None) => {}
        }
        match Pin::new(&mut self.finish).poll(cx) {
            Poll::Ready(Ok(Finish::Clean)) => {
                self.ended = true;
                Poll::Ready(None)
            }
            Poll::Ready(Ok(Finish::Error(piece))) => {
                self.ended = true;
                Poll::Ready(Some(Ok(Frame::data(piece))))
            }
            // Let go without a finish: cut.
            Poll::Ready(Err(_)) => Poll::Ready(Some(Err(Cut))),
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ended
    }

    fn size_hint(&self) -> SizeHint {
        self.hint
    }
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt as _;

    use super::*;

    async fn data(body: &mut ClientBody) -> Bytes {
        let frame = body.frame().await.expect("a frame").expect("not cut");
        frame.into_data().expect("data")
    }

    #[tokio::test]
    async fn frames_then_a_clean_end() {
        let (mut body, feed) = ClientBody::channel(SizeHint::default());
        feed.room()
            .await
            .expect("room")
            .send(Frame::data(Bytes::from_static(b"a")));
        feed.finish(Some(Finish::Clean));
        assert_eq!(data(&mut body).await, "a");
        assert!(body.frame().await.is_none());
        assert!(body.is_end_stream());
    }

    #[tokio::test]
    async fn an_error_piece_comes_last() {
        let (mut body, feed) = ClientBody::channel(SizeHint::default());
        feed.room()
            .await
            .expect("room")
            .send(Frame::data(Bytes::from_static(b"a")));
        feed.finish(Some(Finish::Error(Bytes::from_static(b"e"))));
        assert_eq!(data(&mut body).await, "a");
        assert_eq!(data(&mut body).await, "e");
        assert!(body.frame().await.is_none());
    }

    #[tokio::test]
    async fn a_feed_let_go_without_a_finish_is_a_cut() {
        let (mut body, feed) = ClientBody::channel(SizeHint::default());
        feed.finish(None);
        assert!(matches!(body.frame().await, Some(Err(Cut))));
    }
}
