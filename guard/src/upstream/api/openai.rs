//! OpenAI-style APIs (vLLM, llama-server's `/v1`): the models listed and the stream's events.

use serde::Deserialize;

/// `GET /v1/models`.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Models {
    pub data: Vec<Model>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Model {
    pub id: String,
}

/// One `data:` event of a streamed chat completion.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct ChatChunk {
    pub choices: Vec<Choice>,
    /// llama-server's own timings on the last event.
    pub timings: Option<super::llama::Timings>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Choice {
    pub delta: Delta,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Delta {
    pub content: Option<String>,
}

impl ChatChunk {
    pub fn text(&self) -> Option<&str> {
        self.choices.first()?.delta.content.as_deref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::upstream::api::parse;

    #[test]
    fn a_chunk_and_the_models() {
        let chunk: ChatChunk =
            parse(br#"{"choices":[{"delta":{"content":"Hi"}}]}"#).expect("chunk");
        assert_eq!(chunk.text(), Some("Hi"));
        let models: Models =
            parse(br#"{"object":"list","data":[{"id":"smollm2"}]}"#).expect("models");
        assert_eq!(models.data[0].id, "smollm2");
    }
}
