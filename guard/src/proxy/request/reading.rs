//! What guard reads of an answer on its way to the client: a plain answer passes as it came,
//! read for its tokens, its end and (where the class expects JSON) its text; a preemptible
//! one is read event by event (`tracked`), and its client gets what the reading makes of it.

use std::time::Duration;

use bytes::Bytes;
use http::{Response, header, response};
use http_body::Frame;

use super::{Ending, QueuedRequest, tracked::Tracked};
use crate::{
    metrics::labels::Model,
    proxy::{
        error::{ErrorShape, ProxyError},
        outcome::{FailKind, Outcome, Stage},
    },
    upstream::{
        frames::{self, Events, StreamFormat},
        full,
        resume::{self, Transcript},
        usage::{self, Usage},
    },
};

/// A single-document answer up to this size is kept whole to read its counts.
const WHOLE_BYTES: usize = 1 << 20;

/// How an answer is read on its way.
pub(super) enum Reading {
    Plain(Plain),
    Tracked(Tracked),
}

/// What is known of a plain answer.
pub(super) struct Plain {
    format: StreamFormat,
    /// The outcome if the upstream ends its answer: completed, or failed for a 5xx.
    end: Outcome,
    /// The upstream answered with a success status.
    success: bool,
    /// The end of the answer (all of a single document, up to `WHOLE_BYTES`): its counts, and
    /// for Ollama its load_duration, which tells a cold load.
    tail: Vec<u8>,
    /// The answer's text, read where the class expects JSON.
    text: Option<AnswerText>,
}

/// An answer's text, read event by event as it passes.
struct AnswerText {
    transcript: Transcript,
    events: Events,
}

impl Plain {
    pub(super) fn new(format: StreamFormat, head: &response::Parts, reads_text: bool) -> Self {
        Self {
            format,
            end: match head.status.is_server_error() {
                true => Outcome::Failed(FailKind::UpstreamError),
                false => Outcome::Completed,
            },
            success: head.status.is_success(),
            tail: Vec::new(),
            text: reads_text.then(|| AnswerText {
                transcript: Transcript::default(),
                events: Events::new(format),
            }),
        }
    }

    fn keep(&mut self, data: &[u8]) {
        if let Some(AnswerText { transcript, events }) = &mut self.text
            && self.format != StreamFormat::Whole
        {
            events.push(data, |payload| {
                transcript.read(payload);
            });
        }
        match self.format {
            StreamFormat::Whole if self.tail.len() + data.len() <= WHOLE_BYTES => {
                self.tail.extend_from_slice(data);
            }
            _ => frames::keep_tail(&mut self.tail, data),
        }
    }
}

impl Reading {
    pub(super) fn is_tracked(&self) -> bool {
        matches!(self, Self::Tracked(_))
    }

    /// Whether the answer may stop here for a preemption (see `Tracked::may_stop`).
    pub(super) fn may_stop(&self) -> bool {
        match self {
            Self::Plain(_) => false,
            Self::Tracked(tracked) => tracked.may_stop(),
        }
    }

    /// Whether the server has said its last word (for a plain answer, its body's end tells).
    pub(super) fn ended(&self) -> bool {
        match self {
            Self::Plain(_) => false,
            Self::Tracked(tracked) => tracked.ended(),
        }
    }
}

impl QueuedRequest {
    /// Reads one frame; returns what goes to the client for it.
    pub(super) fn read(
        &mut self,
        reading: &mut Reading,
        frame: Frame<Bytes>,
    ) -> Result<Option<Frame<Bytes>>, Ending> {
        let tracked = match reading {
            Reading::Plain(plain) => {
                if let Some(data) = frame.data_ref() {
                    self.advance(plain.format.count_tokens(data));
                    plain.keep(data);
                    if self.ttft.is_none() && !data.is_empty() {
                        self.first_byte();
                    }
                }
                return Ok(Some(frame));
            }
            Reading::Tracked(tracked) => tracked,
        };
        let Ok(data) = frame.into_data() else {
            return Ok(None);
        };
        let (out, tokens, reread) = match tracked.read(&data) {
            Ok(read) => read,
            Err(broke) => return Err(self.broke(tracked, broke)),
        };
        self.count_reread(reread);
        self.advance(tokens);
        if !tracked.plan.client_streams || out.is_empty() {
            return Ok(None);
        }
        if self.ttft.is_none() {
            self.first_byte();
        }
        Ok(Some(Frame::data(Bytes::from(out))))
    }

