//! Stopping a generation and going on with it later: what a request asks for, rewritten per
//! API so that the upstream streams its answer (guard keeps the text), and, after a
//! preemption, continues it where it stopped: the partial answer as an assistant prefill on
//! chat endpoints, appended to the prompt on completion endpoints, with the token budget cut
//! by what was generated. The client's own form is given back at the end (`whole_answer`).
//!
//! The body is rewritten as a JSON map: every field guard does not touch goes through as sent.

use bytes::Bytes;
use serde_json::{Map, Value, json};

use super::usage::Report;

/// The generation endpoints guard knows how to continue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/chat/completions`, `/chat/completions`: SSE, `choices[0].delta.content`.
    OpenAiChat,
    /// `/v1/completions`, `/completions`: SSE, `choices[0].text`.
    OpenAiCompletion,
    /// llama-server's `/completion`: SSE, `content`.
    LlamaCompletion,
    /// Ollama `/api/chat`: NDJSON, `message.content`.
    OllamaChat,
    /// Ollama `/api/generate`: NDJSON, `response`.
    OllamaGenerate,
}

impl Endpoint {
    /// The endpoint of a path as the upstream decodes it.
    pub fn of(path: &str) -> Option<Self> {
        match path {
            "/v1/chat/completions" | "/chat/completions" => Some(Self::OpenAiChat),
            "/v1/completions" | "/completions" => Some(Self::OpenAiCompletion),
            "/completion" => Some(Self::LlamaCompletion),
            "/api/chat" => Some(Self::OllamaChat),
            "/api/generate" => Some(Self::OllamaGenerate),
            _ => None,
        }
    }

    fn is_ollama(self) -> bool {
        matches!(self, Self::OllamaChat | Self::OllamaGenerate)
    }
}

/// How a class's preempted requests go on, as last seen (`/status`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ResumeKind {
    /// From the exact token ids (llama-server).
    Exact,
    /// From the partial answer's text.
    Text,
    /// From scratch (a client that has seen nothing yet).
    Restart,
    /// Not stopped (`preemptible = "exact-only"` where an exact resume is not available).
    Off,
}

/// How a preempted request goes on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Continuation {
    /// From where it stopped.
    Resume,
    /// From scratch: only where the client has seen nothing yet (it asked for one answer).
    Restart,
}

/// Fields that make a continuation unfaithful: the answer is constrained as a whole.
const CONSTRAINED: [&str; 8] = [
    "tools",
    "functions",
    "grammar",
    "json_schema",
    "response_format",
    "format",
    "logprobs",
    "n",
];

/// A preemptible request: its endpoint, its body, and whether its client streams.
#[derive(Clone, Debug)]
pub struct Plan {
    pub endpoint: Endpoint,
    /// The body as the client sent it: parsed again only when it is rewritten, so a waiting
    /// request holds its bytes (already counted against the body budget), not a tree of them.
    raw: Bytes,
    /// The client asked for a stream (else guard gives it one JSON answer at the end).
    pub client_streams: bool,
    pub continuation: Continuation,
}

impl Plan {
    /// The plan for a request, or None where it cannot be stopped and continued faithfully
    /// (`resume_only`: or restarted).
    pub fn of(path: &str, raw: &Bytes, resume_only: bool) -> Option<Self> {
        let endpoint = Endpoint::of(path)?;
        let body: Map<String, Value> = serde_json::from_slice(raw).ok()?;
        // Ollama streams unless told not to; the OpenAI-style APIs only when told to.
        let client_streams = match body.get("stream") {
            Some(Value::Bool(stream)) => *stream,
            _ => endpoint.is_ollama(),
        };
        let constrained = CONSTRAINED.iter().any(|key| {
            body.get(*key)
                .is_some_and(|v| !v.is_null() && *v != json!(1) && *v != json!(false))
        });
        let resumable = !constrained && prompt_is_text(endpoint, &body);
        let continuation = match (resumable, client_streams, resume_only) {
            (true, _, _) => Continuation::Resume,
            (false, false, false) => Continuation::Restart,
            _ => return None,
        };
        Some(Self {
            endpoint,
            raw: raw.clone(),
            client_streams,
            continuation,
        })
    }

    /// Whether llama-server can run it from token ids: not constrained, on an endpoint whose
    /// answer guard can frame (OpenAI chat and completions, llama-server's `/completion`).
    pub fn may_run_exactly(&self) -> bool {
        self.continuation == Continuation::Resume
            && matches!(
                self.endpoint,
                Endpoint::OpenAiChat | Endpoint::OpenAiCompletion | Endpoint::LlamaCompletion
            )
    }

