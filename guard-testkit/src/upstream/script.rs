//! What one request asks the scripted upstream to do, sent as the request's JSON body.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// How the scripted upstream answers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// 200 with one JSON document; the connection stays open for the next request.
    #[default]
    Complete,
    /// An event stream of its frames ended with `data: [DONE]`; then the connection closes,
    /// as llama-server closes it.
    Stream,
    /// An event stream of its frames that just ends; the connection stays open.
    Frames,
    /// Its frames, then nothing more: the connection is held until guard closes it.
    Hang,
    /// Its frames, then the connection breaks (a reset on TCP).
    Reset,
    /// 500 with a JSON error; the connection stays open.
    Fail500,
    /// Frames without end, each as soon as the last is taken.
    Flood,
}

/// One request's script.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Script {
    pub mode: Mode,
    pub frames: u64,
    pub gap_ms: u64,
    /// Bytes per frame at least (padded with spaces).
    pub bytes: usize,
    /// Time before the answer's head.
    pub head_ms: u64,
    /// The client's own tag for the request: the server sees each at most once.
    pub id: u64,
    /// How many tokens the request asks for, as clients say it (guard's estimate reads it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u64>,
}

impl Script {
    pub fn new(mode: Mode) -> Self {
        Self {
            mode,
            ..Self::default()
        }
    }

    /// `frames` frames, `gap` before each.
    pub fn frames(mut self, frames: u64, gap: Duration) -> Self {
        self.frames = frames;
        self.gap_ms = millis(gap);
        self
    }

    /// Frames of `bytes` bytes at least.
    pub fn sized(mut self, bytes: usize) -> Self {
        self.bytes = bytes;
        self
    }

    /// Waits this long before answering at all.
    pub fn head_after(mut self, delay: Duration) -> Self {
        self.head_ms = millis(delay);
        self
    }

    pub fn id(mut self, id: u64) -> Self {
        self.id = id;
        self
    }

    /// Says how many tokens the request asks for (`max_tokens`), as clients do.
    pub fn tokens(mut self, tokens: u64) -> Self {
        self.max_tokens = Some(tokens);
        self
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::to_value(self).expect("a script is JSON")
    }

    pub(super) fn gap(&self) -> Duration {
        Duration::from_millis(self.gap_ms)
    }

    pub(super) fn head_delay(&self) -> Duration {
        Duration::from_millis(self.head_ms)
    }
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).expect("a script's times fit in u64 milliseconds")
}
