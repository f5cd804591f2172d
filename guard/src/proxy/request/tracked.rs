//! A preemptible request's state between its segments: its plan, how it goes on (from the
//! exact token ids on llama-server, or from its text), what the server read of its prompt, and
//! the reading of each event of its stream into what its client gets.

use bytes::Bytes;
use http::request;
use serde::Deserialize as _;
use serde_json::Value;

use crate::upstream::{
    exact::{Exact, Framer, Ids, Partial, SideWork, Timings},
    frames::{Lines, StreamFormat},
    resume::{self, Continuation, Endpoint, Plan, Transcript},
    usage::Usage,
};

/// How a preemptible request goes on after a pause.
pub(super) enum Engine {
    /// From the partial answer's text (or from scratch, per the plan).
    Text(Transcript),
    /// From the exact token ids, on llama-server.
    Exact(Box<ExactRun>),
}

/// An exact run: the request's ids, the answer's ids and text so far, and the client's framing.
pub(super) struct ExactRun {
    pub(super) exact: Exact,
    pub(super) ids: Ids,
    pub(super) framer: Framer,
    /// The server's last event (the end's fields for a `/completion` client's whole answer).
    pub(super) last: Value,
    decode_per_second: Option<f64>,
    /// Tokens the server generated after guard stopped reading a paused segment.
    pub(super) unseen: u64,
}

impl ExactRun {
    pub fn new(exact: Exact, framer: Framer) -> Self {
        Self {
            exact,
            ids: Ids::default(),
            framer,
            last: Value::Null,
            decode_per_second: None,
            unseen: 0,
        }
    }
}

/// What the server read of the prompt, over every segment (its own counts).
#[derive(Debug, Default)]
pub(super) struct PromptRead {
    computed: u64,
    cached: u64,
    /// Read anew by segments that went on after a preemption.
    reread: u64,
    known: bool,
    /// This segment's reading has been counted.
    counted: bool,
    /// This segment goes on after a preemption.
    resumed: bool,
    /// Tokens the server sampled for guard's own small requests (`SideWork`).
    sampled: u64,
}

impl PromptRead {
    /// Counts a segment's reading, once; returns what a continuation read again.
    pub(super) fn segment(&mut self, timings: Option<Timings>) -> u64 {
        let Some(timings) = timings.filter(|_| !self.counted) else {
            return 0;
        };
        let computed = timings.prompt_n.unwrap_or(0);
        self.computed += computed;
        self.cached += timings.cache_n.unwrap_or(0);
        self.known = true;
        self.counted = true;
        self.reread(if self.resumed { computed } else { 0 })
    }

    /// Tokens read again to go on; returns them.
    pub(super) fn reread(&mut self, tokens: u64) -> u64 {
        self.reread += tokens;
        tokens
    }

    /// One of guard's own small requests for this one: the server's work counts as the job's.
    pub(super) fn side(&mut self, work: SideWork) {
        self.computed += work.read;
        self.sampled += work.sampled;
        self.known = true;
    }

    pub(super) fn next_segment(&mut self) {
        self.counted = false;
        self.resumed = true;
    }
}

/// A preemptible request's plan and what its answer has said so far.
pub(super) struct Tracked {
    pub(super) plan: Plan,
    pub(super) engine: Engine,
    pub(super) lines: Lines,
    pub(super) format: StreamFormat,
    pub(super) read: PromptRead,
}

/// Why a stream cannot be relayed further.
pub(super) enum Broke {
    Diverged(crate::upstream::exact::Diverged),
    UpstreamSaid(String),
}

impl Tracked {
    pub fn new(plan: Plan, engine: Engine) -> Self {
        Self {
            plan,
            engine,
            lines: Lines::default(),
            format: StreamFormat::Whole,
            read: PromptRead::default(),
        }
    }

