//! Exact resume on llama-server: a preemptible request runs as token ids through its
//! `/completion`, so that after a preemption it goes on from the very tokens it stopped at
//! (the prompt as the server tokenised it, then every generated id), never from re-tokenised
//! text. The server's prompt cache holds the state, so a resume reads almost nothing again.
//!
//! `prepare` asks the server for the prompt's ids (chat messages through its own template);
//! `Ids` follows the stream's ids and text across segments; `Framer` gives the client its
//! answer in its own API's shape.

use std::hash::{BuildHasher as _, RandomState};

use bytes::Bytes;
use http::{HeaderMap, Method, Request, header};
use http_body_util::BodyExt as _;
use serde::Deserialize;
use serde_json::{Map, Value, json};

use super::{Client, client::UpstreamError, resume::Endpoint};

/// Where every segment of an exact request goes.
pub const COMPLETION_PATH: &str = "/completion";

/// Fields of the client's body that guard sets itself, or that `/completion` must not see.
const REPLACED: [&str; 8] = [
    "messages",
    "prompt",
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "n_predict",
    "return_tokens",
];

/// Why a request cannot run exactly.
#[derive(Debug, thiserror::Error)]
pub enum ExactError {
    #[error("the upstream has no {path} (status {status}): not llama-server")]
    NotLlama { path: &'static str, status: u16 },
    #[error("the upstream did not answer {path}")]
    Unreachable {
        path: &'static str,
        #[source]
        source: UpstreamError,
    },
    #[error("the upstream's answer to {path} could not be read")]
    Unreadable {
        path: &'static str,
        #[source]
        source: super::BoxError,
    },
    #[error("the prompt is not text or token ids")]
    PromptShape,
}

/// A request that can run and go on exactly: its prompt's ids and the fields that steer it.
#[derive(Debug)]
pub struct Exact {
    /// What the server calls its model and build, for the client's framing.
    pub names: Names,
    prompt: Vec<u32>,
    /// The client's fields as `/completion` reads them (llama-server's chat endpoint copies
    /// them through the same way).
    fields: Map<String, Value>,
    /// The most tokens the client asked for.
    budget: Option<u64>,
    /// Headers the server's key check reads (`--api-key`).
    auth: HeaderMap,
    /// The prompt is the server's chat template's rendering.
    templated: bool,
}

#[derive(Deserialize)]
struct Template {
    prompt: String,
}

#[derive(Default, Deserialize)]
#[serde(default)]
struct Flushed {
    timings: Timings,
    tokens_predicted: u64,
}

impl Flushed {
    fn work(&self) -> SideWork {
        SideWork {
            read: self.timings.prompt_n.unwrap_or(0),
            sampled: self.tokens_predicted,
        }
    }
}

/// What the server did for one of guard's own small requests: tokens it read, and tokens it
/// sampled (with no budget it still samples one), each in its own counters.
#[derive(Clone, Copy, Debug, Default)]
pub struct SideWork {
    pub read: u64,
    pub sampled: u64,
}

#[derive(Deserialize)]
struct Tokens {
    tokens: Vec<u32>,
}

impl Exact {
    /// Asks llama-server for the ids of the request's prompt: chat messages through
    /// `/apply-template` (the server's own template), text through `/tokenize`, exactly as its
    /// completion endpoint tokenises a prompt (special tokens added and parsed).
    pub async fn prepare(
        client: &Client,
        headers: &HeaderMap,
        endpoint: Endpoint,
        body: &Map<String, Value>,
    ) -> Result<Self, ExactError> {
        let auth = auth_headers(headers);
        let text = match (endpoint, body.get("prompt")) {
            (Endpoint::OpenAiChat, _) => {
                let template: Template = post(
                    client,
                    &auth,
                    "/apply-template",
                    &Value::Object(body.clone()),
                )
                .await?;
                template.prompt
            }
            (Endpoint::OpenAiCompletion | Endpoint::LlamaCompletion, Some(Value::String(p))) => {
                p.clone()
            }
            _ => return Err(ExactError::PromptShape),
        };
        let question = json!({ "content": text, "add_special": true, "parse_special": true });
        let Tokens { tokens: prompt } = post(client, &auth, "/tokenize", &question).await?;
        let mut fields = body.clone();
        let budget = ["n_predict", "max_completion_tokens", "max_tokens"]
            .iter()
            .find_map(|key| fields.get(*key).and_then(Value::as_i64))
            .and_then(|n| u64::try_from(n).ok());
        for key in REPLACED {
            fields.remove(key);
        }
        // The chat endpoint takes one stop word as a string; `/completion` reads a list.
        if let Some(Value::String(stop)) = fields.get("stop") {
            let list = json!([stop]);
            fields.insert("stop".to_owned(), list);
        }
        let names = get_names(client, &auth).await;
        Ok(Self {
            names,
            prompt,
            fields,
            budget,
            auth,
            templated: endpoint == Endpoint::OpenAiChat,
        })
    }

