//! Finds the line of a key in TOML text, so errors found after parsing can still name it.

use toml_edit::{ImDocument, Item};

/// The 1-based line that holds byte `offset`.
pub(super) fn line_of_offset(text: &str, offset: usize) -> usize {
    text[..offset.min(text.len())].matches('\n').count() + 1
}

/// The dotted key written on the line that holds byte `offset` (`table.key`), if that line
/// is a `key = value` line.
pub(super) fn key_at_offset(text: &str, offset: usize) -> Option<String> {
    let before = &text[..offset.min(text.len())];
    let line_start = before.rfind('\n').map_or(0, |at| at + 1);
    let line = text[line_start..].lines().next()?;
    let (key, _) = line.split_once('=')?;
    let key = key.trim().trim_matches('"');
    if key.is_empty() || key.starts_with('[') || key.starts_with('#') {
        return None;
    }
    let table = before[..line_start]
        .lines()
        .rev()
        .map(str::trim)
        .find(|l| l.starts_with('['))
        .map(|header| {
            header
                .trim_matches(|c| c == '[' || c == ']')
                .trim()
                .to_owned()
        });
    Some(match table {
        Some(table) => format!("{table}.{key}"),
        None => key.to_owned(),
    })
}

/// The 1-based line of a key path such as `classify.rule[1].class`, where the text has it.
pub(super) fn line_of_key(text: &str, key: &str) -> Option<usize> {
    let doc = ImDocument::parse(text).ok()?;
    let mut item: &Item = doc.as_item();
    let mut span = None;
    for part in key.split('.') {
        let (name, index) = match part.split_once('[') {
            Some((name, rest)) => (name, rest.trim_end_matches(']').parse::<usize>().ok()),
            None => (part, None),
        };
        item = item.get(name)?;
        span = item.span().or(span);
        if let Some(index) = index {
            let table = item.as_array_of_tables()?.get(index)?;
            span = table.span().or(span);
            item = item.get(index)?;
        }
    }
    span.map(|span| line_of_offset(text, span.start))
}
