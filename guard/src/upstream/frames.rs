//! Streamed answers, event by event, in one place: SSE (OpenAI-style servers, llama-server)
//! and NDJSON (Ollama). The proxy counts tokens and keeps an answer's end with it; the logbook
//! reads each event's text.

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

    #[test]
    fn tokens_are_events_or_lines() {
        assert_eq!(StreamFormat::Sse.count_tokens(b"data: a\n\ndata: b\n\n"), 2);
        assert_eq!(StreamFormat::Ndjson.count_tokens(b"{}\n{}\n"), 2);
        assert_eq!(StreamFormat::Whole.count_tokens(b"{}\n"), 0);
    }
}
