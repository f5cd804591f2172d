//! Finds where a key is written in TOML text, from the TOML parser's spans, so errors found
//! after parsing can still name its line.
//!
//! Key paths are written as serde_path_to_error writes them (and the validation copies):
//! names joined with `.`, array indexes as `[i]`, keys unquoted: `classify.rule[1].class`.

use std::ops::Range;

use toml_edit::{ImDocument, Item, Key, TableLike, Value};

/// The 1-based line that holds byte `offset`.
pub(super) fn line_of_offset(text: &str, offset: usize) -> usize {
    text[..offset.min(text.len())].matches('\n').count() + 1
}

/// The 1-based line of a key path such as `classify.rule[1].class`: where the key is written,
/// else where its nearest written parent is (a required key left out, say).
pub(super) fn line_of_key(text: &str, key: &str) -> Option<usize> {
    let doc = ImDocument::parse(text).ok()?;
    let written = written(doc.as_item());
    let mut path = key;
    loop {
        if let Some(place) = written.iter().find(|place| place.path == path) {
            return Some(line_of_offset(text, place.span.start));
        }
        path = parent(path)?;
    }
}

/// The 1-based line where exactly this key path is written; none where it is not.
pub(super) fn line_of_written_key(text: &str, key: &str) -> Option<usize> {
    let doc = ImDocument::parse(text).ok()?;
    written(doc.as_item())
        .into_iter()
        .find(|place| place.path == key)
        .map(|place| line_of_offset(text, place.span.start))
}

/// Where the key path and everything under it is written (a table: its header and each of
/// its keys), for blanking it out; empty where it is not written.
pub(super) fn spans_under(text: &str, key: &str) -> Vec<Range<usize>> {
    let Ok(doc) = ImDocument::parse(text) else {
        return Vec::new();
    };
    written(doc.as_item())
        .into_iter()
        .filter(|place| is_under(&place.path, key))
        .map(|place| place.span)
        .collect()
}

/// Whether `path` is `key` or lies under it (`key.x`, `key[0]`).
pub(super) fn is_under(path: &str, key: &str) -> bool {
    path.strip_prefix(key)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with(['.', '[']))
}

/// Whether the text is TOML.
pub(super) fn parses(text: &str) -> bool {
    ImDocument::parse(text).is_ok()
}

/// `a.b[2]` -> `a.b`, `a.b` -> `a`, `a` -> none.
pub(super) fn parent(path: &str) -> Option<&str> {
    let cut = path.rfind(['.', '['])?;
    Some(&path[..cut])
}

/// The key path written at byte `offset` (`table.key`, `table[0].key`): the innermost key
/// whose name or value holds it. Where the text does not parse (the offset is TOML's own
/// error), the key of that line, under the table header above it.
pub(super) fn key_at_offset(text: &str, offset: usize) -> Option<String> {
    match ImDocument::parse(text) {
        Ok(doc) => written(doc.as_item())
            .into_iter()
            .filter(|place| place.span.contains(&offset))
            .min_by_key(|place| place.span.len())
            .map(|place| place.path),
        Err(_) => key_of_broken_line(text, offset),
    }
}

/// Where one key path is written: from its key's start to its value's end (a table: its
/// header).
#[derive(Debug)]
struct Place {
    path: String,
    span: Range<usize>,
    /// A `[table]` or `[[array]]` header, which opens the keys below it.
    header: bool,
}

/// Every key path the document writes, with its place.
fn written(root: &Item) -> Vec<Place> {
    let mut places = Vec::new();
    walk(root, "", &mut places);
    places
}

fn walk(item: &Item, path: &str, places: &mut Vec<Place>) {
    match item {
        Item::ArrayOfTables(array) => {
            for (index, table) in array.iter().enumerate() {
                let path = format!("{path}[{index}]");
                if let Some(span) = table.span() {
                    places.push(Place {
                        path: path.clone(),
                        span,
                        header: true,
                    });
                }
                walk_table(table, &path, places);
            }
        }
        Item::Table(table) => walk_table(table, path, places),
        Item::Value(value) => walk_value(value, path, places),
        Item::None => {}
    }
}

fn walk_value(value: &Value, path: &str, places: &mut Vec<Place>) {
    match value {
        Value::Array(array) => {
            for (index, value) in array.iter().enumerate() {
                let path = format!("{path}[{index}]");
                if let Some(span) = value.span() {
                    places.push(Place {
                        path: path.clone(),
                        span,
                        header: false,
                    });
                }
                walk_value(value, &path, places);
            }
        }
        Value::InlineTable(table) => walk_table(table, path, places),
        _ => {}
    }
}

fn walk_table(table: &dyn TableLike, path: &str, places: &mut Vec<Place>) {
    for (name, _) in table.iter() {
        let Some((key, item)) = table.get_key_value(name) else {
            continue;
        };
        let path = match path {
            "" => name.to_owned(),
            parent => format!("{parent}.{name}"),
        };
        if let Some(span) = place_of(key, item) {
            places.push(Place {
                path: path.clone(),
                span,
                header: matches!(item, Item::Table(table) if !table.is_implicit()),
            });
        }
        walk(item, &path, places);
    }
}