    /// Before a segment: has the server put what its slot holds (the urgent request's state)
    /// into its prompt cache, so that the segment finds its own state there (a first segment,
    /// whatever of its prompt the cache holds).
    /// llama-server looks in that cache only for a slot it takes by least recent use, or one
    /// whose tokens it is about to lose mostly; a slot holding a prompt that shares a prefix
    /// with the continuation (a chat template's system prompt) is kept, the rest of the
    /// continuation read anew: tokens generated one by one then read in a batch, whose
    /// results can differ in their last bits. One token that no prompt here begins with
    /// makes it save the slot and take it afresh. Returns what the server did for it.
    pub async fn flush(&self, client: &Client) -> Result<SideWork, ExactError> {
        let question = json!({ "prompt": [self.filler()], "n_predict": 0, "cache_prompt": true });
        let answer: Flushed = post(client, &self.auth, COMPLETION_PATH, &question).await?;
        Ok(answer.work())
    }

    /// When it stops: makes its state in the server's slot one the urgent request cannot take.
    /// llama-server hands a new request the cached state it shares the most with, where that
    /// request would keep at least a quarter of it, and keeps the state only in that request's
    /// slot (a chat shares the template's system prompt with every other chat): a short job's
    /// state would be taken and cut down to that prefix. Padded past four times the prefix a
    /// chat shares (and within four times its own tokens, so that its continuation still
    /// finds it), it is put aside instead. Returns what the server did for it (nothing where
    /// no padding is needed).
    pub async fn pad(&self, client: &Client, generated: &[u32]) -> Result<SideWork, ExactError> {
        let shared = self.shared_prefix(client).await?;
        let own = self.prompt.len() + generated.len();
        let wanted = (4 * shared + 1).min(4 * own);
        if wanted <= own {
            return Ok(SideWork::default());
        }
        let filler = self.filler();
        let ids: Vec<u32> = self
            .prompt
            .iter()
            .chain(generated)
            .copied()
            .chain(std::iter::repeat_n(filler, wanted - own))
            .collect();
        let question = json!({ "prompt": ids, "n_predict": 0, "cache_prompt": true });
        let answer: Flushed = post(client, &self.auth, COMPLETION_PATH, &question).await?;
        Ok(answer.work())
    }

    /// The tokens of this prompt that any chat through the server's template begins with
    /// (none for a prompt the template did not make).
    async fn shared_prefix(&self, client: &Client) -> Result<usize, ExactError> {
        if !self.templated {
            return Ok(0);
        }
        let empty = json!({ "messages": [{ "role": "user", "content": "" }] });
        let Template { prompt } = post(client, &self.auth, "/apply-template", &empty).await?;
        let question = json!({ "content": prompt, "add_special": true, "parse_special": true });
        let Tokens { tokens } = post(client, &self.auth, "/tokenize", &question).await?;
        Ok(tokens
            .iter()
            .zip(&self.prompt)
            .take_while(|(a, b)| a == b)
            .count())
    }

