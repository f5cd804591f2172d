//! Client input quoted back in an error message: at most 64 bytes (docs/design.md §6), so a
//! client cannot make guard echo a large value.

const MAX: usize = 64;

/// `text`, cut to 64 bytes on a character boundary (with `…` where it was cut).
pub fn quote(text: &str) -> String {
    if text.len() <= MAX {
        return text.to_owned();
    }
    let mut end = MAX;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_input_is_cut_on_a_character_boundary() {
        assert_eq!(quote("short"), "short");
        let long = "é".repeat(100);
        let quoted = quote(&long);
        assert!(quoted.len() <= MAX + "…".len(), "{}", quoted.len());
        assert!(quoted.ends_with('…'));
    }
}
