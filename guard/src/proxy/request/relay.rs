//! The relay phase: the answer's frames go to the client as they come, under the class's idle,
//! stall and duration limits, until the answer ends, is cut, or its client leaves.

use std::{pin::Pin, time::Duration};

use bytes::Bytes;
use http::{Response, header, response};
use http_body::Frame;
use http_body_util::BodyExt as _;

use super::{Ending, Interrupt, QueuedRequest};
use crate::{
    proxy::{
        client_body::{ClientBody, Feed, Offer},
        error::{ErrorShape, ProxyError},
        outcome::{FailKind, Outcome, Stage, Timeout},
    },
    upstream::{
        exchange::Exchange,
        frames::{self, Lines, StreamFormat},
        resume::{self, Transcript},
        strip_hop_by_hop, usage,
    },
};

/// How long a client that left after data waits for the upstream's end: an SSE client closes
/// on `data: [DONE]` a moment before the server's chunked terminator, and had its answer.
const END_GRACE: Duration = Duration::from_millis(50);

/// What the upstream side did next.
enum Next {
    Frame(Frame<Bytes>),
    End,
    Idle,
    Broken(hyper::Error),
    Interrupted(Interrupt),
}

/// What became of a frame handed to the client.
enum Delivery {
    Delivered,
    Stalled,
    Gone,
    Interrupted(Interrupt),
}

/// The answer's way to the client, and what is known of it.
pub(super) struct Relay {
    pub(super) feed: Feed,
    format: StreamFormat,
    /// The outcome if the upstream ends its answer: completed, or failed for a 5xx.
    end: Outcome,
    sent_data: bool,
    /// The end of the answer (all of a single document, up to `WHOLE_BYTES`): its counts, and
    /// for Ollama its load_duration, which tells a cold load.
    tail: Vec<u8>,
    /// The upstream answered with a success status.
    success: bool,
    /// The answer's text, read where the class expects JSON.
    text: Option<AnswerText>,
}

/// An answer's text, read event by event as it passes.
#[derive(Default)]
struct AnswerText {
    transcript: Transcript,
    lines: Lines,
}

impl AnswerText {
    fn push(&mut self, format: StreamFormat, data: &[u8]) {
        let Self { transcript, lines } = self;
        lines.push(data, |line| {
            if let Some(payload) = format.payload(line) {
                transcript.read(payload);
            }
        });
    }
}

/// A single-document answer up to this size is kept whole to read its counts.
const WHOLE_BYTES: usize = 1 << 20;

impl QueuedRequest {
    pub(super) async fn relay(&mut self, exchange: Exchange, mut head: response::Parts) -> Ending {
        strip_hop_by_hop(&mut head.headers);
        let format = StreamFormat::of(head.headers.get(header::CONTENT_TYPE));
        let head_success = head.status.is_success();
        let end = match head.status.is_server_error() {
            true => Outcome::Failed(FailKind::UpstreamError),
            false => Outcome::Completed,
        };
        let (body, feed) = ClientBody::channel(exchange.size_hint());
        self.exchange = Some(exchange);
        let response = self.tag(Response::from_parts(head, body.map_err(Into::into).boxed()));
        let sent = self
            .respond
            .take()
            .is_some_and(|respond| respond.send(response).is_ok());
        if !sent {
            return Ending::quiet(Outcome::Reaped(Stage::Running));
        }
        let mut relay = Relay {
            feed,
            format,
            end,
            sent_data: false,
            tail: Vec::new(),
            success: head_success,
            // Read where the class expects JSON, on an endpoint whose answers guard knows.
            text: (self.endpoint.is_some() && self.expects_json()).then(AnswerText::default),
        };
        // One interrupt future for the whole answer: frames are token-sized and many.
        let watch = self.watch();
        let interrupted = watch.interrupted();
        tokio::pin!(interrupted);
        let ending = loop {
            let next = self.next_frame(interrupted.as_mut()).await;
            let ending = match next {
                Next::Frame(frame) => self.pass(&mut relay, frame, interrupted.as_mut()).await,
                Next::End => Some(Ending::quiet(relay.end.clone())),
                Next::Idle => Some(self.timed_out_ending(Timeout::UpstreamIdle)),
                Next::Broken(err) => Some(Ending::new(
                    Outcome::Failed(FailKind::UpstreamReset),
                    ProxyError::UpstreamReset(err),
                )),
                Next::Interrupted(interrupt) => {
                    Some(self.interrupted_relay(&relay, interrupt).await)
                }
            };
            if let Some(ending) = ending {
                break ending;
            }
        };
        if ending.outcome == Outcome::Completed {
            let mut usage = usage::read(relay.format, &relay.tail);
            // A single document is whole when its body ended as framed.
            usage.ended = relay.success && (usage.ended || relay.format == StreamFormat::Whole);
            self.usage = Some(usage);
            if let Some(text) = &mut relay.text {
                if relay.format == StreamFormat::Whole {
                    text.transcript.read(&relay.tail);
                }
                self.answer_is_json = Some(resume::is_json(&text.transcript.text));
            }
            if self.shape == ErrorShape::Ollama
                && let Some(load) = usage.load
            {
                self.note_cold_load(load);
            }
        }
        self.relay = Some(relay);
        ending
    }