    /// The client's body as a JSON map (it parsed when the plan was made).
    pub fn body(&self) -> Map<String, Value> {
        serde_json::from_slice(&self.raw).unwrap_or_default()
    }

    /// The body the upstream gets first: the client's, as a stream.
    pub fn first_body(&self) -> Bytes {
        let mut body = self.body();
        body.insert("stream".to_owned(), Value::Bool(true));
        Bytes::from(Value::Object(body).to_string())
    }

    /// The body that continues after `partial` (`generated` tokens of it); from scratch for a
    /// restart.
    pub fn continued_body(&self, partial: &str, generated: u64) -> Bytes {
        // Nothing generated yet is a fresh start: an empty prefill would itself be read as
        // the start of the answer.
        if self.continuation == Continuation::Restart || partial.is_empty() {
            return self.first_body();
        }
        let mut body = self.body();
        body.insert("stream".to_owned(), Value::Bool(true));
        match self.endpoint {
            Endpoint::OpenAiChat | Endpoint::OllamaChat => {
                if let Some(Value::Array(messages)) = body.get_mut("messages") {
                    messages.push(json!({ "role": "assistant", "content": partial }));
                }
            }
            Endpoint::OpenAiCompletion | Endpoint::LlamaCompletion | Endpoint::OllamaGenerate => {
                if let Some(Value::String(prompt)) = body.get_mut("prompt") {
                    prompt.push_str(partial);
                }
            }
        }
        for key in ["max_tokens", "max_completion_tokens", "n_predict"] {
            cut_budget(body.get_mut(key), generated);
        }
        if let Some(Value::Object(options)) = body.get_mut("options") {
            cut_budget(options.get_mut("num_predict"), generated);
        }
        Bytes::from(Value::Object(body).to_string())
    }
}

/// Whether the prompt can take the partial answer: chat messages, a text prompt (Ollama's
/// generate only raw, where guard's text is the model's whole input).
fn prompt_is_text(endpoint: Endpoint, body: &Map<String, Value>) -> bool {
    match endpoint {
        Endpoint::OpenAiChat | Endpoint::OllamaChat => {
            matches!(body.get("messages"), Some(Value::Array(_)))
        }
        Endpoint::OllamaGenerate => {
            matches!(body.get("prompt"), Some(Value::String(_)))
                && body.get("raw") == Some(&Value::Bool(true))
        }
        Endpoint::OpenAiCompletion | Endpoint::LlamaCompletion => {
            matches!(body.get("prompt"), Some(Value::String(_)))
        }
    }
}

/// Lowers a token budget by what was generated (at least 1 stays: the answer must end).
fn cut_budget(budget: Option<&mut Value>, generated: u64) {
    if let Some(value) = budget
        && let Some(n) = value.as_i64()
        && n > 0
    {
        let left = (n as u64).saturating_sub(generated).max(1);
        *value = json!(left);
    }
}

/// What the upstream's stream has said so far, over every segment of a preempted answer.
#[derive(Debug, Default)]
pub struct Transcript {
    pub text: String,
    /// Tokens generated over all segments (events with text, where the server does not say).
    pub generated: u64,
    pub prompt_tokens: Option<u64>,
    pub finish_reason: Option<String>,
    /// The stream said it was done (`finish_reason`, `stop`, `done`).
    pub ended: bool,
    /// Text the upstream repeats at the start of a continued segment (llama-server echoes an
    /// assistant prefill), still to be matched and dropped.
    echo: String,
    /// Tokens of the segments before this one (the server counts each segment alone).
    earlier: u64,
    /// Tokens this segment generated, as the server last said, or events with text.
    segment: u64,
    /// Whether the server reported a count for this segment.
    counted: bool,
}

/// One event of a stream, as far as the transcript reads it.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Event {
    /// The text to pass on (after any echo is dropped).
    pub text: String,
    /// Part of the event's text was an echo: the event must be rewritten before it is passed on.
    pub echoed: bool,
}

impl Transcript {
    /// A new segment begins after the text so far; `echoes`: the server repeats it first
    /// (llama-server does with an assistant prefill).
    pub fn continue_after(&mut self, echoes: bool) {
        if echoes {
            self.echo.clone_from(&self.text);
        }
        self.earlier += self.segment;
        self.segment = 0;
        self.counted = false;
        self.ended = false;
        self.finish_reason = None;
    }

