//! The relay phase, one loop for every queued request: the answer's frames are read on their
//! way (as they pass, or event by event for a preemptible request) and go to the client as it
//! takes them, with every watch in one place: the client leaving, a client that stops reading,
//! an upstream gone idle, the class's maximum duration, and a preemption.

use std::{pin::Pin, time::Duration};

use bytes::Bytes;
use guard_net::client_body::{ClientBody, Feed, Finish, Offer};
use http::{Response, header, request, response};
use http_body::Frame;
use http_body_util::BodyExt as _;
use tokio::time::Instant;

use super::{
    Ending, Interrupt, QueuedRequest,
    reading::{Plain, Reading},
    tracked::Tracked,
};
use crate::{
    proxy::{
        error::ProxyError,
        outcome::{FailKind, Outcome, Stage, Timeout},
    },
    upstream::{exchange::Exchange, frames::StreamFormat, strip_hop_by_hop},
};

/// How long a client that left after data waits for the upstream's end: an SSE client closes
/// on `data: [DONE]` a moment before the server's chunked terminator, and had its answer.
const END_GRACE: Duration = Duration::from_millis(50);

/// What happened next, on either side.
enum Next {
    /// The upstream's next frame.
    Frame(Frame<Bytes>),
    /// The frame the client was not taking has gone to it.
    Delivered,
    /// The client took nothing for `client_stall_ms`.
    Stalled,
    /// The client's side of the answer is gone (hyper dropped the body).
    Left,
    End,
    Idle,
    Broken(hyper::Error),
    Preempted,
    Interrupted(Interrupt),
}

/// A frame the client has no room for yet, and when waiting for room becomes a stall.
struct Pending {
    frame: Frame<Bytes>,
    stall_at: Instant,
}

/// The answer's way to a client whose response has begun.
pub(super) struct Relay {
    feed: Feed,
    format: StreamFormat,
}

impl Relay {
    pub(super) fn feed(&self) -> &Feed {
        &self.feed
    }

    /// Ends the client's answer as `outcome` calls for: cleanly after the upstream's own end,
    /// with the API's error event where the format has one, else cut.
    pub(super) fn finish(self, outcome: &Outcome, error: Option<&ProxyError>) {
        let clean = matches!(
            outcome,
            Outcome::Completed | Outcome::Failed(FailKind::UpstreamError)
        );
        let finish = match clean {
            true => Some(Finish::Clean),
            false => error
                .and_then(|error| error.stream_frame(self.format))
                .map(Finish::Error),
        };
        self.feed.finish(finish);
    }
}

impl QueuedRequest {
    /// Relays the answer whose head is `answer`: event by event where the request is
    /// preemptible and the answer a successful stream, else as it comes.
    pub(super) async fn relay(
        &mut self,
        exchange: Exchange,
        mut answer: response::Parts,
        tracked: Option<Tracked>,
        head: &request::Parts,
    ) -> Ending {
        strip_hop_by_hop(&mut answer.headers);
        let format = StreamFormat::of(answer.headers.get(header::CONTENT_TYPE));
        let hint = exchange.size_hint();
        self.place.set_exchange(Some(exchange));
        let streams = answer.status.is_success() && format != StreamFormat::Whole;
        let mut reading = match tracked {
            Some(mut tracked) if streams => {
                tracked.format = format;
                let opened = !tracked.plan.client_streams
                    || self.open(answer, format, http_body::SizeHint::default());
                if !opened {
                    return Ending::Quiet(Outcome::Reaped(Stage::Running));
                }
                Reading::Tracked(tracked)
            }
            // Not preemptible, or an error or not a stream after all: relayed as it is.
            _ => {
                let reads_text = self.endpoint.is_some() && self.expects_json();
                let plain = Plain::new(format, &answer, reads_text);
                if !self.open(answer, format, hint) {
                    return Ending::Quiet(Outcome::Reaped(Stage::Running));
                }
                Reading::Plain(plain)
            }
        };
        self.relay_loop(&mut reading, head).await
    }

