//! `guard exec --class NAME -- CMD...`: runs CMD inside the class's cgroup, so that guard can
//! throttle it. guard moves itself into the cgroup and then becomes CMD (exec), so CMD never
//! runs outside it. Where it cannot, it exits as sysexits(3) says (docs/design.md §4).

use std::{io::ErrorKind, os::unix::process::CommandExt as _, path::PathBuf, process::Command};

use guard::{
    config::{Config, ConfigError},
    throttle::cgroup::{Cgroup, CgroupError},
};

/// sysexits(3): the command line was wrong (a class the config does not name).
pub const EX_USAGE: u8 = 64;
/// sysexits(3): the config file cannot be read.
pub const EX_NOINPUT: u8 = 66;
/// sysexits(3): an operating-system error (a cgroup the kernel will not let CMD join).
pub const EX_OSERR: u8 = 71;
/// sysexits(3): no permission to make or enter the cgroup.
pub const EX_NOPERM: u8 = 77;
/// sysexits(3): the config is invalid, or gives the class no usable cgroup.
pub const EX_CONFIG: u8 = 78;
/// As env(1) and the shells: CMD was found but cannot be run.
pub const CANNOT_RUN: u8 = 126;
/// As env(1) and the shells: CMD was not found.
pub const NOT_FOUND: u8 = 127;

#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    #[error("unknown class `{class}`: known are {known}")]
    UnknownClass { class: String, known: String },
    #[error(
        "class {class} has no cgroup: add `cgroup = \"/sys/fs/cgroup/guard/{class}\"` under \
         [class.{class}] in the config (where cgroup2 is mounted at /sys/fs/cgroup)"
    )]
    NoCgroup { class: String },
    #[error("class.{class}.cgroup cannot be used")]
    NotCgroup {
        class: String,
        #[source]
        source: CgroupError,
    },
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

impl ExecError {
    /// The exit status that says what went wrong (the table in docs/design.md §4).
    pub fn exit_code(&self) -> u8 {
        match self {
            Self::UnknownClass { .. } => EX_USAGE,
            Self::NoCgroup { .. } | Self::NotCgroup { .. } => EX_CONFIG,
            Self::Cgroup { source, .. } => match source.kind() {
                ErrorKind::PermissionDenied => EX_NOPERM,
                _ => EX_OSERR,
            },
            Self::Spawn { source, .. } => match source.kind() {
                ErrorKind::NotFound => NOT_FOUND,
                _ => CANNOT_RUN,
            },
        }
    }
}

/// The exit status for a config `guard exec` cannot use: unreadable, or invalid.
pub fn config_exit_code(err: &ConfigError) -> u8 {
    match err {
        ConfigError::Read { .. } => EX_NOINPUT,
        _ => EX_CONFIG,
    }
}

/// Moves this process into `class`'s cgroup and replaces it with `command`. Returns only on
/// failure.
pub fn exec(config: &Config, class: &str, command: &[String]) -> ExecError {
    let path = match cgroup_of(config, class) {
        Ok(path) => path,
        Err(err) => return err,
    };
    let cgroup_error = |source| ExecError::Cgroup {
        path: path.to_path_buf(),
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
            source: std::io::Error::new(ErrorKind::NotFound, "no command given"),
        };
    };
    let source = Command::new(program).args(args).exec();
    ExecError::Spawn {
        command: command.join(" "),
        source,
    }
}

/// The class's cgroup, where `exec` may join it: the class exists, names a cgroup, and that
/// path lies on a cgroup filesystem. Nothing is made or joined here.
fn cgroup_of<'a>(config: &'a Config, class: &str) -> Result<&'a std::path::Path, ExecError> {
    let settings = config
        .class
        .get(class)
        .ok_or_else(|| ExecError::UnknownClass {
            class: class.to_owned(),
            known: config.class_names(),
        })?;
    let path = settings
        .cgroup
        .as_deref()
        .ok_or_else(|| ExecError::NoCgroup {
            class: class.to_owned(),
        })?;
    // Made anywhere else, the directory and its cgroup.procs would be plain files, and CMD
    // would run outside any cgroup without a word.
    if let Err(source @ CgroupError::NotCgroup { .. }) = Cgroup::check(path, None) {
        return Err(ExecError::NotCgroup {
            class: class.to_owned(),
            source,
        });
    }
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_failure_exits_as_sysexits_says() {
        let mut config = Config::default();
        // The checks alone: were one to pass, `exec` would replace this test process.
        let run = |config: &Config, class: &str| {
            cgroup_of(config, class).expect_err("a check that passed")
        };
        assert_eq!(run(&config, "nope").exit_code(), EX_USAGE);
        let no_cgroup = run(&config, "batch");
        assert_eq!(no_cgroup.exit_code(), EX_CONFIG);
        assert!(
            no_cgroup
                .to_string()
                .contains("cgroup = \"/sys/fs/cgroup/guard/batch\""),
            "{no_cgroup}"
        );
        let plain = std::env::temp_dir().join(format!("guard-exec-plain-{}", std::process::id()));
        config.class.get_mut("batch").expect("batch").cgroup = Some(plain.clone());
        assert_eq!(run(&config, "batch").exit_code(), EX_CONFIG);
        assert!(!plain.exists(), "nothing made outside a cgroup filesystem");
        let spawn = |kind| ExecError::Spawn {
            command: "x".to_owned(),
            source: std::io::Error::from(kind),
        };
        assert_eq!(spawn(ErrorKind::NotFound).exit_code(), NOT_FOUND);
        assert_eq!(spawn(ErrorKind::PermissionDenied).exit_code(), CANNOT_RUN);
        let cgroup = |kind| ExecError::Cgroup {
            path: plain.clone(),
            source: std::io::Error::from(kind),
        };
        assert_eq!(cgroup(ErrorKind::PermissionDenied).exit_code(), EX_NOPERM);
        assert_eq!(cgroup(ErrorKind::ResourceBusy).exit_code(), EX_OSERR);
    }
}
