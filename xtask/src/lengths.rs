//! `cargo xtask modules`, its second check: no function of the workspace is longer than
//! [`MAX_LINES`] lines, so each reads at once. Every `.rs` file of guard, guard-common,
//! guard-ebpf, xtask and tests (not `target/`, not `fuzz/`) is parsed with syn; functions,
//! methods, trait methods with a body, functions inside other functions and those written
//! inside macro calls (`proptest! { ... }`) all count, tests included. A function's length runs
//! from its `fn` line to its closing brace; its doc comment and attributes are not counted.
//!
//! A declarative table (a long list of rows and little else) may be longer: the line
//! `// xtask: table` among the comments and attributes right above the function exempts it.

use std::{
    fmt,
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result, bail};
use proc_macro2::{Delimiter, Span, TokenStream, TokenTree};
use syn::visit::Visit;

/// The longest a function may be.
pub const MAX_LINES: usize = 80;

/// The comment that marks a declarative table, which may be longer.
pub const TABLE_MARK: &str = "// xtask: table";

/// One function, where it starts and how long it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Function {
    pub file: PathBuf,
    /// The 1-based line of its `fn`.
    pub line: usize,
    /// `name`, or `Type::name` for a method.
    pub name: String,
    pub lines: usize,
    /// Marked with [`TABLE_MARK`].
    pub table: bool,
}

impl fmt::Display for Function {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let table = if self.table { ", a table" } else { "" };
        write!(
            f,
            "{}:{} fn {} ({} lines{table})",
            self.file.display(),
            self.line,
            self.name,
            self.lines
        )
    }
}

/// Prints the five longest functions; fails listing every one over [`MAX_LINES`] lines that
/// is not a marked table.
pub fn check(root: &Path) -> Result<()> {
    let mut functions = Vec::new();
    let dirs = crate::crates::CRATES.iter().map(|c| c.dir);
    for dir in dirs.chain(["guard-testkit"]) {
        let dir = root.join(dir);
        if !dir.exists() {
            continue;
        }
        for file in rust_files(&dir)? {
            let text = std::fs::read_to_string(&file)
                .with_context(|| format!("reading {}", file.display()))?;
            let shown = file.strip_prefix(root).unwrap_or(&file);
            functions.extend(functions_in(shown, &text)?);
        }
    }
    functions.sort_by(|a, b| b.lines.cmp(&a.lines).then_with(|| a.file.cmp(&b.file)));
    println!("the five longest functions of {}:", functions.len());
    for function in functions.iter().take(5) {
        println!("  {function}");
    }
    let too_long: Vec<&Function> = functions
        .iter()
        .filter(|f| f.lines > MAX_LINES && !f.table)
        .collect();
    if !too_long.is_empty() {
        eprintln!("longer than {MAX_LINES} lines:");
        for function in &too_long {
            eprintln!("  {function}");
        }
        bail!(
            "{} functions are longer than {MAX_LINES} lines: split them into named steps \
             (a declarative table may be marked `{TABLE_MARK}`)",
            too_long.len()
        );
    }
    println!("no function over {MAX_LINES} lines");
    Ok(())
}

/// Every `.rs` file under `dir`, leaving out build output and the fuzz workspace.
fn rust_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut found = Vec::new();
    let entries = std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))?;
    for entry in entries {
        let path = entry?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if path.is_dir() {
            if !matches!(name, "target" | "fuzz") && !name.starts_with('.') {
                found.extend(rust_files(&path)?);
            }
        } else if path.extension().is_some_and(|e| e == "rs") {
            found.push(path);
        }
    }
    found.sort();
    Ok(found)
}

/// The functions of one file's text; `file` names it in what is found.
pub fn functions_in(file: &Path, text: &str) -> Result<Vec<Function>> {
    let syntax =
        syn::parse_file(text).with_context(|| format!("parsing {} with syn", file.display()))?;
    let mut finder = Finder {
        file,
        lines: text.lines().collect(),
        owner: Vec::new(),
        found: Vec::new(),
    };
    finder.visit_file(&syntax);
    finder.found.sort_by_key(|f| f.line);
    Ok(finder.found)
}

/// Walks a file's syntax tree and notes each function.
struct Finder<'a> {
    file: &'a Path,
    lines: Vec<&'a str>,
    /// The type of the `impl` or the trait being walked, innermost last.
    owner: Vec<String>,
    found: Vec<Function>,
}

impl Finder<'_> {
    /// Notes a function whose item starts at `first` (its attributes), `fn` at `start`, and
    /// whose body closes at `end`.
    fn note(&mut self, name: String, first: Span, start: Span, end: Span) {
        let line = start.start().line;
        let name = match self.owner.last() {
            Some(owner) => format!("{owner}::{name}"),
            None => name,
        };
        self.found.push(Function {
            file: self.file.to_owned(),
            line,
            name,
            lines: end.end().line + 1 - line,
            table: self.marked(first.start().line.min(line), line),
        });
    }

    /// Whether the table mark is among the comment lines above `first` or the lines from
    /// there to the `fn` line (attributes, doc comments).
    fn marked(&self, first: usize, line: usize) -> bool {
        let mut top = first;
        while top > 1 && self.lines[top - 2].trim_start().starts_with("//") {
            top -= 1;
        }
        self.lines[top - 1..line]
            .iter()
            .any(|l| l.trim() == TABLE_MARK)
    }

    /// Functions written inside a macro call's tokens, which syn leaves unparsed: each `fn`
    /// with a name, up to the next braced group.
    fn functions_in_tokens(&mut self, tokens: TokenStream) {
        let mut tokens = tokens.into_iter().peekable();
        while let Some(token) = tokens.next() {
            match token {
                TokenTree::Ident(fn_token) if fn_token == "fn" => {
                    let Some(TokenTree::Ident(name)) = tokens.peek().cloned() else {
                        continue;
                    };
                    let body = tokens.find_map(|t| match t {
                        TokenTree::Group(g) if g.delimiter() == Delimiter::Brace => Some(g),
                        _ => None,
                    });
                    if let Some(body) = body {
                        let span = fn_token.span();
                        self.note(name.to_string(), span, span, body.span_close());
                        self.functions_in_tokens(body.stream());
                    }
                }
                TokenTree::Group(group) => self.functions_in_tokens(group.stream()),
                _ => {}
            }
        }
    }
}