    /// How it goes on: "exact", "text" or "restart" (`guard_preempt_resumes_total`).
    pub fn kind(&self) -> &'static str {
        match (&self.engine, self.plan.continuation) {
            (Engine::Exact(_), _) => "exact",
            (Engine::Text(_), Continuation::Resume) => "text",
            (Engine::Text(_), Continuation::Restart) => "restart",
        }
    }

    /// The first request upstream: its head and body.
    pub fn first(&self, head: &request::Parts) -> (Option<request::Parts>, Bytes) {
        match &self.engine {
            Engine::Exact(run) => (Some(run.exact.head(head)), run.exact.segment(&[])),
            Engine::Text(_) => (None, self.plan.first_body()),
        }
    }

    /// Tokens generated so far (the scheduler's progress is told per token).
    pub(super) fn generated(&self) -> u64 {
        match &self.engine {
            Engine::Exact(run) => run.ids.generated(),
            Engine::Text(transcript) => transcript.generated,
        }
    }

    /// Reads a chunk of the stream; returns what goes to a streaming client, how many tokens
    /// it carried, and how many prompt tokens a continuation read again.
    pub(super) fn read(&mut self, chunk: &[u8]) -> Result<(Vec<u8>, u64, u64), Broke> {
        let Self {
            plan,
            engine,
            lines,
            format,
            read,
        } = self;
        let mut out = Vec::with_capacity(chunk.len());
        let (mut tokens, mut reread) = (0, 0);
        let mut broke = None;
        lines.push(chunk, |line| {
            if broke.is_some() {
                return;
            }
            let Some(payload) = format.payload(line) else {
                if let Engine::Text(_) = engine {
                    out.extend_from_slice(line);
                    out.push(b'\n');
                }
                return;
            };
            let read_one = match engine {
                Engine::Text(transcript) => Ok((
                    read_text(transcript, plan.endpoint, *format, line, payload, &mut out),
                    0,
                )),
                Engine::Exact(run) => read_exact(run, read, plan.client_streams, payload, &mut out),
            };
            match read_one {
                Ok((counted, again)) => {
                    tokens += counted;
                    reread += again;
                }
                Err(err) => broke = Some(err),
            }
        });
        match broke {
            Some(err) => Err(err),
            None => Ok((out, tokens, reread)),
        }
    }

    /// What the answer said of its tokens and end.
    pub(super) fn usage(&self) -> Usage {
        let read = &self.read;
        let (prompt_computed, prompt_cached) = match read.known {
            true => (Some(read.computed), Some(read.cached)),
            false => (None, None),
        };
        match &self.engine {
            Engine::Exact(run) => Usage {
                prompt: Some(run.exact.prompt_tokens()),
                prompt_computed,
                prompt_cached,
                // The server's own count: the answer's tokens, those it generated again after a
                // pause or after guard stopped reading, and those it sampled for guard's small
                // requests on its behalf (the client's usage counts only the answer's).
                generated: Some(
                    run.ids.generated() + run.ids.regenerated + run.unseen + read.sampled,
                ),
                decode_per_second: run.decode_per_second,
                ended: run.ids.stop_type.is_some(),
                load: None,
            },
            Engine::Text(transcript) => Usage {
                prompt: transcript.prompt_tokens,
                generated: Some(transcript.generated),
                ended: transcript.ended,
                ..Usage::default()
            },
        }
    }

    /// The whole answer, for a client that asked for one, in its API's shape.
    pub(super) fn whole(&self, model: &str) -> Vec<u8> {
        match &self.engine {
            Engine::Exact(run) => run.framer.whole(&run.last, &run.ids).into(),
            Engine::Text(transcript) => {
                resume::whole_answer(self.plan.endpoint, model, transcript).into()
            }
        }
    }

    /// The answer's text so far.
    pub(super) fn text(&self) -> &str {
        match &self.engine {
            Engine::Exact(run) => &run.ids.text,
            Engine::Text(transcript) => &transcript.text,
        }
    }

    /// Whether it may stop here. An exact run stops only once its segment has a token: the
    /// server finishes reading a prompt it has begun anyway, and a continuation from the
    /// prompt alone would have it evaluate the prompt's last token again on its own, whose
    /// result can differ in the last bits from the same token read with the rest (and so
    /// tip a near tie elsewhere); from a generated token, it evaluates that token on its own,
    /// as it did when it generated it.
    pub(super) fn may_stop(&self) -> bool {
        match &self.engine {
            Engine::Exact(run) => run.ids.segment_tokens() > 0,
            Engine::Text(_) => true,
        }
    }

    pub(super) fn ended(&self) -> bool {
        match &self.engine {
            Engine::Exact(run) => run.ids.stop_type.is_some(),
            Engine::Text(transcript) => transcript.ended,
        }
    }
}

/// One event of a text run: the transcript reads it, and an echoed prefill is taken out.
fn read_text(
    transcript: &mut Transcript,
    endpoint: Endpoint,
    format: StreamFormat,
    line: &[u8],
    payload: &[u8],
    out: &mut Vec<u8>,
) -> u64 {
    let event = transcript.read(payload);
    let counted = u64::from(event.as_ref().is_some_and(|e| !e.text.is_empty()));
    match event.filter(|e| e.echoed) {
        Some(event) => {
            let rewritten = resume::rewrite_text(endpoint, payload, &event.text);
            if format == StreamFormat::Sse {
                out.extend_from_slice(b"data: ");
            }
            out.extend_from_slice(rewritten.as_deref().unwrap_or(payload));
        }
        None => out.extend_from_slice(line),
    }
    out.push(b'\n');
    counted
}

/// One event of an exact run: its ids and text are followed, and the client's event framed.
fn read_exact(
    run: &mut ExactRun,
    read: &mut PromptRead,
    client_streams: bool,
    payload: &[u8],
    out: &mut Vec<u8>,
) -> Result<(u64, u64), Broke> {
    let Ok(raw) = serde_json::from_slice::<Value>(payload) else {
        return Ok((0, 0));
    };
    let event = Partial::deserialize(&raw).unwrap_or_default();
    if let Some(error) = &event.error {
        let message = error
            .get("message")
            .and_then(Value::as_str)
            .unwrap_or("error");
        return Err(Broke::UpstreamSaid(crate::quote::quote(message)));
    }
    if !read.resumed
        && !read.counted
        && let Some(timings) = event.timings
    {
        // What the client would have been told: the first reading's cache hits.
        run.framer.cached_tokens = timings.cache_n.unwrap_or(0);
    }
    let reread = read.segment(event.timings);
    if let Some(rate) = event.timings.and_then(|t| t.predicted_per_second) {
        run.decode_per_second = Some(rate);
    }
    let new = run.ids.read(&event).map_err(Broke::Diverged)?;
    if client_streams {
        out.extend(run.framer.stream(&raw, &new, &run.ids, event.stop));
    }
    if event.stop {
        run.last = raw;
    }
    Ok((event.tokens.len() as u64, reread))
}