/// A table's header; a value's key through its value (or the one that is known).
fn place_of(key: &Key, item: &Item) -> Option<Range<usize>> {
    if let Item::Table(table) = item {
        return table.span().or_else(|| key.span());
    }
    match (key.span(), item.span()) {
        (Some(key), Some(value)) => Some(key.start.min(value.start)..key.end.max(value.end)),
        (key, value) => key.or(value),
    }
}

/// The key written on the line that holds `offset`, which TOML could not parse: the lines
/// above it parse, and give the table it is in; the line's text before its `=` is the key.
fn key_of_broken_line(text: &str, offset: usize) -> Option<String> {
    let offset = offset.min(text.len());
    let line_start = text[..offset].rfind('\n').map_or(0, |at| at + 1);
    let above = ImDocument::parse(&text[..line_start]).ok()?;
    let table = written(above.as_item())
        .into_iter()
        .filter(|place| place.header)
        .max_by_key(|place| place.span.start)
        .map(|place| place.path);
    let line = text[line_start..].lines().next().unwrap_or_default();
    // The first `=` that ends a whole key (one inside a quoted key does not).
    let key = line
        .match_indices('=')
        .find_map(|(at, _)| Key::parse(&line[..at]).ok())?;
    let key: Vec<&str> = key.iter().map(Key::get).collect();
    let key = key.join(".");
    Some(match table {
        Some(table) => format!("{table}.{key}"),
        None => key,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = r#"top = 1
dotted.inner = "x"

[server]
listen = "127.0.0.1:1"
inline = { a = 1, b = { c = [10, 20] } }

[class.batch]
deadline_ms = 5

[class."my.class"]
"quoted key" = true

[[classify.rule]]
class = "batch"

[[classify.rule]]
class = "chat"
models = ["a", "b"]
"#;

    fn line(key: &str) -> Option<usize> {
        line_of_key(TEXT, key)
    }

    fn offset_of(needle: &str) -> usize {
        TEXT.find(needle).expect("the needle is in the text")
    }

    #[test]
    fn keys_are_found_on_their_lines() {
        assert_eq!(line("top"), Some(1));
        assert_eq!(line("dotted.inner"), Some(2));
        assert_eq!(line("server"), Some(4));
        assert_eq!(line("server.listen"), Some(5));
        assert_eq!(line("server.inline.b.c[1]"), Some(6));
        assert_eq!(line("class.batch"), Some(8));
        assert_eq!(line("class.batch.deadline_ms"), Some(9));
        assert_eq!(line("class.my.class.quoted key"), Some(12));
        assert_eq!(line("classify.rule[0].class"), Some(15));
        assert_eq!(line("classify.rule[1]"), Some(17));
        assert_eq!(line("classify.rule[1].class"), Some(18));
        assert_eq!(line("classify.rule[1].models[1]"), Some(19));
    }

    #[test]
    fn a_key_not_written_is_placed_at_its_nearest_parent() {
        assert_eq!(line("class.batch.throttle"), Some(8));
        assert_eq!(line("classify.rule[1].source"), Some(17));
        assert_eq!(line("nowhere.at.all"), None);
        assert_eq!(line_of_key("not = = toml", "not"), None);
    }

    #[test]
    fn the_key_at_an_offset_is_the_innermost_one() {
        let at = |needle: &str| key_at_offset(TEXT, offset_of(needle));
        assert_eq!(at("1\ndotted").as_deref(), Some("top"));
        assert_eq!(at("\"x\"").as_deref(), Some("dotted.inner"));
        assert_eq!(at("20]").as_deref(), Some("server.inline.b.c[1]"));
        assert_eq!(at("a = 1").as_deref(), Some("server.inline.a"));
        assert_eq!(at("true").as_deref(), Some("class.my.class.quoted key"));
        assert_eq!(at("\"chat\"").as_deref(), Some("classify.rule[1].class"));
        assert_eq!(key_at_offset(TEXT, offset_of("\n\n[server]")), None);
    }

    #[test]
    fn the_key_of_a_line_toml_refuses_is_read_under_its_table() {
        let at_end = |text: &str| key_at_offset(text, text.trim_end().len());
        assert_eq!(
            at_end("[server]\nlisten = \"a\"\nport = ").as_deref(),
            Some("server.port")
        );
        assert_eq!(
            at_end("top = 99999999999999999999999").as_deref(),
            Some("top")
        );
        assert_eq!(
            at_end("[[a.rule]]\nx = 1\n[[a.rule]]\n\"k=v\".y = [1,").as_deref(),
            Some("a.rule[1].k=v.y")
        );
        assert_eq!(
            at_end("[class.\"x y\"]\nthrottle = 'open").as_deref(),
            Some("class.x y.throttle")
        );
        assert_eq!(at_end("[server"), None);
    }

    #[test]
    fn lines_are_counted_from_one() {
        assert_eq!(line_of_offset("a\nb\nc", 0), 1);
        assert_eq!(line_of_offset("a\nb\nc", 2), 2);
        assert_eq!(line_of_offset("a\nb\nc", 99), 3);
    }
}
