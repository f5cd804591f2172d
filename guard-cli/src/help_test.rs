//! Every subcommand and argument of the command line says what it is in `--help`.

use clap::CommandFactory as _;

use crate::cli::Cli;

/// Each subcommand without an about, and each argument without help, by its path.
fn blank(command: &clap::Command, path: &str, out: &mut Vec<String>) {
    for arg in command.get_arguments() {
        let builtin = matches!(arg.get_id().as_str(), "help" | "version");
        if !builtin && arg.get_help().is_none() && arg.get_long_help().is_none() {
            out.push(format!("{path} {}", arg.get_id()));
        }
    }
    for sub in command.get_subcommands() {
        let path = format!("{path} {}", sub.get_name());
        if sub.get_name() != "help" && sub.get_about().is_none() {
            out.push(path.clone());
        }
        blank(sub, &path, out);
    }
}

#[test]
fn no_help_entry_is_blank() {
    let command = Cli::command();
    command.clone().debug_assert();
    let mut missing = Vec::new();
    blank(&command, "guard", &mut missing);
    assert!(missing.is_empty(), "--help says nothing of: {missing:?}");
}
