//! The user's documents work as written: every TOML block is a config `guard check-config
//! --file-only` accepts, and every `guard ...` command in a shell block names a real
//! subcommand with real flags.

use std::path::Path;

use clap::Parser as _;
use pulldown_cmark::{CodeBlockKind, Event, Parser, Tag, TagEnd};

use crate::cli::Cli;

/// The documents a user follows, from the workspace's root.
const DOCUMENTS: &[&str] = &[
    "README.md",
    "docs/install.md",
    "docs/access-log.md",
    "docs/logbook.md",
    "docs/cluster.md",
];

/// One fenced code block: its language, its text, and the line it starts on.
struct Block {
    language: String,
    text: String,
    line: usize,
}

fn blocks(markdown: &str) -> Vec<Block> {
    let mut blocks = Vec::new();
    let mut open: Option<Block> = None;
    for (event, range) in Parser::new(markdown).into_offset_iter() {
        match event {
            Event::Start(Tag::CodeBlock(CodeBlockKind::Fenced(language))) => {
                let line = markdown[..range.start].lines().count() + 1;
                open = Some(Block {
                    language: language.to_string(),
                    text: String::new(),
                    line,
                });
            }
            Event::Text(text) => {
                if let Some(block) = open.as_mut() {
                    block.text.push_str(&text);
                }
            }
            Event::End(TagEnd::CodeBlock) => blocks.extend(open.take()),
            _ => {}
        }
    }
    blocks
}

/// The command lines of a shell block: continuations joined, here-documents' bodies left
/// out; in a `console` block only the lines after a `$ ` prompt.
fn command_lines(block: &Block) -> Vec<String> {
    let console = block.language == "console";
    let mut commands = Vec::new();
    let mut pending = String::new();
    let mut heredoc: Option<String> = None;
    for line in block.text.lines() {
        if let Some(end) = &heredoc {
            if line.trim() == end {
                heredoc = None;
            }
            continue;
        }
        let line = match (console, pending.is_empty()) {
            (true, true) => match line.strip_prefix("$ ") {
                Some(command) => command,
                None => continue,
            },
            _ => line,
        };
        heredoc = heredoc_end(line);
        match line.strip_suffix('\\') {
            Some(start) => pending.push_str(start),
            None => {
                pending.push_str(line);
                commands.push(std::mem::take(&mut pending));
            }
        }
    }
    commands
}

/// `<<'EOF'` or `<<EOF` on a line: the word that ends the here-document.
fn heredoc_end(line: &str) -> Option<String> {
    let after = line.split("<<").nth(1)?;
    let word = after.trim_start_matches('-').split_whitespace().next()?;
    Some(word.trim_matches(['\'', '"']).to_owned())
}

/// The `guard` invocations in one command line (after `sudo`, variables, pipes and `&&`).
fn guard_invocations(line: &str) -> Vec<Vec<String>> {
    let Some(words) = shlex::split(line) else {
        return Vec::new();
    };
    words
        .split(|word| ["|", "||", "&&", ";"].contains(&word.as_str()))
        .filter_map(|command| {
            let mut words = command
                .iter()
                .skip_while(|w| *w == "sudo" || w.contains('='))
                .cloned();
            let program = words.next()?;
            (program == "guard" || program.ends_with("/guard"))
                .then(|| std::iter::once("guard".to_owned()).chain(words).collect())
        })
        .collect()
}

fn read(document: &str) -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    std::fs::read_to_string(root.join(document)).unwrap_or_else(|err| panic!("{document}: {err}"))
}

#[test]
fn every_config_block_passes_check_config() {
    let dir = std::env::temp_dir().join(format!("guard-readme-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a temporary directory");
    let mut checked = 0;
    let mut bad = Vec::new();
    for document in DOCUMENTS {
        for block in blocks(&read(document))
            .iter()
            .filter(|b| b.language == "toml")
        {
            let file = dir.join(format!(
                "{}-{}.toml",
                document.replace('/', "_"),
                block.line
            ));
            std::fs::write(&file, &block.text).expect("write the block");
            if let Err(err) = guard::config::Config::load(&file) {
                let problems: Vec<String> = err
                    .problems()
                    .into_iter()
                    .map(|p| guard::error_chain(p))
                    .collect();
                bad.push(format!("{document}:{}: {problems:?}", block.line));
            }
            checked += 1;
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        bad.is_empty(),
        "config blocks check-config refuses: {bad:#?}"
    );
    assert!(
        checked >= 3,
        "the README's config blocks were found: {checked}"
    );
}

#[test]
fn every_guard_command_is_a_real_subcommand_with_real_flags() {
    let mut checked = 0;
    let mut bad = Vec::new();
    for document in DOCUMENTS {
        let shell = ["sh", "console", "bash"];
        for block in blocks(&read(document))
            .iter()
            .filter(|b| shell.contains(&b.language.as_str()))
        {
            for line in command_lines(block) {
                for words in guard_invocations(&line) {
                    if let Err(err) = Cli::try_parse_from(&words) {
                        bad.push(format!("{document}:{}: {line}\n{err}", block.line));
                    }
                    checked += 1;
                }
            }
        }
    }
    assert!(
        bad.is_empty(),
        "commands guard would refuse:\n{}",
        bad.join("\n")
    );
    assert!(
        checked >= 10,
        "the README's guard commands were found: {checked}"
    );
}

#[test]
fn a_wrong_flag_or_subcommand_is_caught() {
    let console = Block {
        language: "console".to_owned(),
        text:
            "$ sudo guard chek-config\nguard not-a-command (output)\n$ guard status --nope \\\n  \
               --more\n$ X=1 guard doctor | head -3 && guard usage --by unit\n"
                .to_owned(),
        line: 1,
    };
    let shell = Block {
        language: "sh".to_owned(),
        text: "sudo tee f <<'EOF'\nguard not-a-command\nEOF\nguard restore # guard bogus\n"
            .to_owned(),
        line: 1,
    };
    let parsed = |block: &Block| -> Vec<bool> {
        command_lines(block)
            .iter()
            .flat_map(|line| guard_invocations(line))
            .map(|words| Cli::try_parse_from(&words).is_ok())
            .collect()
    };
    assert_eq!(parsed(&console), [false, false, true, true]);
    assert_eq!(parsed(&shell), [true]);
}