    /// A token no prompt here begins with.
    fn filler(&self) -> u32 {
        match self.prompt.first() {
            Some(first) if *first > 0 => first - 1,
            _ => 1,
        }
    }

    /// Tokens in the prompt, as the server counts them.
    pub fn prompt_tokens(&self) -> u64 {
        self.prompt.len() as u64
    }

    /// The body of a segment that goes on after `generated` (none: the first): the prompt's
    /// ids and the generated ones, with the budget cut by what was generated. Every event
    /// carries its timings, so that a segment's prompt reading is known before it ends.
    pub fn segment(&self, generated: &[u32]) -> Bytes {
        let mut body = self.fields.clone();
        let ids: Vec<Value> = self
            .prompt
            .iter()
            .chain(generated)
            .map(|id| Value::from(*id))
            .collect();
        body.insert("prompt".to_owned(), Value::Array(ids));
        body.insert("stream".to_owned(), Value::Bool(true));
        body.insert("cache_prompt".to_owned(), Value::Bool(true));
        body.insert("timings_per_token".to_owned(), Value::Bool(true));
        if let Some(budget) = self.budget {
            // At least one: a budget spent would read as "no limit".
            let left = budget.saturating_sub(generated.len() as u64).max(1);
            body.insert("n_predict".to_owned(), Value::from(left));
        }
        Bytes::from(Value::Object(body).to_string())
    }

