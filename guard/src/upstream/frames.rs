//! Streamed answers, event by event, in one place: SSE (OpenAI-style servers, llama-server)
//! and NDJSON (Ollama). The proxy counts tokens and keeps an answer's end with it; the logbook
//! reads each event's text.
//!
//! Everything here only reads: the bytes relayed to a client are the upstream's own. [`Events`]
//! reads whole events (SSE through the `sse-stream` parser, so an event of several `data:`
//! lines is one payload); [`Lines`] with [`StreamFormat::payload`] reads line by line, for the
//! callers that pass an answer on line by line.

use std::{
    convert::Infallible,
    pin::Pin,
    sync::mpsc,
    task::{Context, Poll, Waker},
};

use bytes::Bytes;
use futures_util::Stream;

/// How much of an answer's end is kept to read its final event.
pub const TAIL_BYTES: usize = 2_048;

/// The form of a streamed answer, which also decides how an error is told mid-stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamFormat {
    /// `text/event-stream`: `data: {...}` events.
    Sse,
    /// `application/x-ndjson`: one JSON object a line.
    Ndjson,
    /// Anything else, such as one JSON document.
    Whole,
}

impl StreamFormat {
    pub fn of(content_type: Option<&http::HeaderValue>) -> Self {
        let media = content_type
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split(';').next())
            .map(|v| v.trim().to_ascii_lowercase());
        match media.as_deref() {
            Some("text/event-stream") => Self::Sse,
            Some("application/x-ndjson") => Self::Ndjson,
            _ => Self::Whole,
        }
    }

    /// Tokens in a chunk of this stream: one per event or line.
    pub fn count_tokens(self, data: &[u8]) -> u64 {
        let lines = data.iter().filter(|b| **b == b'\n').count() as u64;
        match self {
            // `data: {...}\n\n`: two newlines an event.
            Self::Sse => lines / 2,
            Self::Ndjson => lines,
            Self::Whole => 0,
        }
    }

    /// The JSON payload of one line of this stream: the line itself for NDJSON, what follows
    /// `data:` for SSE (not the `[DONE]` marker, nor comments and other fields).
    pub fn payload(self, line: &[u8]) -> Option<&[u8]> {
        let line = line.trim_ascii();
        match self {
            Self::Ndjson | Self::Whole => (!line.is_empty()).then_some(line),
            Self::Sse => {
                let data = line.strip_prefix(b"data:")?.trim_ascii_start();
                (data != b"[DONE]" && !data.is_empty()).then_some(data)
            }
        }
    }
}

/// Splits a stream's chunks into complete lines, as they arrive.
#[derive(Debug, Default)]
pub struct Lines {
    pending: Vec<u8>,
}

impl Lines {
    /// Adds a chunk; calls `line` with each line it completes.
    pub fn push(&mut self, chunk: &[u8], mut line: impl FnMut(&[u8])) {
        self.pending.extend_from_slice(chunk);
        let mut start = 0;
        while let Some(end) = self.pending[start..].iter().position(|b| *b == b'\n') {
            line(&self.pending[start..start + end]);
            start += end + 1;
        }
        self.pending.drain(..start);
    }

    /// What is left without a newline (an answer that was not a stream, say).
    pub fn rest(&self) -> &[u8] {
        &self.pending
    }
}

/// Reads a stream's events as its chunks arrive, however they are cut: SSE events as the
/// standard says (several `data:` lines joined with `\n`; comments, `event:`, `id:` and
/// `retry:` read and left aside; LF, CRLF or CR line ends), an NDJSON or other answer a line at
/// a time.
pub struct Events {
    reader: Reader,
}

enum Reader {
    Sse(SseReader),
    Lines(Lines),
}

impl Events {
    pub fn new(format: StreamFormat) -> Self {
        let reader = match format {
            StreamFormat::Sse => Reader::Sse(SseReader::new()),
            StreamFormat::Ndjson | StreamFormat::Whole => Reader::Lines(Lines::default()),
        };
        Self { reader }
    }

