//! Request bodies of the APIs guard fronts, built one way for every test: a base shape, and
//! [`With::with`] for the fields a test adds.

use serde_json::{Value, json};

/// The model the Ollama emulator serves (and the one llama-server runs, by Ollama's name).
pub const MODEL: &str = "smollm2:135m";

/// A prompt for a generation that runs as long as it is asked to.
pub const STORY: &str = "Write a story about a lighthouse.";

/// llama.cpp's `/completion`: exactly `tokens` tokens of `prompt`, end-of-text ignored.
pub fn completion(prompt: &str, tokens: u64) -> Value {
    json!({ "prompt": prompt, "n_predict": tokens, "ignore_eos": true })
}

/// An OpenAI chat (`/v1/chat/completions`) of one user message.
pub fn chat(content: &str) -> Value {
    json!({ "messages": [{ "role": "user", "content": content }] })
}

/// Ollama's `/api/chat` of one user message to [`MODEL`].
pub fn ollama_chat(content: &str) -> Value {
    json!({ "model": MODEL, "messages": [{ "role": "user", "content": content }] })
}

/// Ollama's `/api/generate` of `prompt` to [`MODEL`], answered as one document.
pub fn ollama_generate(prompt: &str) -> Value {
    json!({ "model": MODEL, "prompt": prompt, "stream": false })
}

/// A body with one more field.
pub trait With {
    /// `key` set to `value`: a new key goes last, a known one keeps its place.
    fn with(self, key: &str, value: impl Into<Value>) -> Self;
}

impl With for Value {
    fn with(mut self, key: &str, value: impl Into<Value>) -> Self {
        self[key] = value.into();
        self
    }
}