    /// The request head of a segment: the client's own headers, to `/completion`.
    pub fn head(&self, client_head: &http::request::Parts) -> http::request::Parts {
        let (mut head, ()) = Request::new(()).into_parts();
        head.method = Method::POST;
        head.uri = http::Uri::from_static(COMPLETION_PATH);
        head.headers = client_head.headers.clone();
        head.headers.insert(
            header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/json"),
        );
        head
    }
}

/// What the server calls its model and build (answered from its cache, asleep or not).
async fn get_names(client: &Client, auth: &HeaderMap) -> Names {
    ask(client, auth, Method::GET, "/props", None)
        .await
        .unwrap_or_default()
}

/// The headers llama-server's key check reads, as the client sent them.
fn auth_headers(headers: &HeaderMap) -> HeaderMap {
    let mut auth = HeaderMap::new();
    for name in [
        header::AUTHORIZATION,
        http::HeaderName::from_static("x-api-key"),
    ] {
        if let Some(value) = headers.get(&name) {
            auth.insert(name, value.clone());
        }
    }
    auth.insert(
        header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    auth
}

/// One JSON question to the server, its answer read as `T`.
async fn post<T: serde::de::DeserializeOwned>(
    client: &Client,
    auth: &HeaderMap,
    path: &'static str,
    question: &Value,
) -> Result<T, ExactError> {
    ask(client, auth, Method::POST, path, Some(question)).await
}

/// One question to the server on a connection of its own, its JSON answer read as `T`.
async fn ask<T: serde::de::DeserializeOwned>(
    client: &Client,
    auth: &HeaderMap,
    method: Method,
    path: &'static str,
    question: Option<&Value>,
) -> Result<T, ExactError> {
    let (mut head, ()) = Request::new(()).into_parts();
    head.method = method;
    head.uri = http::Uri::from_static(path);
    head.headers = auth.clone();
    let body = question.map_or_else(Bytes::new, |q| Bytes::from(q.to_string()));
    head.headers
        .insert(header::CONTENT_LENGTH, http::HeaderValue::from(body.len()));
    let response = client
        .send_once(&head, body)
        .await
        .map_err(|source| ExactError::Unreachable { path, source })?;
    let status = response.status();
    if !status.is_success() {
        return Err(ExactError::NotLlama {
            path,
            status: status.as_u16(),
        });
    }
    let bytes = response
        .into_body()
        .collect()
        .await
        .map_err(|err| ExactError::Unreadable {
            path,
            source: err.into(),
        })?
        .to_bytes();
    serde_json::from_slice(&bytes).map_err(|err| ExactError::Unreadable {
        path,
        source: err.into(),
    })
}

/// One event of a `/completion` stream, as far as guard reads it.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Partial {
    pub content: String,
    pub tokens: Vec<u32>,
    pub stop: bool,
    pub stop_type: Option<String>,
    pub tokens_predicted: u64,
    pub timings: Option<Timings>,
    pub error: Option<Value>,
}

/// A segment's timings: what it read of its prompt, from the cache and anew.
#[derive(Clone, Copy, Debug, Default, Deserialize)]
#[serde(default)]
pub struct Timings {
    pub prompt_n: Option<u64>,
    pub cache_n: Option<u64>,
    pub predicted_per_second: Option<f64>,
}

/// A continuation regenerated text other than what the client already has (it samples).
#[derive(Debug, thiserror::Error)]
#[error("the continuation differs from the answer sent so far at byte {at}")]
pub struct Diverged {
    pub at: usize,
}

/// The answer's ids and text over every segment: the ids guard can go on from, and the text
/// they cover. An id the server did not send on its own (a piece held back as incomplete
/// UTF-8 or a possible stop word, sent later with another) breaks the run: guard goes on from
/// before it, and the text after it, which the client may have, is regenerated and checked.
#[derive(Debug, Default)]
pub struct Ids {
    exact: Vec<u32>,
    /// Bytes of `text` the exact ids cover.
    exact_text: usize,
    /// The answer's text so far, as the client gets it.
    pub text: String,
    /// Where this segment's output stands in `text`.
    at: usize,
    /// Where this segment began in `text` (the text its prompt's generated ids stand for).
    began: usize,
    /// Ids this segment has sent one by one.
    seen: u64,
    broken: bool,
    /// Tokens generated before this segment.
    earlier: u64,
    /// Tokens generated in this segment, as the server last said.
    segment: u64,
    /// The stream said it was done, and why (llama-server's `stop_type`).
    pub stop_type: Option<String>,
    /// Tokens regenerated after resumes (a broken run's text read again).
    pub regenerated: u64,
}

impl Ids {
    /// Reads one event; returns the text that is new to the client.
    pub fn read(&mut self, event: &Partial) -> Result<String, Diverged> {
        let content = event.content.as_str();
        let end = (self.at + content.len()).min(self.text.len());
        let overlap = end.saturating_sub(self.at);
        if self.text.as_bytes()[self.at.min(end)..end] != content.as_bytes()[..overlap]
            || !content.is_char_boundary(overlap)
        {
            return Err(Diverged { at: self.at });
        }
        let new = content[overlap..].to_owned();
        self.text.push_str(&new);
        self.at += content.len();
        let alone = event.tokens.len() == 1 && event.tokens_predicted == self.seen + 1;
        if !event.tokens.is_empty() {
            match alone && !content.is_empty() && !self.broken {
                true => {
                    self.exact.extend_from_slice(&event.tokens);
                    self.exact_text = self.at;
                }
                false => self.broken = true,
            }
            self.seen = event.tokens_predicted;
        }
        self.segment = self.segment.max(event.tokens_predicted);
        if event.stop {
            self.stop_type = Some(event.stop_type.clone().unwrap_or_else(|| "eos".to_owned()));
        }
        Ok(new)
    }

    /// A new segment goes on from the exact ids; returns them (its prompt's tail).
    pub fn resume(&mut self) -> &[u32] {
        let generated = self.generated();
        self.earlier = self.exact.len() as u64;
        self.regenerated += generated.saturating_sub(self.earlier);
        self.at = self.exact_text;
        self.began = self.exact_text;
        self.segment = 0;
        self.seen = 0;
        self.broken = false;
        self.stop_type = None;
        &self.exact
    }

    /// The bytes of text the current segment's prompt already holds.
    pub fn resumed_from(&self) -> usize {
        self.began
    }

    /// The generated ids guard can go on from.
    pub fn exact(&self) -> &[u32] {
        &self.exact
    }

    /// Tokens generated over all segments, as the client would count them.
    pub fn generated(&self) -> u64 {
        self.earlier + self.segment
    }