    /// Sends the response head now; its frames follow as they come.
    fn open(
        &mut self,
        answer: response::Parts,
        format: StreamFormat,
        hint: http_body::SizeHint,
    ) -> bool {
        self.account.status = Some(answer.status.as_u16());
        let (body, feed) = ClientBody::channel(hint);
        let response = self.tag(Response::from_parts(
            answer,
            body.map_err(Into::into).boxed(),
        ));
        self.reply.open(response, Relay { feed, format })
    }

    async fn relay_loop(&mut self, reading: &mut Reading, head: &request::Parts) -> Ending {
        // One interrupt future for the whole answer: frames are token-sized and many.
        let watch = self.watch();
        let interrupted = watch.interrupted();
        tokio::pin!(interrupted);
        let mut pending = None;
        // Asked to stop where it may not yet: it stops at the first point it may.
        let mut stop_due = false;
        // The ending, once the last bytes guard sends of its own have gone.
        let mut then = None;
        loop {
            let heed = reading.is_tracked() && !stop_due;
            let next = self.next(interrupted.as_mut(), &mut pending, heed).await;
            let ending = match next {
                Next::Frame(frame) => match self.read(reading, frame) {
                    Err(ending) => Some(ending),
                    Ok(out) => match self.offer(out, &mut pending) {
                        Some(ending) => Some(ending),
                        None if stop_due && reading.may_stop() => {
                            stop_due = false;
                            self.pause_and_go_on(reading, head, &mut pending).await
                        }
                        None => None,
                    },
                },
                Next::Delivered => then.take(),
                Next::Stalled => Some(self.timed_out_ending(Timeout::ClientStall)),
                Next::Left => Some(Ending::Quiet(Outcome::Reaped(Stage::Running))),
                Next::End => {
                    let (last, ending) = self.end(reading);
                    match self.offer(last, &mut pending) {
                        Some(left) => Some(left),
                        None if pending.is_some() => {
                            then = Some(ending);
                            None
                        }
                        None => Some(ending),
                    }
                }
                Next::Idle => Some(self.timed_out_ending(Timeout::UpstreamIdle)),
                Next::Broken(err) => Some(Ending::Told(ProxyError::UpstreamReset(err))),
                Next::Preempted if !reading.may_stop() => {
                    stop_due = true;
                    None
                }
                Next::Preempted => self.pause_and_go_on(reading, head, &mut pending).await,
                Next::Interrupted(Interrupt::MaxDuration) => {
                    Some(self.timed_out_ending(Timeout::MaxDuration))
                }
                Next::Interrupted(Interrupt::ClientGone) => Some(self.left(reading).await),
            };
            if let Some(ending) = ending {
                return ending;
            }
        }
    }

    /// The next thing to act on: while a frame waits for the client, its delivery (the
    /// upstream is not read meanwhile); else the upstream's next frame, within the idle limit.
    /// The client leaving, the time running out and a preemption are watched throughout.
    async fn next(
        &mut self,
        interrupted: Pin<&mut impl Future<Output = Interrupt>>,
        pending: &mut Option<Pending>,
        heed_preemption: bool,
    ) -> Next {
        let idle = self.timeouts.upstream_idle;
        let (permit, exchange) = self.place.running();
        let preempted = async {
            match (heed_preemption, permit) {
                (true, Some(permit)) => permit.progress().preempted().await,
                _ => std::future::pending().await,
            }
        };
        if let Some(waiting) = pending {
            let Some(feed) = self.reply.feed() else {
                return Next::Left;
            };
            return tokio::select! {
                biased;
                interrupt = interrupted => Next::Interrupted(interrupt),
                () = preempted => Next::Preempted,
                room = feed.room() => match (room, pending.take()) {
                    (Ok(room), Some(waiting)) => {
                        self.account.bytes_out += data_len(&waiting.frame);
                        room.send(waiting.frame);
                        Next::Delivered
                    }
                    _ => Next::Left,
                },
                () = tokio::time::sleep_until(waiting.stall_at) => Next::Stalled,
            };
        }
        let Some(exchange) = exchange else {
            return Next::End;
        };
        // A known length ends with its last data frame; hyper polls no further.
        if exchange.is_end_stream() {
            return Next::End;
        }
        tokio::select! {
            biased;
            interrupt = interrupted => Next::Interrupted(interrupt),
            () = preempted => Next::Preempted,
            frame = tokio::time::timeout(idle, exchange.frame()) => match frame {
                Err(_) => Next::Idle,
                Ok(None) => Next::End,
                Ok(Some(Ok(frame))) => Next::Frame(frame),
                Ok(Some(Err(err))) => Next::Broken(err),
            },
        }
    }