    /// Reads a chunk; calls `payload` with the JSON payload of each event it completes: SSE
    /// data (not the `[DONE]` marker, nor an event without data), or a non-empty line.
    pub fn push(&mut self, chunk: &[u8], mut payload: impl FnMut(&[u8])) {
        match &mut self.reader {
            Reader::Sse(reader) => reader.push(chunk, |data| {
                let data = data.trim_ascii();
                if !data.is_empty() && data != b"[DONE]" {
                    payload(data);
                }
            }),
            Reader::Lines(lines) => lines.push(chunk, |line| {
                if let Some(line) = StreamFormat::Ndjson.payload(line) {
                    payload(line);
                }
            }),
        }
    }
}

/// `sse-stream`'s decoder, which reads a stream, fed one chunk at a time: each chunk is queued
/// for it, and it is polled until it wants more. It never waits on the queue, so a waker that
/// does nothing serves.
struct SseReader {
    feed: mpsc::Sender<Bytes>,
    events: sse_stream::SseByteStream<Feed>,
}

/// The chunks queued for the decoder; pending while there is none.
struct Feed(mpsc::Receiver<Bytes>);

impl Stream for Feed {
    type Item = Result<Bytes, Infallible>;

    fn poll_next(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        match self.0.try_recv() {
            Ok(chunk) => Poll::Ready(Some(Ok(chunk))),
            Err(mpsc::TryRecvError::Empty) => Poll::Pending,
            Err(mpsc::TryRecvError::Disconnected) => Poll::Ready(None),
        }
    }
}

impl SseReader {
    fn new() -> Self {
        let (feed, queue) = mpsc::channel();
        Self {
            feed,
            events: sse_stream::SseByteStream::new(Feed(queue)),
        }
    }

    fn push(&mut self, chunk: &[u8], mut data: impl FnMut(&[u8])) {
        if chunk.is_empty() || self.feed.send(Bytes::copy_from_slice(chunk)).is_err() {
            return;
        }
        let mut cx = Context::from_waker(Waker::noop());
        loop {
            match Pin::new(&mut self.events).poll_next(&mut cx) {
                Poll::Ready(Some(Ok(event))) => {
                    if let Some(text) = &event.data {
                        data(text.as_bytes());
                    }
                }
                // The decoder stops at what is not UTF-8: reading goes on from the next chunk
                // (the bytes relayed are untouched either way).
                Poll::Ready(Some(Err(_)) | None) => {
                    *self = Self::new();
                    return;
                }
                Poll::Pending => return,
            }
        }
    }
}

/// Keeps the last `TAIL_BYTES` of an answer.
pub fn keep_tail(tail: &mut Vec<u8>, chunk: &[u8]) {
    tail.extend_from_slice(chunk);
    if tail.len() > TAIL_BYTES {
        tail.drain(..tail.len() - TAIL_BYTES);
    }
}