    /// Tokens of this segment so far.
    pub fn segment_tokens(&self) -> u64 {
        self.segment
    }

    /// Whether the client has text this segment has not yet regenerated.
    pub fn regenerating(&self) -> bool {
        self.at < self.text.len()
    }

    /// The OpenAI finish reason of the end the stream said.
    pub fn finish_reason(&self) -> &'static str {
        match self.stop_type.as_deref() {
            Some("limit") => "length",
            _ => "stop",
        }
    }
}

/// What llama-server names itself with in the answers it frames (`/props`).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Names {
    /// The model's name in its answers.
    model_alias: Option<String>,
    /// Its `system_fingerprint`.
    build_info: Option<String>,
}

/// The client's answer in its own API's shape, field for field as llama-server frames it on
/// that endpoint (its chat and completion answers carry its own model name and build).
#[derive(Debug)]
pub struct Framer {
    endpoint: Endpoint,
    model: String,
    fingerprint: String,
    id: String,
    created: i64,
    /// The client asked for the usage chunk at the end of a chat stream.
    include_usage: bool,
    /// The client asked for timings on every event (`/completion`).
    timings_per_token: bool,
    /// The prompt's tokens, and of them those the first segment found in the cache.
    prompt_tokens: u64,
    pub cached_tokens: u64,
    began: bool,
}

impl Framer {
    pub fn new(
        endpoint: Endpoint,
        names: Names,
        body: &Map<String, Value>,
        prompt_tokens: u64,
    ) -> Self {
        const ALPHANUMERIC: &[u8] =
            b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
        let random = RandomState::new();
        let id: String = (0..32_u8)
            .map(|n| {
                ALPHANUMERIC[(random.hash_one(n) % ALPHANUMERIC.len() as u64) as usize] as char
            })
            .collect();
        let include_usage = body
            .get("stream_options")
            .and_then(|o| o.get("include_usage"))
            .and_then(Value::as_bool)
            .unwrap_or(false);
        Self {
            endpoint,
            model: names.model_alias.unwrap_or_default(),
            fingerprint: names.build_info.unwrap_or_default(),
            id: format!("chatcmpl-{id}"),
            created: jiff::Timestamp::now().as_second(),
            include_usage,
            timings_per_token: body.get("timings_per_token") == Some(&Value::Bool(true)),
            prompt_tokens,
            cached_tokens: 0,
            began: false,
        }
    }

    /// The events that carry `text` (and, at the end, the answer's end) to a streaming
    /// client; `raw` is the upstream's event.
    pub fn stream(&mut self, raw: &Value, text: &str, ids: &Ids, end: bool) -> Vec<u8> {
        let mut events = Vec::new();
        match self.endpoint {
            Endpoint::OpenAiChat => {
                if !self.began {
                    self.began = true;
                    events.push(self.chunk(json!({"role": "assistant", "content": null}), None));
                }
                if !text.is_empty() {
                    events.push(self.chunk(json!({ "content": text }), None));
                }
                if end {
                    events.push(self.chunk(json!({}), Some(ids.finish_reason())));
                    if self.include_usage {
                        let mut usage = self.envelope(json!([]), "chat.completion.chunk");
                        usage.insert("usage".to_owned(), self.usage(ids));
                        events.push(usage);
                    }
                    if let Some(last) = events.last_mut() {
                        self.add_timings(last, raw, ids);
                    }
                }
            }
            Endpoint::OpenAiCompletion => {
                if !text.is_empty() || end {
                    events.push(self.completion(text, end.then(|| ids.finish_reason()), ids, raw));
                }
            }
            Endpoint::LlamaCompletion => {
                if !text.is_empty() || end || !ids.regenerating() {
                    events.push(self.native(raw, text, ids));
                }
            }
            Endpoint::OllamaChat | Endpoint::OllamaGenerate => {}
        }
        let mut out = Vec::new();
        for event in events {
            out.extend_from_slice(b"data: ");
            out.extend_from_slice(Value::Object(event).to_string().as_bytes());
            out.extend_from_slice(b"\n\n");
        }
        if end && self.endpoint != Endpoint::LlamaCompletion {
            out.extend_from_slice(b"data: [DONE]\n\n");
        }
        out
    }

