//! `guard exec --class NAME -- CMD...`: runs CMD inside the class's cgroup, so that guard can
//! throttle it. guard moves itself into the cgroup and then becomes CMD (exec), so CMD never
//! runs outside it.

use std::{os::unix::process::CommandExt as _, path::PathBuf, process::Command};

use guard::config::Config;

#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    #[error("unknown class `{class}`: known are {known}")]
    UnknownClass { class: String, known: String },
    #[error("class {class} has no cgroup: set class.{class}.cgroup in the config")]
    NoCgroup { class: String },
    #[error("cannot create or enter cgroup {}", path.display())]
    Cgroup {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot run {command}")]
    Spawn {
        command: String,
        source: std::io::Error,
    },
}

/// Moves this process into `class`'s cgroup and replaces it with `command`. Returns only on
/// failure.
pub fn exec(config: &Config, class: &str, command: &[String]) -> ExecError {
    let Some(settings) = config.class.get(class) else {
        return ExecError::UnknownClass {
            class: class.to_owned(),
            known: config.class_names(),
        };
    };
    let Some(path) = &settings.cgroup else {
        return ExecError::NoCgroup {
            class: class.to_owned(),
        };
    };
    let cgroup_error = |source| ExecError::Cgroup {
        path: path.clone(),
        source,
    };
    if let Err(err) = std::fs::create_dir_all(path) {
        return cgroup_error(err);
    }
    if let Err(err) = std::fs::write(path.join("cgroup.procs"), std::process::id().to_string()) {
        return cgroup_error(err);
    }
    let Some((program, args)) = command.split_first() else {
        return ExecError::Spawn {
            command: String::new(),
            source: std::io::Error::other("no command given"),
        };
    };
    let source = Command::new(program).args(args).exec();
    ExecError::Spawn {
        command: command.join(" "),
        source,
    }
}
