//! Ollama's API (docs/api.md): the models it lists, runs and shows, and its stream frames.

use serde::Deserialize;

/// `GET /api/version`.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Version {
    pub version: Option<String>,
}

/// `GET /api/tags`: the local models.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Tags {
    pub models: Vec<Tag>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Tag {
    pub name: String,
    pub model: Option<String>,
    pub digest: Option<String>,
}

/// `GET /api/ps`: the models loaded now.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Ps {
    pub models: Vec<Running>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Running {
    pub name: Option<String>,
    pub model: Option<String>,
    pub size: u64,
    pub size_vram: u64,
    pub expires_at: Option<String>,
}

impl Running {
    pub fn name(&self) -> Option<&str> {
        self.name.as_deref().or(self.model.as_deref())
    }

    /// The share of the model not in GPU memory.
    pub fn cpu_offload_ratio(&self) -> f64 {
        if self.size == 0 {
            return 0.0;
        }
        1.0 - (self.size_vram.min(self.size) as f64 / self.size as f64)
    }
}

/// `POST /api/show`: where a model runs.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Show {
    /// Set for a model served from elsewhere (remote or cloud).
    pub remote_host: Option<String>,
}

/// One line of a streamed `/api/chat` or `/api/generate` answer; the last carries the timings.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Chunk {
    pub message: Option<Message>,
    /// `/api/generate`'s text.
    pub response: Option<String>,
    pub done: bool,
    /// Tokens generated (last line).
    pub eval_count: Option<u64>,
    /// Nanoseconds spent loading the model (last line).
    pub load_duration: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Message {
    pub content: String,
}

impl Chunk {
    pub fn text(&self) -> Option<&str> {
        self.message
            .as_ref()
            .map(|m| m.content.as_str())
            .or(self.response.as_deref())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::upstream::api::parse;

    #[test]
    fn offload_is_the_share_outside_gpu_memory() {
        let ps: Ps = parse(br#"{ "models": [
            { "name": "a:1b", "size": 1000, "size_vram": 1000, "expires_at": "2026-12-02T10:00:00Z" },
            { "name": "b:7b", "size": 1000, "size_vram": 480 },
            { "model": "c:cpu", "size": 1000, "size_vram": 0 }
        ]}"#)
        .expect("ps");
        let ratios: Vec<f64> = ps.models.iter().map(Running::cpu_offload_ratio).collect();
        assert_eq!(ratios, vec![0.0, 0.52, 1.0]);
        assert_eq!(ps.models[2].name(), Some("c:cpu"));
    }

    #[test]
    fn the_last_line_carries_the_load_time() {
        let last: Chunk =
            parse(br#"{"done":true,"total_duration":9,"load_duration":1500000000,"eval_count":3}"#)
                .expect("chunk");
        assert_eq!(
            (last.done, last.load_duration, last.eval_count),
            (true, Some(1_500_000_000), Some(3))
        );
        let piece: Chunk =
            parse(br#"{"message":{"role":"assistant","content":"hi"},"done":false}"#)
                .expect("chunk");
        assert_eq!(piece.text(), Some("hi"));
    }
}