    /// The one JSON answer of a client that did not stream.
    pub fn whole(&self, raw: &Value, ids: &Ids) -> Bytes {
        let text = ids.text.as_str();
        let answer = match self.endpoint {
            Endpoint::OpenAiChat => {
                let message = json!({"role": "assistant", "content": text});
                let choice =
                    json!({"finish_reason": ids.finish_reason(), "index": 0, "message": message});
                let mut answer = self.framed(json!([choice]), "chat.completion");
                answer.insert("usage".to_owned(), self.usage(ids));
                answer.insert("id".to_owned(), Value::from(self.id.as_str()));
                self.add_timings(&mut answer, raw, ids);
                answer
            }
            Endpoint::OpenAiCompletion => {
                self.completion(text, Some(ids.finish_reason()), ids, raw)
            }
            _ => {
                let mut answer = self.native(raw, text, ids);
                answer.insert("tokens".to_owned(), json!([]));
                answer
            }
        };
        Bytes::from(Value::Object(answer).to_string())
    }

    /// A chat chunk with one choice.
    fn chunk(&self, delta: Value, finish: Option<&str>) -> Map<String, Value> {
        let choice = json!({"finish_reason": finish, "index": 0, "delta": delta});
        self.envelope(json!([choice]), "chat.completion.chunk")
    }

    /// A `/v1/completions` event or answer; the last one with the usage and timings.
    fn completion(
        &self,
        text: &str,
        finish: Option<&str>,
        ids: &Ids,
        raw: &Value,
    ) -> Map<String, Value> {
        let choice = json!({"text": text, "index": 0, "logprobs": null, "finish_reason": finish});
        let mut event = self.framed(json!([choice]), "text_completion");
        if finish.is_some() {
            event.insert("usage".to_owned(), self.usage(ids));
        }
        event.insert("id".to_owned(), Value::from(self.id.as_str()));
        if finish.is_some() {
            self.add_timings(&mut event, raw, ids);
        }
        event
    }

    /// `choices, created, id, model, system_fingerprint, object`: a chat chunk's order.
    fn envelope(&self, choices: Value, object: &str) -> Map<String, Value> {
        let mut map = Map::new();
        map.insert("choices".to_owned(), choices);
        map.insert("created".to_owned(), Value::from(self.created));
        map.insert("id".to_owned(), Value::from(self.id.as_str()));
        map.insert("model".to_owned(), Value::from(self.model.as_str()));
        map.insert(
            "system_fingerprint".to_owned(),
            Value::from(self.fingerprint.as_str()),
        );
        map.insert("object".to_owned(), Value::from(object));
        map
    }

    /// `choices, created, model, system_fingerprint, object`: the order of whole answers and
    /// completion events (their `id` follows later).
    fn framed(&self, choices: Value, object: &str) -> Map<String, Value> {
        let mut map = self.envelope(choices, object);
        map.shift_remove("id");
        map
    }

    fn usage(&self, ids: &Ids) -> Value {
        let generated = ids.generated();
        json!({
            "completion_tokens": generated,
            "prompt_tokens": self.prompt_tokens,
            "total_tokens": generated + self.prompt_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        })
    }

    /// The server's timings of the last segment, its generated count the whole answer's.
    fn add_timings(&self, event: &mut Map<String, Value>, raw: &Value, ids: &Ids) {
        if let Some(mut timings) = raw.get("timings").cloned() {
            if let Some(map) = timings.as_object_mut() {
                map.insert("predicted_n".to_owned(), Value::from(ids.generated()));
            }
            event.insert("timings".to_owned(), timings);
        }
    }

