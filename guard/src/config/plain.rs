//! What the TOML reader says of a value, in plain words: "expected a whole number of
//! milliseconds from 1 to 604800000, found the string "ten"" rather than Rust's "expected u64".

use super::validate;

/// The reader's message for `key`, reworded where its shape is known.
pub(super) fn said(key: &str, message: &str) -> String {
    if let Some(rest) = message.strip_prefix("invalid type: ") {
        return mismatch(key, rest, false).unwrap_or_else(|| message.to_owned());
    }
    if let Some(rest) = message.strip_prefix("invalid value: ") {
        return mismatch(key, rest, true).unwrap_or_else(|| message.to_owned());
    }
    if let Some(rest) = message.strip_prefix("unknown field `") {
        return unknown_key(rest).unwrap_or_else(|| message.to_owned());
    }
    if let Some(rest) = message.strip_prefix("unknown variant ") {
        return format!("unknown value {}", unticked(rest));
    }
    if let Some(rest) = message.strip_prefix("missing field ") {
        return format!("missing key {rest}");
    }
    message.to_owned()
}

/// `FOUND, expected EXPECTED` as "expected WORDS, found WORDS", or a number out of its key's
/// range as validation words it.
fn mismatch(key: &str, rest: &str, value: bool) -> Option<String> {
    let (found, expected) = rest.rsplit_once(", expected ")?;
    let range = validate::range_of(key);
    if value && let (Some(range), Some(number)) = (&range, found.strip_prefix("integer ")) {
        return Some(range.out_of_range(number.trim_matches('`')));
    }
    let expected = range
        .map(|range| range.words())
        .or_else(|| validate::words_of(key).map(str::to_owned))
        .or_else(|| type_words(expected))
        .unwrap_or_else(|| expected.to_owned());
    Some(format!("expected {expected}, found {}", found_words(found)))
}

/// What a Rust type or serde's name for it means in a config file.
fn type_words(expected: &str) -> Option<String> {
    Some(match expected {
        "u8" | "u16" | "u32" | "u64" | "usize" => {
            let max = match expected {
                "u8" => u64::from(u8::MAX),
                "u16" => u64::from(u16::MAX),
                "u32" => u64::from(u32::MAX),
                // TOML's integers stop at i64's.
                _ => i64::MAX as u64,
            };
            format!("a whole number from 0 to {max}")
        }
        "i32" => format!("a whole number from {} to {}", i32::MIN, i32::MAX),
        "i64" => "a whole number".to_owned(),
        "f32" | "f64" => "a number".to_owned(),
        "a boolean" => "true or false (no quotes)".to_owned(),
        "a string" | "a borrowed string" => "a string in double quotes".to_owned(),
        "path string" => "a path in double quotes".to_owned(),
        "a sequence" => "a list in brackets".to_owned(),
        table if table.starts_with("struct ") || table == "a map" => "a table".to_owned(),
        _ => return None,
    })
}

/// serde's words for the value found, as a config's reader would say them.
fn found_words(found: &str) -> String {
    if let Some(text) = found.strip_prefix("string ") {
        return format!("the string {text}");
    }
    for kind in ["integer ", "floating point ", "boolean "] {
        if let Some(value) = found.strip_prefix(kind) {
            return value.trim_matches('`').to_owned();
        }
    }
    match found {
        "sequence" => "a list".to_owned(),
        "map" => "a table".to_owned(),
        other => other.to_owned(),
    }
}

/// "unknown field `lisen`, expected one of `listen`, ..." as the unknown key, the nearest
/// known one, and the keys this table takes.
fn unknown_key(rest: &str) -> Option<String> {
    let (name, rest) = rest.split_once('`')?;
    let known: Vec<&str> = rest
        .split('`')
        .skip(1)
        .step_by(2)
        .filter(|word| !word.is_empty())
        .collect();
    if known.is_empty() {
        return Some(format!("unknown key `{name}`: this table takes none"));
    }
    let nearest = known
        .iter()
        .map(|k| (strsim::damerau_levenshtein(name, k), *k))
        .min()
        .filter(|(distance, k)| *distance <= 2.max(k.len() / 3))
        .map(|(_, k)| format!(" (did you mean `{k}`?)"))
        .unwrap_or_default();
    Some(format!(
        "unknown key `{name}`{nearest}; this table takes {}",
        known.join(", ")
    ))
}

/// "`x`, expected `a` or `b`" as "`x`: use a or b".
fn unticked(rest: &str) -> String {
    match rest.split_once(", expected ") {
        Some((value, expected)) => format!("{value}: use {}", expected.replace('`', "")),
        None => rest.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_readers_words_are_made_plain() {
        assert_eq!(
            said(
                "upstream.max_concurrency",
                "invalid type: string \"two\", expected u32"
            ),
            "expected a whole number from 1 to 65536, found the string \"two\""
        );
        assert_eq!(
            said(
                "upstream.connect_timeout_ms",
                "invalid value: integer `-1`, expected u64"
            ),
            "-1 is out of range: use a whole number of milliseconds from 1 to 604800000"
        );
        assert_eq!(
            said(
                "class.chat.max_queue",
                "invalid type: floating point `1.5`, expected usize"
            ),
            "expected a whole number from 0 to 1000000, found 1.5"
        );
        assert_eq!(
            said(
                "risk.wait_fraction",
                "invalid type: string \"x\", expected f64"
            ),
            "expected a fraction above 0 and at most 1 (such as 0.5), found the string \"x\""
        );
        assert_eq!(
            said(
                "risk.protect_priority",
                "invalid type: boolean `true`, expected i32"
            ),
            "expected a whole number from -2147483648 to 2147483647, found true"
        );
        assert_eq!(
            said(
                "server.half_close_means_gone",
                "invalid type: integer `1`, expected a boolean"
            ),
            "expected true or false (no quotes), found 1"
        );
        assert_eq!(
            said(
                "upstream.api",
                "unknown variant `x`, expected `ollama` or `openai`"
            ),
            "unknown value `x`: use ollama or openai"
        );
        let unknown = said(
            "server.lisen",
            "unknown field `lisen`, expected one of `listen`, `drain_grace_ms`",
        );
        assert_eq!(
            unknown,
            "unknown key `lisen` (did you mean `listen`?); this table takes listen, \
             drain_grace_ms"
        );
    }
}
