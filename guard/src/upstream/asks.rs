//! What guard reads from a generation request's body: the model and the output tokens asked
//! for, each from its top-level field, found by a scan that keeps nothing but the bytes
//! (`jsonscan`). A body that is not a JSON object, or a field of another type, reads as
//! absent: the upstream judges the body, not guard. Where a field appears twice the last one
//! counts, as in the upstreams' own parsers (Go, nlohmann::json, Python).

use std::borrow::Cow;

use crate::jsonscan;

#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Asks {
    pub model: Option<String>,
    /// OpenAI `max_tokens`, `max_completion_tokens`, responses' `max_output_tokens`,
    /// llama.cpp `n_predict`, Ollama `options.num_predict`, in that order of preference.
    tokens: [Option<u64>; 5],
    /// Bytes of what the model reads: `prompt`, `messages`, `input`, `system`, `suffix`.
    pub prompt_bytes: u64,
}

/// The members whose bytes the model reads as its prompt.
const PROMPT_FIELDS: [&str; 5] = ["prompt", "messages", "input", "system", "suffix"];

/// Bytes of prompt a token stands for, roughly, across tokenizers and languages.
const BYTES_PER_TOKEN: u64 = 4;

const TOKEN_FIELDS: [&str; 4] = [
    "max_tokens",
    "max_completion_tokens",
    "max_output_tokens",
    "n_predict",
];

impl Asks {
    pub fn read(body: &[u8]) -> Self {
        let mut asks = Self::default();
        let _ = jsonscan::members(body, |key, value| {
            let Some(key) = text(key) else { return };
            match key.as_ref() {
                "model" => asks.model = text(value).map(Cow::into_owned),
                "options" => asks.tokens[4] = nested_num_predict(value),
                other if PROMPT_FIELDS.contains(&other) => {
                    asks.prompt_bytes += value.len() as u64;
                }
                other => {
                    if let Some(slot) = TOKEN_FIELDS.iter().position(|f| *f == other) {
                        // -1 (no limit) and other non-counts read as none.
                        asks.tokens[slot] = serde_json::from_slice(value).ok();
                    }
                }
            }
        });
        asks
    }

    /// The prompt's size in tokens, roughly (its bytes over four).
    pub fn prompt_tokens(&self) -> u64 {
        self.prompt_bytes.div_ceil(BYTES_PER_TOKEN)
    }

    /// The output tokens the request asks for, where it says.
    pub fn tokens(&self) -> Option<u64> {
        self.tokens.iter().find_map(|t| *t)
    }
}

/// A JSON string's text, borrowed where it has no escapes (serde's own `Cow<str>` is always
/// an owned copy).
fn text(raw: &[u8]) -> Option<Cow<'_, str>> {
    match serde_json::from_slice::<&str>(raw) {
        Ok(borrowed) => Some(Cow::Borrowed(borrowed)),
        Err(_) => serde_json::from_slice::<String>(raw).ok().map(Cow::Owned),
    }
}

fn nested_num_predict(options: &[u8]) -> Option<u64> {
    let mut found = None;
    let _ = jsonscan::members(options, |key, value| {
        if text(key).is_some_and(|k| k == "num_predict") {
            found = serde_json::from_slice(value).ok();
        }
    });
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    fn asks(json: &str) -> Asks {
        Asks::read(json.as_bytes())
    }

    #[test]
    fn a_plain_string_is_borrowed_and_an_escaped_one_decoded() {
        assert!(matches!(
            text(br#""llama3""#),
            Some(Cow::Borrowed("llama3"))
        ));
        assert_eq!(text(br#""a\u0062\n""#).as_deref(), Some("ab\n"));
        assert_eq!(text(b"3"), None);
    }

    #[test]
    fn the_tokens_asked_for_are_read_from_each_api() {
        assert_eq!(asks(r#"{"max_tokens": 8}"#).tokens(), Some(8));
        assert_eq!(asks(r#"{"n_predict": 300}"#).tokens(), Some(300));
        assert_eq!(asks(r#"{"options": {"num_predict": 5}}"#).tokens(), Some(5));
        assert_eq!(asks(r#"{"max_completion_tokens": 9}"#).tokens(), Some(9));
        assert_eq!(asks(r#"{"n_predict": -1}"#).tokens(), None);
        assert_eq!(asks(r#"{"prompt": "x"}"#).tokens(), None);
        assert_eq!(asks(r#"{"prompt": "abcdefgh"}"#).prompt_tokens(), 3);
        assert_eq!(asks(r#"{"messages": [], "model": "m"}"#).prompt_tokens(), 1);
    }

    #[test]
    fn fields_of_another_type_or_bodies_of_another_shape_read_as_absent() {
        let read = asks(r#"{"model": 5, "max_tokens": "many", "options": 3}"#);
        assert_eq!((read.tokens(), read.model), (None, None));
        assert_eq!(asks("[1, 2]").model, None);
        assert_eq!(asks("{\"model\": ").model, None);
        assert_eq!(asks(r#"{"model": "m"}"#).model.as_deref(), Some("m"));
    }

    #[test]
    fn the_model_is_read_as_the_upstream_reads_it() {
        // An escaped key is the same key; the last of two is the one that counts.
        assert_eq!(asks(r#"{"\u006dodel": "a"}"#).model.as_deref(), Some("a"));
        assert_eq!(
            asks(r#"{"model": "a", "model": "b"}"#).model.as_deref(),
            Some("b")
        );
        assert_eq!(
            asks(r#"{"model": "caf\u00e9"}"#).model.as_deref(),
            Some("café")
        );
        let deep = format!(
            r#"{{"messages": {}1{}, "model": "m"}}"#,
            "[".repeat(10_000),
            "]".repeat(10_000)
        );
        assert_eq!(asks(&deep).model.as_deref(), Some("m"), "no nesting limit");
    }
}