    /// llama-server's own event, its text the client's and its counts the whole answer's.
    fn native(&self, raw: &Value, text: &str, ids: &Ids) -> Map<String, Value> {
        let mut event = raw.as_object().cloned().unwrap_or_default();
        let end = event.get("stop") == Some(&Value::Bool(true));
        event.insert("content".to_owned(), Value::from(text));
        event.insert("tokens_predicted".to_owned(), Value::from(ids.generated()));
        event.insert(
            "tokens_evaluated".to_owned(),
            Value::from(self.prompt_tokens),
        );
        if end {
            self.add_timings(&mut event, raw, ids);
            // The server says the prompt it read: a continuation's holds the text it went on
            // from, which the whole answer's does not.
            let before = &ids.text[..ids.resumed_from()];
            if let Some(Value::String(prompt)) = event.get_mut("prompt")
                && let Some(own) = prompt.strip_suffix(before)
            {
                *prompt = own.to_owned();
            }
            event.insert(
                "has_new_line".to_owned(),
                Value::from(ids.text.contains('\n')),
            );
        } else if !self.timings_per_token {
            event.shift_remove("timings");
        }
        event
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn partial(content: &str, token: Option<u32>, predicted: u64) -> Partial {
        Partial {
            content: content.to_owned(),
            tokens: token.into_iter().collect(),
            tokens_predicted: predicted,
            ..Partial::default()
        }
    }

    #[test]
    fn a_resume_goes_on_from_every_id_sent_alone() {
        let mut ids = Ids::default();
        assert_eq!(
            ids.read(&partial("Here", Some(7), 1)).ok().as_deref(),
            Some("Here")
        );
        assert_eq!(
            ids.read(&partial(" are", Some(8), 2)).ok().as_deref(),
            Some(" are")
        );
        assert_eq!(ids.resume(), &[7, 8]);
        assert!(!ids.regenerating());
        assert_eq!(
            ids.read(&partial(" 10", Some(9), 1)).ok().as_deref(),
            Some(" 10")
        );
        assert_eq!((ids.text.as_str(), ids.generated()), ("Here are 10", 3));
        assert_eq!(ids.regenerated, 0);
    }

    #[test]
    fn a_piece_held_back_is_regenerated_and_checked_against_what_was_sent() {
        let mut ids = Ids::default();
        ids.read(&partial("A", Some(1), 1)).expect("read");
        // Token 2 was half an emoji: the server sent it with token 3.
        ids.read(&partial(" 🍌", Some(3), 3)).expect("read");
        ids.read(&partial("!", Some(4), 4)).expect("read");
        assert_eq!(ids.resume(), &[1], "from before the id that was not sent");
        assert!(ids.regenerating());
        // The same text again: nothing new reaches the client, then it goes on.
        assert_eq!(ids.read(&partial("", Some(2), 1)).ok().as_deref(), Some(""));
        assert_eq!(
            ids.read(&partial(" 🍌", Some(3), 2)).ok().as_deref(),
            Some("")
        );
        assert_eq!(
            ids.read(&partial("! ok", Some(4), 3)).ok().as_deref(),
            Some(" ok")
        );
        assert_eq!((ids.text.as_str(), ids.generated()), ("A 🍌! ok", 4));
        assert_eq!(ids.regenerated, 3);
        // Sampling that goes elsewhere is caught, not passed off as the answer.
        let mut other = Ids::default();
        other.read(&partial("", Some(1), 2)).expect("read");
        other.read(&partial("ab", Some(2), 2)).expect("read");
        other.resume();
        assert!(other.read(&partial("ax", Some(1), 1)).is_err());
    }

    #[test]
    fn a_segment_asks_for_what_is_left_from_the_ids() {
        let exact = Exact {
            names: Names::default(),
            prompt: vec![1, 2],
            fields: Map::from_iter([("temperature".to_owned(), json!(0))]),
            budget: Some(10),
            auth: HeaderMap::new(),
            templated: false,
        };
        let body: Value = serde_json::from_slice(&exact.segment(&[5, 6, 7])).expect("json");
        assert_eq!(body["prompt"], json!([1, 2, 5, 6, 7]));
        assert_eq!(body["n_predict"], 7);
        assert_eq!(body["temperature"], 0);
        assert_eq!(body["stream"], true);
    }
}
