//! What one event of a stream, or a whole answer, says, in every API's spelling: its text
//! (OpenAI `choices[0].delta.content`/`text`/`message.content`, llama-server `content`,
//! Ollama `message.content`/`response`), its end (a finish reason, `stop`, `done`) and its
//! tokens (OpenAI `usage`, llama-server `timings` and `/completion` counts, Ollama's counts).
//! The proxy's counts and the preemption transcript both read events here.

use serde::Deserialize;

use super::frames::StreamFormat;

/// What an answer reported of itself.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Usage {
    pub prompt: Option<u64>,
    /// Of the prompt: tokens the server read anew, and tokens it reused from its cache, as it
    /// said (llama-server `timings`, OpenAI `prompt_tokens_details`, Ollama's eval count).
    pub prompt_computed: Option<u64>,
    pub prompt_cached: Option<u64>,
    pub generated: Option<u64>,
    /// The steady decode rate the server measured (first token excluded), tokens a second.
    pub decode_per_second: Option<f64>,
    /// The server's own end marker was seen (`[DONE]`, a finish reason, `done`, `stop`).
    pub ended: bool,
    /// How long loading the model took (Ollama's `load_duration`), where the answer says.
    pub load: Option<std::time::Duration>,
}

/// One event or a whole answer, as far as guard reads it.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Report {
    usage: Option<OpenAiUsage>,
    timings: Option<Timings>,
    choices: Vec<Choice>,
    /// llama-server `/completion`.
    content: Option<String>,
    tokens_evaluated: Option<u64>,
    tokens_predicted: Option<u64>,
    stop: Option<bool>,
    stop_type: Option<String>,
    /// Ollama: `message` for chat, `response` for generate.
    message: Option<Text>,
    response: Option<String>,
    prompt_eval_count: Option<u64>,
    eval_count: Option<u64>,
    /// Nanoseconds.
    eval_duration: Option<u64>,
    load_duration: Option<u64>,
    done: Option<bool>,
    done_reason: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct Text {
    content: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct OpenAiUsage {
    prompt_tokens: Option<u64>,
    completion_tokens: Option<u64>,
    prompt_tokens_details: Option<PromptDetails>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct PromptDetails {
    cached_tokens: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct Timings {
    prompt_n: Option<u64>,
    cache_n: Option<u64>,
    predicted_n: Option<u64>,
    predicted_per_second: Option<f64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct Choice {
    finish_reason: Option<String>,
    /// A stream's event.
    delta: Option<Text>,
    /// A completion's text.
    text: Option<String>,
    /// A whole chat answer.
    message: Option<Text>,
}

impl Report {
    pub fn parse(bytes: &[u8]) -> Option<Self> {
        serde_json::from_slice(bytes).ok()
    }

    /// The text this event or answer carries.
    pub fn text(&self) -> Option<&str> {
        fn content(text: &Option<Text>) -> Option<&str> {
            text.as_ref()?.content.as_deref()
        }
        self.choices
            .first()
            .and_then(|c| {
                content(&c.delta)
                    .or(c.text.as_deref())
                    .or(content(&c.message))
            })
            .or(self.content.as_deref())
            .or(content(&self.message))
            .or(self.response.as_deref())
    }

    /// Why the answer ended, where this event says it did.
    pub fn finish(&self) -> Option<String> {
        let stopped = |flag: Option<bool>, reason: &Option<String>| {
            (flag == Some(true)).then(|| reason.clone().unwrap_or_else(|| "stop".to_owned()))
        };
        self.choices
            .first()
            .and_then(|c| c.finish_reason.clone())
            .or_else(|| stopped(self.stop, &self.stop_type))
            .or_else(|| stopped(self.done, &self.done_reason))
    }

    /// Its counts; `ended` where the end was seen elsewhere (`[DONE]`, a whole document).
    pub fn usage(&self, ended: bool) -> Usage {
        let timings = self.timings.as_ref();
        let usage = self.usage.as_ref();
        let ollama_rate = match (self.eval_count, self.eval_duration) {
            (Some(n), Some(ns)) if ns > 0 => Some(n as f64 / (ns as f64 / 1e9)),
            _ => None,
        };
        let prompt = usage
            .and_then(|u| u.prompt_tokens)
            .or(timings.and_then(|t| t.prompt_n))
            .or(self.tokens_evaluated)
            .or(self.prompt_eval_count);
        let cached = timings.and_then(|t| t.cache_n).or(usage
            .and_then(|u| u.prompt_tokens_details.as_ref())
            .and_then(|d| d.cached_tokens));
        let computed = timings
            .and_then(|t| t.prompt_n)
            .or(cached.zip(prompt).map(|(c, p)| p.saturating_sub(c)))
            .or(self.prompt_eval_count);
        Usage {
            prompt,
            prompt_computed: computed,
            prompt_cached: cached,
            generated: usage
                .and_then(|u| u.completion_tokens)
                .or(timings.and_then(|t| t.predicted_n))
                .or(self.tokens_predicted)
                .or(self.eval_count),
            decode_per_second: timings.and_then(|t| t.predicted_per_second).or(ollama_rate),
            ended: ended || self.finish().is_some(),
            load: self.load_duration.map(std::time::Duration::from_nanos),
        }
    }
}

/// What the end of an answer (`tail`: its last bytes, or the whole of a single document) says.
pub fn read(format: StreamFormat, tail: &[u8]) -> Usage {
    let parse = Report::parse;
    match format {
        StreamFormat::Whole => parse(tail).map_or_else(Usage::default, |r| r.usage(true)),
        StreamFormat::Ndjson | StreamFormat::Sse => {
            let lines: Vec<&[u8]> = tail
                .split(|b| *b == b'\n')
                .map(<[u8]>::trim_ascii)
                .filter(|l| !l.is_empty())
                .collect();
            let done = format == StreamFormat::Sse && lines.last() == Some(&&b"data: [DONE]"[..]);
            lines
                .iter()
                .rev()
                .filter_map(|line| format.payload(line))
                .find_map(parse)
                .map_or(
                    Usage {
                        ended: done,
                        ..Usage::default()
                    },
                    |r| r.usage(done),
                )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_api_says_its_counts_its_own_way() {
        let llama = b"data: {\"choices\":[{\"finish_reason\":\"stop\",\"delta\":{}}],\"usage\":{\"prompt_tokens\":30,\"completion_tokens\":12,\"prompt_tokens_details\":{\"cached_tokens\":21}},\"timings\":{\"cache_n\":21,\"prompt_n\":9,\"predicted_n\":12,\"predicted_per_second\":80.5}}\n\ndata: [DONE]\n\n";
        let usage = read(StreamFormat::Sse, llama);
        assert_eq!(
            usage,
            Usage {
                prompt: Some(30),
                prompt_computed: Some(9),
                prompt_cached: Some(21),
                generated: Some(12),
                decode_per_second: Some(80.5),
                ended: true,
                load: None,
            }
        );
        let cut = b"data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n";
        assert!(!read(StreamFormat::Sse, cut).ended);
        let ollama = b"{\"response\":\"a\",\"done\":false}\n{\"response\":\"\",\"done\":true,\"prompt_eval_count\":5,\"eval_count\":10,\"eval_duration\":500000000,\"load_duration\":1500000000}\n";
        let usage = read(StreamFormat::Ndjson, ollama);
        assert_eq!(
            (
                usage.generated,
                usage.decode_per_second,
                usage.ended,
                usage.load
            ),
            (
                Some(10),
                Some(20.0),
                true,
                Some(std::time::Duration::from_millis(1500))
            )
        );
        assert_eq!(
            (usage.prompt_computed, usage.prompt_cached),
            (Some(5), None),
            "Ollama says what it evaluated, not what it reused"
        );
        let whole = br#"{"choices":[{"message":{"content":"x"},"finish_reason":"length"}],"usage":{"prompt_tokens":30,"completion_tokens":4,"prompt_tokens_details":{"cached_tokens":26}}}"#;
        let usage = read(StreamFormat::Whole, whole);
        assert_eq!(usage.generated, Some(4));
        assert_eq!(
            (usage.prompt_computed, usage.prompt_cached),
            (Some(4), Some(26))
        );
        assert!(
            !read(StreamFormat::Whole, b"{\"choi").ended,
            "a cut document"
        );
    }
}