/// Where an item starts: its first attribute (a doc comment is one), else its `fn`.
fn first_span(attrs: &[syn::Attribute], sig: &syn::Signature) -> Span {
    attrs
        .first()
        .map_or(sig.fn_token.span, |attr| attr.pound_token.span)
}

impl Finder<'_> {
    /// Notes a function whose body closes at `end`, then visits inside it, where functions
    /// belong to no impl.
    fn function(
        &mut self,
        attrs: &[syn::Attribute],
        sig: &syn::Signature,
        end: Option<Span>,
        inside: impl FnOnce(&mut Self),
    ) {
        if let Some(end) = end {
            let first = first_span(attrs, sig);
            self.note(sig.ident.to_string(), first, sig.fn_token.span, end);
        }
        let owners = std::mem::take(&mut self.owner);
        inside(self);
        self.owner = owners;
    }
}

impl<'ast> Visit<'ast> for Finder<'_> {
    fn visit_item_fn(&mut self, item: &'ast syn::ItemFn) {
        let end = Some(item.block.brace_token.span.close());
        self.function(&item.attrs, &item.sig, end, |finder| {
            syn::visit::visit_item_fn(finder, item);
        });
    }

    fn visit_impl_item_fn(&mut self, item: &'ast syn::ImplItemFn) {
        let end = Some(item.block.brace_token.span.close());
        self.function(&item.attrs, &item.sig, end, |finder| {
            syn::visit::visit_impl_item_fn(finder, item);
        });
    }

    fn visit_trait_item_fn(&mut self, item: &'ast syn::TraitItemFn) {
        let end = item
            .default
            .as_ref()
            .map(|body| body.brace_token.span.close());
        self.function(&item.attrs, &item.sig, end, |finder| {
            syn::visit::visit_trait_item_fn(finder, item);
        });
    }

    fn visit_item_impl(&mut self, item: &'ast syn::ItemImpl) {
        self.owner.push(type_name(&item.self_ty));
        syn::visit::visit_item_impl(self, item);
        self.owner.pop();
    }

    fn visit_item_trait(&mut self, item: &'ast syn::ItemTrait) {
        self.owner.push(item.ident.to_string());
        syn::visit::visit_item_trait(self, item);
        self.owner.pop();
    }

    fn visit_macro(&mut self, mac: &'ast syn::Macro) {
        // A `macro_rules!` body is a template, not functions.
        if !mac.path.is_ident("macro_rules") {
            self.functions_in_tokens(mac.tokens.clone());
        }
    }
}

/// The name of an impl's type: its last path segment (`Table` of `toml_edit::Table<'a>`).
fn type_name(ty: &syn::Type) -> String {
    match ty {
        syn::Type::Path(path) => path
            .path
            .segments
            .last()
            .map_or_else(|| "_".to_owned(), |s| s.ident.to_string()),
        syn::Type::Reference(reference) => type_name(&reference.elem),
        _ => "_".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = r#"//! A file.

/// Doc.
#[inline]
fn short() {
    let _ = 1;
}

struct S;

impl S {
    fn method(&self) -> u8 {
        fn inner() {}
        inner();
        1
    }
}

trait T {
    fn required(&self);
    fn provided(&self) {
        let _ = 2;
    }
}

// xtask: table
/// The rows.
#[expect(clippy::too_many_lines, reason = "a table")]
fn rows() -> [u8; 2] {
    [1, 2]
}

proptest::proptest! {
    #[test]
    fn property(x in 0..3u8) {
        let _ = x;
    }
}

macro_rules! template {
    ($name:ident) => { fn $name() {} };
}
"#;

    fn found() -> Vec<(usize, String, usize, bool)> {
        functions_in(Path::new("a.rs"), TEXT)
            .expect("parses")
            .into_iter()
            .map(|f| (f.line, f.name, f.lines, f.table))
            .collect()
    }

    #[test]
    fn functions_are_measured_from_fn_to_closing_brace() {
        let want = [
            (5, "short", 3, false),
            (12, "S::method", 5, false),
            (13, "inner", 1, false),
            (21, "T::provided", 3, false),
            (29, "rows", 3, true),
            (35, "property", 3, false),
        ];
        let want: Vec<(usize, String, usize, bool)> = want
            .into_iter()
            .map(|(line, name, lines, table)| (line, name.to_owned(), lines, table))
            .collect();
        assert_eq!(found(), want);
    }

    #[test]
    fn a_long_function_is_named_with_its_place() {
        let body = "    let _ = 0;\n".repeat(MAX_LINES);
        let text = format!("fn long() {{\n{body}}}\n");
        let functions = functions_in(Path::new("x/long.rs"), &text).expect("parses");
        assert_eq!(functions.len(), 1);
        assert_eq!(
            functions[0].to_string(),
            format!("x/long.rs:1 fn long ({} lines)", MAX_LINES + 2)
        );
    }

    #[test]
    fn a_file_syn_cannot_parse_is_an_error() {
        let err = functions_in(Path::new("bad.rs"), "fn (").expect_err("not rust");
        assert!(err.to_string().contains("bad.rs"), "{err}");
    }
}