    /// Reads one event's payload (the JSON of an SSE `data:` line or an NDJSON line).
    pub fn read(&mut self, payload: &[u8]) -> Option<Event> {
        let said = Report::parse(payload)?;
        let mut text = said.text().unwrap_or_default().to_owned();
        let mut echoed = false;
        if !self.echo.is_empty() && !text.is_empty() {
            let (rest, dropped) = drop_echo(&mut self.echo, &text);
            echoed = dropped > 0;
            text = rest;
        }
        if !text.is_empty() {
            self.text.push_str(&text);
            if !self.counted {
                self.segment += 1;
            }
        }
        let counts = said.usage(false);
        if let Some(count) = counts.generated {
            self.segment = count;
            self.counted = true;
        }
        self.generated = self.earlier + self.segment;
        if counts.prompt.is_some() {
            self.prompt_tokens = counts.prompt;
        }
        if let Some(reason) = said.finish() {
            self.finish_reason = Some(reason);
            self.ended = true;
        }
        Some(Event { text, echoed })
    }
}

/// Drops the start of `text` that repeats what is left of `echo`; returns the rest and how
/// many bytes were dropped. A mismatch ends the echo: the server did not repeat it.
fn drop_echo(echo: &mut String, text: &str) -> (String, usize) {
    let common = echo
        .bytes()
        .zip(text.bytes())
        .take_while(|(a, b)| a == b)
        .count();
    let whole = common == echo.len().min(text.len());
    if !whole || !text.is_char_boundary(common) {
        echo.clear();
        return (text.to_owned(), 0);
    }
    echo.drain(..common);
    (text[common..].to_owned(), common)
}

/// Whether an answer's text is one JSON value (what `expect = "json"` asks of a valid job).
pub fn is_json(text: &str) -> bool {
    serde_json::from_str::<serde::de::IgnoredAny>(text.trim()).is_ok()
}

/// An event with its text replaced (the echo of a prefill taken out).
pub fn rewrite_text(endpoint: Endpoint, payload: &[u8], text: &str) -> Option<Vec<u8>> {
    let mut event: Value = serde_json::from_slice(payload).ok()?;
    let pointer = match endpoint {
        Endpoint::OpenAiChat => "/choices/0/delta/content",
        Endpoint::OpenAiCompletion => "/choices/0/text",
        Endpoint::LlamaCompletion => "/content",
        Endpoint::OllamaChat => "/message/content",
        Endpoint::OllamaGenerate => "/response",
    };
    *event.pointer_mut(pointer)? = Value::String(text.to_owned());
    serde_json::to_vec(&event).ok()
}