    /// The upstream's next frame, within the class's idle limit.
    async fn next_frame(&mut self, interrupted: Pin<&mut impl Future<Output = Interrupt>>) -> Next {
        let idle = self.timeouts.upstream_idle;
        let Some(exchange) = self.exchange.as_mut() else {
            return Next::End;
        };
        tokio::select! {
            biased;
            interrupt = interrupted => Next::Interrupted(interrupt),
            frame = tokio::time::timeout(idle, exchange.frame()) => match frame {
                Err(_) => Next::Idle,
                Ok(None) => Next::End,
                Ok(Some(Ok(frame))) => Next::Frame(frame),
                Ok(Some(Err(err))) => Next::Broken(err),
            },
        }
    }

    /// Hands one frame to the client; returns the ending if this was the last or it failed.
    async fn pass(
        &mut self,
        relay: &mut Relay,
        frame: Frame<Bytes>,
        interrupted: Pin<&mut impl Future<Output = Interrupt>>,
    ) -> Option<Ending> {
        if let Some(data) = frame.data_ref() {
            if let Some(permit) = &self.permit {
                permit.progress().advance(relay.format.count_tokens(data));
            }
            if let Some(text) = &mut relay.text
                && relay.format != StreamFormat::Whole
            {
                text.push(relay.format, data);
            }
            match relay.format {
                StreamFormat::Whole if relay.tail.len() + data.len() <= WHOLE_BYTES => {
                    relay.tail.extend_from_slice(data);
                }
                _ => frames::keep_tail(&mut relay.tail, data),
            }
            if !relay.sent_data && !data.is_empty() {
                relay.sent_data = true;
                self.first_byte();
            }
        }
        // A known length ends with its last data frame; hyper polls no further.
        let last = self.exchange.as_ref().is_some_and(Exchange::is_end_stream);
        match deliver(&relay.feed, frame, self.timeouts.client_stall, interrupted).await {
            Delivery::Delivered if last => Some(Ending::quiet(relay.end.clone())),
            Delivery::Delivered => None,
            Delivery::Stalled => Some(self.timed_out_ending(Timeout::ClientStall)),
            Delivery::Gone | Delivery::Interrupted(Interrupt::ClientGone) => {
                Some(Ending::quiet(Outcome::Reaped(Stage::Running)))
            }
            Delivery::Interrupted(Interrupt::MaxDuration) => {
                Some(self.timed_out_ending(Timeout::MaxDuration))
            }
        }
    }

    /// The client left or time ran out while guard waited for the upstream.
    async fn interrupted_relay(&mut self, relay: &Relay, interrupt: Interrupt) -> Ending {
        if interrupt == Interrupt::MaxDuration {
            return self.timed_out_ending(Timeout::MaxDuration);
        }
        // A client that had data and leaves just before the end had its whole answer: the
        // upstream is given a moment to say so. Anything else is a departure mid-answer.
        let ended = match self.exchange.as_mut() {
            Some(exchange) if exchange.is_end_stream() => true,
            Some(exchange) if relay.sent_data => {
                matches!(
                    tokio::time::timeout(END_GRACE, exchange.frame()).await,
                    Ok(None)
                )
            }
            _ => false,
        };
        match ended {
            true => Ending::quiet(relay.end.clone()),
            false => Ending::quiet(Outcome::Reaped(Stage::Running)),
        }
    }

    pub(super) fn timed_out_ending(&self, which: Timeout) -> Ending {
        Ending::new(
            Outcome::TimedOut {
                which,
                stage: Stage::Running,
            },
            self.timed_out(which),
        )
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
            self.proxy.ttft.record(class, ttft);
        }
    }

    /// Ollama's answer says how long its model took to load: a long load is a cold load.
    fn note_cold_load(&self, load: Duration) {
        let model = self
            .proxy
            .remote_models
            .model_label(self.model.as_deref().unwrap_or_default());
        let metrics = &self.proxy.metrics;
        metrics
            .model_last_load_seconds
            .with_label_values(&[model])
            .set(load.as_secs_f64());
        if load > self.settings.cold_load {
            metrics
                .model_cold_loads_total
                .with_label_values(&[model])
                .inc();
            tracing::info!(
                model,
                load_ms = load.as_millis() as u64,
                "cold load: the model was loaded for this request"
            );
        }
    }
}

impl Relay {
    /// The way to a client whose response has begun, for an answer that ends cleanly.
    pub(super) fn new(feed: Feed, format: StreamFormat) -> Self {
        Self {
            feed,
            format,
            end: Outcome::Completed,
            sent_data: false,
            tail: Vec::new(),
            success: true,
            text: None,
        }
    }

    /// Ends the client's answer as `outcome` calls for: cleanly after the upstream's own end,
    /// with the API's error event where the format has one, else cut.
    pub(super) fn finish(self, outcome: &Outcome, error: Option<&ProxyError>) {
        use crate::proxy::client_body::Finish;
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

/// Hands `frame` over, waiting at most `stall` for room, unless the request is interrupted.
async fn deliver(
    feed: &Feed,
    frame: Frame<Bytes>,
    stall: Duration,
    interrupted: Pin<&mut impl Future<Output = Interrupt>>,
) -> Delivery {
    // Room at once is the common case: no timer, no wait.
    let frame = match feed.try_send(frame) {
        Ok(()) => return Delivery::Delivered,
        Err(Offer::Gone) => return Delivery::Gone,
        Err(Offer::Full(frame)) => frame,
    };
    tokio::select! {
        biased;
        interrupt = interrupted => Delivery::Interrupted(interrupt),
        sent = tokio::time::timeout(stall, feed.send(frame)) => match sent {
            Ok(Ok(())) => Delivery::Delivered,
            Ok(Err(_)) => Delivery::Gone,
            Err(_) => Delivery::Stalled,
        },
    }
}
