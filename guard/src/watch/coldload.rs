//! Cold loads seen in Ollama's answers: the final object carries `load_duration`
//! (nanoseconds); a long one means the model was loaded for this request.

use std::time::Duration;

/// How much of a response's end is kept to find its final object.
pub const TAIL_BYTES: usize = 2_048;

/// The last `load_duration` in the tail of an Ollama response (NDJSON or one object).
pub fn load_duration(tail: &[u8]) -> Option<Duration> {
    let text = String::from_utf8_lossy(tail);
    let at = text.rfind("\"load_duration\":")?;
    let digits: String = text[at + "\"load_duration\":".len()..]
        .trim_start()
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok().map(Duration::from_nanos)
}

/// Keeps the last TAIL_BYTES of a body.
pub fn keep_tail(tail: &mut Vec<u8>, chunk: &[u8]) {
    tail.extend_from_slice(chunk);
    if tail.len() > TAIL_BYTES {
        tail.drain(..tail.len() - TAIL_BYTES);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_final_objects_load_duration_is_found() {
        let body = b"{\"response\":\"a\",\"done\":false}\n{\"done\":true,\"total_duration\":9,\"load_duration\":1500000000,\"eval_count\":3}\n";
        assert_eq!(load_duration(body), Some(Duration::from_millis(1500)));
        assert_eq!(load_duration(b"{\"done\":false}"), None);
    }

    #[test]
    fn the_tail_keeps_the_end() {
        let mut tail = Vec::new();
        keep_tail(&mut tail, &vec![b'x'; TAIL_BYTES]);
        keep_tail(&mut tail, b"\"load_duration\":7}");
        assert_eq!(tail.len(), TAIL_BYTES);
        assert_eq!(load_duration(&tail), Some(Duration::from_nanos(7)));
    }
}