/// The one JSON answer a client that did not stream gets, in its API's shape, with the whole
/// text and the tokens summed over every segment.
pub fn whole_answer(endpoint: Endpoint, model: &str, transcript: &Transcript) -> Bytes {
    let finish = transcript.finish_reason.as_deref().unwrap_or("stop");
    let (prompt, generated) = (transcript.prompt_tokens.unwrap_or(0), transcript.generated);
    let usage = json!({
        "prompt_tokens": prompt,
        "completion_tokens": generated,
        "total_tokens": prompt + generated,
    });
    let text = &transcript.text;
    let answer = match endpoint {
        Endpoint::OpenAiChat => json!({
            "id": "chatcmpl-guard",
            "created": jiff::Timestamp::now().as_second(),
            "object": "chat.completion",
            "model": model,
            "choices": [{
                "index": 0,
                "message": { "role": "assistant", "content": text },
                "finish_reason": finish,
            }],
            "usage": usage,
        }),
        Endpoint::OpenAiCompletion => json!({
            "id": "cmpl-guard",
            "created": jiff::Timestamp::now().as_second(),
            "object": "text_completion",
            "model": model,
            "choices": [{ "index": 0, "text": text, "finish_reason": finish }],
            "usage": usage,
        }),
        Endpoint::LlamaCompletion => json!({
            "content": text,
            "model": model,
            "stop": true,
            "stop_type": finish,
            "tokens_predicted": generated,
            "tokens_evaluated": prompt,
        }),
        Endpoint::OllamaChat => json!({
            "model": model,
            "message": { "role": "assistant", "content": text },
            "done": true,
            "done_reason": finish,
            "prompt_eval_count": prompt,
            "eval_count": generated,
        }),
        Endpoint::OllamaGenerate => json!({
            "model": model,
            "response": text,
            "done": true,
            "done_reason": finish,
            "prompt_eval_count": prompt,
            "eval_count": generated,
        }),
    };
    Bytes::from(answer.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chat_is_continued_with_its_answer_as_prefill_and_a_smaller_budget() {
        let body =
            br#"{"messages":[{"role":"user","content":"count"}],"max_tokens":10,"temperature":0}"#;
        let plan = Plan::of("/v1/chat/completions", &Bytes::copy_from_slice(body), true)
            .expect("resumable");
        assert!(!plan.client_streams);
        let first: Value = serde_json::from_slice(&plan.first_body()).expect("json");
        assert_eq!(first["stream"], true);
        assert_eq!(first["temperature"], 0);
        let next: Value = serde_json::from_slice(&plan.continued_body("1, 2,", 4)).expect("json");
        assert_eq!(
            next["messages"][1],
            json!({"role": "assistant", "content": "1, 2,"})
        );
        assert_eq!(next["max_tokens"], 6);
    }

    #[test]
    fn prompts_take_the_text_and_constrained_answers_are_not_resumed() {
        let plan = Plan::of(
            "/completion",
            &Bytes::from_static(br#"{"prompt":"Once","n_predict":5}"#),
            true,
        )
        .expect("resumable");
        let next: Value = serde_json::from_slice(&plan.continued_body(" upon", 9)).expect("json");
        assert_eq!(
            (next["prompt"].as_str(), next["n_predict"].as_u64()),
            (Some("Once upon"), Some(1))
        );
        // Ollama's templated generate, a grammar, a schema: not resumable.
        assert!(
            Plan::of(
                "/api/generate",
                &Bytes::from_static(br#"{"prompt":"x"}"#),
                true
            )
            .is_none()
        );
        let grammar = br#"{"prompt":"x","grammar":"root ::= \"a\""}"#;
        assert!(Plan::of("/completion", &Bytes::copy_from_slice(grammar), true).is_none());
        // Without resume-only, a client that waits for one answer can be restarted.
        let restart =
            Plan::of("/completion", &Bytes::copy_from_slice(grammar), false).expect("restartable");
        assert_eq!(restart.continuation, Continuation::Restart);
        assert_eq!(restart.continued_body("ab", 2), restart.first_body());
        assert!(
            Plan::of(
                "/api/embed",
                &Bytes::from_static(br#"{"input":"x"}"#),
                false
            )
            .is_none()
        );
    }

    #[test]
    fn a_continued_segment_drops_the_echoed_prefill_and_counts_on() {
        let mut transcript = Transcript::default();
        let e = Endpoint::OpenAiChat;
        let delta = |t: &str| format!(r#"{{"choices":[{{"delta":{{"content":"{t}"}}}}]}}"#);
        transcript.read(delta("1, 2,").as_bytes());
        transcript.read(br#"{"choices":[{"delta":{}}],"timings":{"predicted_n":3}}"#);
        assert_eq!(
            (transcript.text.as_str(), transcript.generated),
            ("1, 2,", 3)
        );
        transcript.continue_after(true);
        // llama-server repeats the prefill, merged with the first new token, split or not.
        let first = transcript.read(delta("1, ").as_bytes()).expect("event");
        assert_eq!(
            first,
            Event {
                text: String::new(),
                echoed: true
            }
        );
        let second = transcript.read(delta("2, 3").as_bytes()).expect("event");
        assert_eq!(
            second,
            Event {
                text: " 3".to_owned(),
                echoed: true
            }
        );
        transcript.read(
            br#"{"choices":[{"delta":{},"finish_reason":"stop"}],"timings":{"predicted_n":2}}"#,
        );
        assert_eq!(transcript.text, "1, 2, 3");
        assert_eq!(transcript.generated, 5);
        assert!(transcript.ended);
        let rewritten = rewrite_text(e, delta("2, 3").as_bytes(), " 3").expect("rewritten");
        let answer: Value = serde_json::from_slice(&rewritten).expect("json");
        assert_eq!(answer["choices"][0]["delta"]["content"], " 3");
        let whole: Value =
            serde_json::from_slice(&whole_answer(e, "m", &transcript)).expect("json");
        assert_eq!(whole["choices"][0]["message"]["content"], "1, 2, 3");
        assert_eq!(whole["usage"]["completion_tokens"], 5);
    }
}