    /// The scheduler's progress is told per token.
    fn advance(&self, tokens: u64) {
        if let Some(permit) = self.place.permit() {
            permit.progress().advance(tokens);
        }
    }

    /// The upstream ended its answer: what it said of itself is read, and the last bytes guard
    /// sends of its own, if any, come back with the ending.
    pub(super) fn end(&mut self, reading: &mut Reading) -> (Option<Frame<Bytes>>, Ending) {
        match reading {
            Reading::Plain(plain) => (None, self.end_plain(plain)),
            Reading::Tracked(tracked) => self.end_tracked(tracked),
        }
    }

    fn end_plain(&mut self, plain: &mut Plain) -> Ending {
        if plain.end != Outcome::Completed {
            return Ending::Quiet(plain.end.clone());
        }
        let mut usage = usage::read(plain.format, &plain.tail);
        // A single document is whole when its body ended as framed.
        usage.ended = plain.success && (usage.ended || plain.format == StreamFormat::Whole);
        self.usage = Some(usage);
        if let Some(text) = &mut plain.text {
            if plain.format == StreamFormat::Whole {
                text.transcript.read(&plain.tail);
            }
            self.answer_is_json = Some(resume::is_json(&text.transcript.text));
        }
        if self.shape == ErrorShape::Ollama
            && let Some(load) = usage.load
        {
            self.note_cold_load(load);
        }
        Ending::Quiet(Outcome::Completed)
    }

    /// The whole answer goes to a client that asked for one; a streaming client gets the last
    /// line where it had no newline.
    fn end_tracked(&mut self, tracked: &mut Tracked) -> (Option<Frame<Bytes>>, Ending) {
        let mut last = None;
        if !tracked.lines.rest().is_empty()
            && let Ok((out, _, _)) = tracked.read(b"\n")
            && tracked.plan.client_streams
        {
            // It goes as it came.
            let out = out.strip_suffix(b"\n").unwrap_or(&out).to_vec();
            last = Some(Frame::data(Bytes::from(out)));
        }
        if self.expects_json() {
            self.answer_is_json = Some(resume::is_json(tracked.text()));
        }
        self.usage = Some(tracked.usage());
        if !tracked.ended() {
            // Cut short: never a whole answer passed off as complete.
            return (last, Ending::Told(ProxyError::Truncated));
        }
        if tracked.plan.client_streams {
            return (last, Ending::Quiet(Outcome::Completed));
        }
        let model = self.model.clone().unwrap_or_default();
        let whole = tracked.whole(&model);
        self.account.status = Some(200);
        self.account.bytes_out += whole.len() as u64;
        let mut response = Response::new(full(whole));
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/json"),
        );
        self.first_byte();
        let response = self.tag(response);
        match self.reply.send(response) {
            true => (None, Ending::Quiet(Outcome::Completed)),
            false => (None, Ending::Quiet(Outcome::Reaped(Stage::Running))),
        }
    }

    /// The answer cannot go on: the client gets a clean error in its API's shape, never a
    /// different answer passed off as whole.
    fn broke(&mut self, tracked: &Tracked, broke: super::tracked::Broke) -> Ending {
        use super::tracked::Broke;
        self.usage = Some(Usage {
            ended: false,
            ..tracked.usage()
        });
        let error = match broke {
            Broke::Diverged(diverged) => {
                tracing::warn!(class = ?self.class, %diverged, "a preempted answer could not go on exactly");
                ProxyError::Diverged(diverged)
            }
            Broke::UpstreamSaid(message) => ProxyError::UpstreamSaid(message),
        };
        // Not the upstream's own error answer: a streaming client is told in its stream.
        Ending::Told(error)
    }

    /// Ollama's answer says how long its model took to load: a long load is a cold load.
    fn note_cold_load(&self, load: Duration) {
        let model = self.model_label();
        let metrics = &self.shared.metrics;
        let by_model = Model { model };
        let last = metrics.model_last_load_seconds.of(&by_model);
        last.set(load.as_secs_f64());
        if load > self.settings.cold_load {
            metrics.model_cold_loads_total.of(&by_model).inc();
            tracing::info!(
                model,
                load_ms = load.as_millis() as u64,
                "cold load: the model was loaded for this request"
            );
        }
    }
}
