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
    /// Token counts, on the last event where the client asked (`stream_options`) or the
    /// server always sends them.
    pub usage: Option<Usage>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Usage {
    pub prompt_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
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

    /// Tokens generated, where this event says: llama-server's timings, else the usage.
    pub fn generated_tokens(&self) -> Option<u64> {
        self.timings
            .as_ref()
            .and_then(|t| t.predicted_n)
            .or_else(|| self.usage.as_ref()?.completion_tokens)
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
        let last: ChatChunk =
            parse(br#"{"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":12}}"#)
                .expect("last event");
        assert_eq!(last.generated_tokens(), Some(12));
        let llama: ChatChunk =
            parse(br#"{"choices":[],"timings":{"predicted_n":7},"usage":{"completion_tokens":7}}"#)
                .expect("llama-server's last event");
        assert_eq!(llama.generated_tokens(), Some(7));
    }
}
