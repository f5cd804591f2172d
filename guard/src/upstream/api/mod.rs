//! What guard reads of each inference server's API, as typed structs: only the fields it
//! uses; every field optional or defaulted, so a server that omits one is still read.

pub mod llama;
pub mod ollama;
pub mod openai;

/// A JSON document as `T`, or None where it is not one.
pub fn parse<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Option<T> {
    serde_json::from_slice(bytes).ok()
}
