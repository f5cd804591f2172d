//! The top-level members of a JSON object, found without building a tree: a request body may be
//! megabytes of prompt nested to any depth, and guard needs only a few fields (the model, the
//! tokens asked for). Values are skipped with a depth counter, so memory stays constant
//! whatever the nesting (serde_json recurses, with a limit of 128; jiter's skip stops at 255;
//! the upstream may take deeper bodies), and nothing but the bytes is kept.
//!
//! The scan checks only what it needs to find member boundaries: the upstream judges the rest.

/// Where the scan stopped understanding the body.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("not a JSON object at byte {at}")]
pub struct ScanError {
    pub at: usize,
}

/// Calls `visit(key, value)` for each top-level member of the object in `bytes`, in order,
/// with both as raw JSON (the key with its quotes and escapes).
pub fn members<'a>(
    bytes: &'a [u8],
    mut visit: impl FnMut(&'a [u8], &'a [u8]),
) -> Result<(), ScanError> {
    let mut scan = Scan { bytes, at: 0 };
    scan.expect(b'{')?;
    if scan.peek() == Some(b'}') {
        return Ok(());
    }
    loop {
        scan.skip_whitespace();
        let key_start = scan.at;
        scan.string()?;
        let key = &bytes[key_start..scan.at];
        scan.expect(b':')?;
        scan.skip_whitespace();
        let value_start = scan.at;
        scan.value()?;
        visit(key, &bytes[value_start..scan.at]);
        match scan.next_token() {
            Some(b',') => {}
            Some(b'}') => return Ok(()),
            _ => return Err(scan.error()),
        }
    }
}

struct Scan<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Scan<'_> {
    fn error(&self) -> ScanError {
        ScanError { at: self.at }
    }

    fn skip_whitespace(&mut self) {
        while self
            .bytes
            .get(self.at)
            .is_some_and(|b| matches!(b, b' ' | b'\t' | b'\n' | b'\r'))
        {
            self.at += 1;
        }
    }

    /// The next byte after whitespace, without taking it.
    fn peek(&mut self) -> Option<u8> {
        self.skip_whitespace();
        self.bytes.get(self.at).copied()
    }

    /// Takes the next byte after whitespace.
    fn next_token(&mut self) -> Option<u8> {
        let byte = self.peek()?;
        self.at += 1;
        Some(byte)
    }

    fn expect(&mut self, byte: u8) -> Result<(), ScanError> {
        match self.next_token() {
            Some(found) if found == byte => Ok(()),
            _ => Err(self.error()),
        }
    }

    /// A string, from its opening quote to after its closing one.
    fn string(&mut self) -> Result<(), ScanError> {
        if self.bytes.get(self.at) != Some(&b'"') {
            return Err(self.error());
        }
        let mut at = self.at + 1;
        loop {
            match self.bytes.get(at) {
                Some(b'"') => break,
                Some(b'\\') => at += 2,
                Some(_) => at += 1,
                None => return Err(ScanError { at }),
            }
        }
        self.at = at + 1;
        Ok(())
    }

    /// One value: a string, a container (to its matching close, by depth), or a scalar.
    fn value(&mut self) -> Result<(), ScanError> {
        match self.bytes.get(self.at) {
            Some(b'"') => self.string(),
            Some(b'{' | b'[') => self.container(),
            Some(_) => {
                let start = self.at;
                while self.bytes.get(self.at).is_some_and(|b| {
                    !matches!(b, b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r')
                }) {
                    self.at += 1;
                }
                if self.at == start {
                    return Err(self.error());
                }
                Ok(())
            }
            None => Err(self.error()),
        }
    }

    fn container(&mut self) -> Result<(), ScanError> {
        let mut depth: u64 = 0;
        loop {
            match self.bytes.get(self.at) {
                Some(b'"') => self.string()?,
                Some(b'{' | b'[') => {
                    depth += 1;
                    self.at += 1;
                }
                Some(b'}' | b']') => {
                    depth -= 1;
                    self.at += 1;
                    if depth == 0 {
                        return Ok(());
                    }
                }
                Some(_) => self.at += 1,
                None => return Err(self.error()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn collect(text: &str) -> Result<Vec<(String, String)>, ScanError> {
        let mut found = Vec::new();
        members(text.as_bytes(), |k, v| {
            found.push((
                String::from_utf8_lossy(k).into_owned(),
                String::from_utf8_lossy(v).into_owned(),
            ));
        })?;
        Ok(found)
    }

    #[test]
    fn top_level_members_come_raw_and_in_order() {
        let found = collect(
            r#" { "model" : "m\"x", "options": {"a": [1, {"b": "}"}]}, "n": -1.5e3, "t": true } "#,
        )
        .expect("scans");
        let keys: Vec<_> = found.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(keys, [r#""model""#, r#""options""#, r#""n""#, r#""t""#]);
        assert_eq!(found[0].1, r#""m\"x""#);
        assert_eq!(found[1].1, r#"{"a": [1, {"b": "}"}]}"#);
        assert_eq!(found[2].1, "-1.5e3");
        assert_eq!(collect("{}").expect("empty"), []);
    }

    #[test]
    fn depth_has_no_limit() {
        let deep = format!(
            r#"{{"x": {}{}, "model": "m"}}"#,
            "[".repeat(100_000),
            "]".repeat(100_000)
        );
        let found = collect(&deep).expect("scans");
        assert_eq!(found[1], (r#""model""#.to_owned(), r#""m""#.to_owned()));
    }

    #[test]
    fn what_is_not_an_object_is_an_error() {
        for text in [
            "",
            "[1]",
            "{",
            r#"{"a" 1}"#,
            r#"{"a": "#,
            r#"{"a": [}"#,
            r#"{"a": 1 "b": 2}"#,
            "{a: 1}",
        ] {
            assert!(collect(text).is_err(), "{text}");
        }
    }
}
