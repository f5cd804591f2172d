//! `cargo xtask modules`: the graph of guard's top-level modules (who names whom through
//! `crate::`), printed one module a line; it fails on a cycle. Test code (`tests.rs`,
//! `tests/`, a trailing `#[cfg(test)] mod tests`) is left out: it may reach anywhere. Then
//! the length of every function of the workspace (`lengths.rs`).

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result, bail};

/// Top-level module -> the top-level modules it uses.
pub type Graph = BTreeMap<String, BTreeSet<String>>;

/// The crate graph, each crate's module graph, then the function lengths: all run, and any
/// fails it.
pub fn check() -> Result<()> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let crates = crate::crates::check(&root);
    let mut modules = Ok(());
    for krate in crate::crates::CRATES.iter().filter(|c| c.modules) {
        println!("{}:", krate.name);
        modules = modules.and(graph_check(&root.join(krate.dir).join("src")));
    }
    let lengths = crate::lengths::check(&root);
    crates.and(modules).and(lengths)
}

fn graph_check(src: &Path) -> Result<()> {
    let graph = graph(src)?;
    for (module, uses) in &graph {
        let uses: Vec<&str> = uses.iter().map(String::as_str).collect();
        println!("{module:<10} -> {}", uses.join(", "));
    }
    if let Some(cycle) = cycle(&graph) {
        bail!(
            "import cycle between top-level modules: {}",
            cycle.join(" -> ")
        );
    }
    println!("no cycle among {} modules", graph.len());
    Ok(())
}

/// Reads every module under `src` (not `lib.rs` or `main.rs`, which wire them).
pub fn graph(src: &Path) -> Result<Graph> {
    let mut files: BTreeMap<String, Vec<PathBuf>> = BTreeMap::new();
    for entry in std::fs::read_dir(src).with_context(|| format!("reading {}", src.display()))? {
        let path = entry?.path();
        let Some(name) = path.file_stem().and_then(|n| n.to_str()).map(str::to_owned) else {
            continue;
        };
        if path.is_dir() {
            files.entry(name).or_default().extend(rust_files(&path)?);
        } else if path.extension().is_some_and(|e| e == "rs")
            && !matches!(name.as_str(), "lib" | "main")
        {
            files.entry(name).or_default().push(path);
        }
    }
    let names: BTreeSet<String> = files.keys().cloned().collect();
    let mut graph = Graph::new();
    for (module, paths) in &files {
        let uses = graph.entry(module.clone()).or_default();
        for path in paths {
            let text = std::fs::read_to_string(path)?;
            for used in crate_paths(production(&text)) {
                if used != *module && names.contains(&used) {
                    uses.insert(used);
                }
            }
        }
    }
    Ok(graph)
}

fn rust_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        if name == "tests" || name == "tests.rs" {
            continue;
        }
        if path.is_dir() {
            found.extend(rust_files(&path)?);
        } else if path.extension().is_some_and(|e| e == "rs") {
            found.push(path);
        }
    }
    Ok(found)
}

/// The text before a trailing test module.
fn production(text: &str) -> &str {
    text.find("#[cfg(test)]\nmod tests")
        .map_or(text, |at| &text[..at])
}

/// The first segment after every `crate::`, including those in `use crate::{a, b::c}`.
fn crate_paths(text: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    for (at, _) in text.match_indices("crate::") {
        let rest = &text[at + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let end = matching_brace(group);
            for item in split_top_level(&group[..end]) {
                found.insert(first_segment(item));
            }
        } else {
            found.insert(first_segment(rest));
        }
    }
    found
}

fn first_segment(path: &str) -> String {
    path.trim()
        .chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect()
}

/// The index of the `}` closing a group that starts right after its `{`.
fn matching_brace(group: &str) -> usize {
    let mut depth = 0usize;
    for (at, c) in group.char_indices() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => return at,
            '}' => depth -= 1,
            _ => {}
        }
    }
    group.len()
}

/// The items of a `use` group, split on commas outside nested braces.
fn split_top_level(group: &str) -> Vec<&str> {
    let (mut items, mut depth, mut start) = (Vec::new(), 0usize, 0);
    for (at, c) in group.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                items.push(&group[start..at]);
                start = at + 1;
            }
            _ => {}
        }
    }
    items.push(&group[start..]);
    items
}

/// A cycle, if the graph has one.
pub fn cycle(graph: &Graph) -> Option<Vec<String>> {
    #[derive(Clone, Copy, PartialEq)]
    enum Mark {
        Open,
        Done,
    }
    fn visit(
        node: &str,
        graph: &Graph,
        marks: &mut BTreeMap<String, Mark>,
        path: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        match marks.get(node) {
            Some(Mark::Done) => return None,
            Some(Mark::Open) => {
                let start = path.iter().position(|n| n == node).unwrap_or(0);
                let mut cycle = path[start..].to_vec();
                cycle.push(node.to_owned());
                return Some(cycle);
            }
            None => {}
        }
        marks.insert(node.to_owned(), Mark::Open);
        path.push(node.to_owned());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(cycle) = visit(next, graph, marks, path) {
                return Some(cycle);
            }
        }
        path.pop();
        marks.insert(node.to_owned(), Mark::Done);
        None
    }
    let mut marks = BTreeMap::new();
    graph
        .keys()
        .find_map(|node| visit(node, graph, &mut marks, &mut Vec::new()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crate_paths_are_read_from_uses_and_expressions() {
        let text = "use crate::{config::Config, proxy::{a, b}, queue};\nfn f() { crate::metrics::x(); }\n#[cfg(test)]\nmod tests { use crate::daemon; }";
        let found = crate_paths(production(text));
        let names: Vec<&str> = found.iter().map(String::as_str).collect();
        assert_eq!(names, ["config", "metrics", "proxy", "queue"]);
    }

    #[test]
    fn a_cycle_is_found() {
        let mut graph = Graph::new();
        graph.entry("a".into()).or_default().insert("b".into());
        graph.entry("b".into()).or_default().insert("c".into());
        graph.entry("c".into()).or_default();
        assert_eq!(cycle(&graph), None);
        graph.entry("c".into()).or_default().insert("a".into());
        assert_eq!(
            cycle(&graph),
            Some(vec!["a".into(), "b".into(), "c".into(), "a".into()])
        );
    }

    /// The modules of each crate form no cycle (docs/design.md §2a).
    #[test]
    fn no_crate_has_an_import_cycle() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        for krate in crate::crates::CRATES.iter().filter(|c| c.modules) {
            let graph = graph(&root.join(krate.dir).join("src")).expect("read a crate's src");
            assert!(graph.len() >= 5, "{}: {graph:?}", krate.name);
            assert_eq!(cycle(&graph), None, "{}: {graph:#?}", krate.name);
        }
    }

    /// Each crate uses only those below it, and forbids `unsafe` unless it is one of the
    /// three that hold it (docs/design.md §2a).
    #[test]
    fn the_crate_graph_holds() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        crate::crates::check(&root).expect("the crate graph");
    }

    /// No function of the workspace is longer than 80 lines, but for marked tables.
    #[test]
    fn no_function_is_too_long() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        crate::lengths::check(&root).expect("function lengths");
    }
}
