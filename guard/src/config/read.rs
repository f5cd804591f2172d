//! Reads TOML text into a `Config`, reporting every problem at once: a value the types refuse
//! is blanked out (its bytes turned to spaces, so that every line and offset stays where it
//! was) and the text read again; then what validation and resolving find is added.

use std::{ops::Range, path::Path};

use super::{Config, ConfigError, Problem, error::key_named, locate, plain, validate::Invalid};

/// Past this many problems the rest are not looked for: a file this wrong is the wrong file.
const MAX_PROBLEMS: usize = 50;

pub(super) fn parse(text: &str, file: &Path) -> Result<Config, ConfigError> {
    let mut errors = Vec::new();
    let (config, blanked) = deserialize(text, file, &mut errors);
    let Some((mut config, read)) = config else {
        return Err(ConfigError::all(errors));
    };
    // A key already refused took its default: what validation says of it would be noise.
    let relevant = |invalid: &Invalid| !blanked.iter().any(|key| covers(key, &invalid.key));
    let found = |invalid: Invalid| {
        let place = invalid.place.as_deref();
        ConfigError::invalid(file, &read, &invalid.key, None, place, invalid.problem)
    };
    errors.extend(config.validate().into_iter().filter(relevant).map(found));
    let dir = file.parent().unwrap_or(Path::new("."));
    errors.extend(config.resolve(dir).into_iter().filter(relevant).map(found));
    if errors.is_empty() {
        Ok(config)
    } else {
        Err(ConfigError::all(errors))
    }
}

/// The config the text gives once every value the types refuse is blanked out (with that
/// text), and the keys blanked; none where the text is not TOML or a refusal cannot be
/// blanked out. Each refusal is added to `errors`.
fn deserialize(
    text: &str,
    file: &Path,
    errors: &mut Vec<ConfigError>,
) -> (Option<(Config, String)>, Vec<String>) {
    let mut now = text.to_owned();
    let mut blanked = Vec::new();
    loop {
        let deserializer = toml::Deserializer::new(&now);
        let err = match serde_path_to_error::deserialize::<_, Config>(deserializer) {
            Ok(config) => return (Some((config, now)), blanked),
            Err(err) => err,
        };
        let span = err.inner().span();
        let key = key_named(&now, &err.path().to_string(), span.as_ref());
        let problem = Problem::Said(plain::said(&key, err.inner().message()));
        errors.push(ConfigError::invalid(
            file,
            &now,
            &key,
            span.clone(),
            None,
            problem,
        ));
        // Not TOML at all: what the reader would say after it is guesswork.
        if !locate::parses(&now) || errors.len() >= MAX_PROBLEMS {
            return (None, blanked);
        }
        match blank_out(&now, &key, span) {
            Some((next, gone)) => {
                now = next;
                blanked.push(gone);
            }
            None => return (None, blanked),
        }
    }
}

/// The text with `key` blanked out, and the key that was (a parent, where blanking the key
/// alone leaves text that is not TOML: an inline table's last entry, say).
fn blank_out(text: &str, key: &str, span: Option<Range<usize>>) -> Option<(String, String)> {
    let mut key = key.to_owned();
    loop {
        let mut spans = locate::spans_under(text, &key);
        if spans.is_empty()
            && let Some(span) = &span
        {
            spans.push(span.clone());
        }
        let next = blank(text, &spans);
        if next != text && locate::parses(&next) {
            return Some((next, key));
        }
        key = locate::parent(&key)?.to_owned();
    }
}

/// The text with every byte in `spans` a space, line ends kept.
fn blank(text: &str, spans: &[Range<usize>]) -> String {
    let mut bytes = text.as_bytes().to_vec();
    for span in spans {
        let end = span.end.min(bytes.len());
        for byte in &mut bytes[span.start.min(end)..end] {
            if !matches!(*byte, b'\n' | b'\r') {
                *byte = b' ';
            }
        }
    }
    // Every byte of a multi-byte character became a space: still UTF-8.
    String::from_utf8(bytes).unwrap_or_else(|_| text.to_owned())
}

/// Whether a problem with `key` follows from `blanked` having been refused: the same key, one
/// under it, or one of the same array element (a rule whose key was refused).
fn covers(blanked: &str, key: &str) -> bool {
    let element = blanked.rfind(']').map_or(blanked, |end| &blanked[..=end]);
    locate::is_under(key, blanked) || locate::is_under(key, element)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blanking_keeps_lines_and_offsets() {
        let text = "a = 1\nb = \"é\"\nc = 3\n";
        let at = text.find("b =").expect("b");
        let span = std::iter::once(at..at + 8).collect::<Vec<_>>();
        let out = blank(text, &span);
        assert_eq!(out.len(), text.len());
        assert_eq!(out.lines().count(), 3);
        assert!(out.contains("c = 3") && !out.contains('b'), "{out}");
    }

    #[test]
    fn a_refusal_covers_its_key_and_its_element() {
        assert!(covers("classify.default", "classify.default"));
        assert!(covers(
            "classify.rule[0].pathprefix",
            "classify.rule[0].class"
        ));
        assert!(!covers(
            "classify.rule[0].pathprefix",
            "classify.rule[1].class"
        ));
        assert!(covers("server", "server.listen"));
        assert!(!covers("server.listen", "server.listen_x"));
    }
}