/// The last complete line of a tail (an NDJSON answer's final object).
pub fn last_line(tail: &[u8]) -> Option<&[u8]> {
    tail.trim_ascii_end()
        .rsplit(|b| *b == b'\n')
        .next()
        .filter(|line| !line.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_come_whole_across_chunks() {
        let mut lines = Lines::default();
        let mut seen = Vec::new();
        for chunk in [&b"data: {\"a\""[..], b":1}\n\ndata: [DONE]\n", b"\n"] {
            lines.push(chunk, |l| {
                seen.push(String::from_utf8_lossy(l).into_owned())
            });
        }
        assert_eq!(seen, ["data: {\"a\":1}", "", "data: [DONE]", ""]);
        let payloads: Vec<_> = seen
            .iter()
            .filter_map(|l| StreamFormat::Sse.payload(l.as_bytes()))
            .collect();
        assert_eq!(payloads, [b"{\"a\":1}"]);
    }

    #[test]
    fn the_tail_keeps_the_end_and_its_last_line() {
        let mut tail = Vec::new();
        keep_tail(&mut tail, &vec![b'x'; TAIL_BYTES]);
        keep_tail(&mut tail, b"\n{\"done\":true}\n");
        assert_eq!(tail.len(), TAIL_BYTES);
        assert_eq!(last_line(&tail), Some(&b"{\"done\":true}"[..]));
    }

    /// Every payload `Events` reads from `stream`, cut into chunks at `cuts`.
    fn events_in(format: StreamFormat, stream: &[u8], cuts: &[usize]) -> Vec<String> {
        let mut events = Events::new(format);
        let mut seen = Vec::new();
        let mut start = 0;
        for end in cuts.iter().copied().chain([stream.len()]) {
            events.push(&stream[start..end], |payload| {
                seen.push(String::from_utf8_lossy(payload).into_owned())
            });
            start = end;
        }
        seen
    }

    #[test]
    fn an_sse_event_of_several_data_lines_is_one_payload_however_it_is_cut() {
        for newline in ["\n", "\r\n", "\r"] {
            let stream = [
                ": keep-alive",
                "event: message",
                "id: 7",
                "data: {\"choices\":",
                "data:  [{\"delta\":{\"content\":\"Hi\"}}]}",
                "",
                "retry: 10",
                "",
                "data: [DONE]",
                "",
                "",
            ]
            .join(newline);
            let stream = stream.as_bytes();
            let want = ["{\"choices\":\n [{\"delta\":{\"content\":\"Hi\"}}]}"];
            assert_eq!(
                events_in(StreamFormat::Sse, stream, &[]),
                want,
                "{newline:?}"
            );
            for cut in 0..=stream.len() {
                let seen = events_in(StreamFormat::Sse, stream, &[cut]);
                assert_eq!(seen, want, "{newline:?} cut at {cut}");
            }
            let every_byte: Vec<usize> = (1..stream.len()).collect();
            let seen = events_in(StreamFormat::Sse, stream, &every_byte);
            assert_eq!(seen, want, "{newline:?} a byte at a time");
            let json: serde_json::Value = serde_json::from_str(&seen[0]).expect("one JSON value");
            assert_eq!(json["choices"][0]["delta"]["content"], "Hi");
        }
    }

    #[test]
    fn sse_events_follow_one_another_and_a_bad_one_does_not_stop_the_reading() {
        let stream = b"data: 1\n\ndata: 2\n\n";
        assert_eq!(events_in(StreamFormat::Sse, stream, &[9]), ["1", "2"]);
        // An event is read when its blank line comes, not when the next bytes do.
        for ending in [&b"data: 1\r\r"[..], b"data: 1\r\n\r\n", b"data: 1\n\n"] {
            assert_eq!(
                events_in(StreamFormat::Sse, ending, &[]),
                ["1"],
                "{ending:?}"
            );
        }
        // An event that is not UTF-8: the next chunk's events are still read.
        let mut events = Events::new(StreamFormat::Sse);
        let mut seen = Vec::new();
        for chunk in [&b"data: \xff\xfe\n\n"[..], b"data: 3\n\n"] {
            events.push(chunk, |p| seen.push(p.to_vec()));
        }
        assert_eq!(seen, [b"3"]);
    }

    #[test]
    fn ndjson_events_are_lines() {
        fn sent_between_tasks<T: Send>() {}
        sent_between_tasks::<Events>();
        let stream = b"{\"a\":1}\n\n{\"b\":2}\n{\"c\"";
        let seen = events_in(StreamFormat::Ndjson, stream, &[3, 9]);
        assert_eq!(seen, ["{\"a\":1}", "{\"b\":2}"]);
    }

    #[test]
    fn tokens_are_events_or_lines() {
        assert_eq!(StreamFormat::Sse.count_tokens(b"data: a\n\ndata: b\n\n"), 2);
        assert_eq!(StreamFormat::Ndjson.count_tokens(b"{}\n{}\n"), 2);
        assert_eq!(StreamFormat::Whole.count_tokens(b"{}\n"), 0);
    }
}