    /// Hands `out` to the client where it has room now; else it waits as `pending`, and the
    /// client's stall clock starts. Returns the ending if the client has gone.
    fn offer(
        &mut self,
        out: Option<Frame<Bytes>>,
        pending: &mut Option<Pending>,
    ) -> Option<Ending> {
        let frame = out?;
        let Some(feed) = self.reply.feed() else {
            // A client that gets its answer whole at the end: nothing goes before it.
            return None;
        };
        let length = data_len(&frame);
        match feed.try_send(frame) {
            Ok(()) => {
                self.account.bytes_out += length;
                None
            }
            Err(Offer::Gone) => Some(Ending::Quiet(Outcome::Reaped(Stage::Running))),
            Err(Offer::Full(frame)) => {
                *pending = Some(Pending {
                    frame,
                    stall_at: Instant::now() + self.timeouts.client_stall,
                });
                None
            }
        }
    }

    /// Pauses for a more urgent request and goes on; a frame still waiting for the client
    /// waits on, its stall clock started anew (the pause was guard's, not the client's).
    async fn pause_and_go_on(
        &mut self,
        reading: &mut Reading,
        head: &request::Parts,
        pending: &mut Option<Pending>,
    ) -> Option<Ending> {
        let Reading::Tracked(tracked) = reading else {
            return None;
        };
        let ending = match self.pause(tracked, head).await {
            Ok((exchange, answer)) => self.went_on(exchange, &answer),
            Err(ending) => Some(ending),
        };
        if let Some(waiting) = pending {
            waiting.stall_at = Instant::now() + self.timeouts.client_stall;
        }
        ending
    }

    /// The client left mid-answer. One that leaves once the answer is over (the server said
    /// its last word, or says it within a moment of the client's data) had its answer.
    async fn left(&mut self, reading: &mut Reading) -> Ending {
        let over = reading.ended()
            || match self.place.exchange() {
                Some(exchange) if exchange.is_end_stream() => true,
                Some(exchange) if self.ttft.is_some() => matches!(
                    tokio::time::timeout(END_GRACE, exchange.frame()).await,
                    Ok(None)
                ),
                _ => false,
            };
        match over {
            true => self.end(reading).1,
            false => Ending::Quiet(Outcome::Reaped(Stage::Running)),
        }
    }

    pub(super) fn timed_out_ending(&self, which: Timeout) -> Ending {
        Ending::Told(self.timed_out(which))
    }

    /// Whether this request's class counts only answers that parse as JSON.
    pub(super) fn expects_json(&self) -> bool {
        self.class
            .as_ref()
            .is_some_and(|class| self.settings.expect_json.contains(class))
    }

    /// The first byte of the answer goes to the client now.
    pub(super) fn first_byte(&mut self) {
        let ttft = self.arrived.elapsed();
        self.ttft = Some(ttft);
        if let Some(class) = &self.class {
            // The risk detector reads recent TTFTs as they happen.
            self.shared.ttft.record(class, ttft);
        }
    }
}

/// The bytes of a data frame (a trailers frame carries none).
fn data_len(frame: &Frame<Bytes>) -> u64 {
    frame.data_ref().map_or(0, |data| data.len() as u64)
}
