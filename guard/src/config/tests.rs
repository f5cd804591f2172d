use std::path::Path;

use super::*;

fn parse(text: &str) -> Result<Config, ConfigError> {
    Config::parse(text, Path::new("test.toml"))
}

fn invalid(text: &str) -> (Option<usize>, String, String) {
    match parse(text) {
        Err(ConfigError::Invalid {
            line, key, message, ..
        }) => (line, key, message),
        other => panic!("expected an invalid config, got {other:?}"),
    }
}

#[test]
fn example_file_parses_and_documents_every_key() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/guard.example.toml");
    let config = Config::load(&path).expect("the example config parses");
    assert_eq!(config.class["interactive"].deadline_ms, Some(2000));
    assert_eq!(config.classify.rule.len(), 2);
    let text = std::fs::read_to_string(&path).expect("read example");
    // Every key of the defaults appears in the example, commented out or not.
    let defaults = toml::to_string(&Config::default()).expect("serialise defaults");
    for line in defaults.lines().filter(|l| l.contains(" = ")) {
        let key = line.split(" = ").next().expect("key");
        // Arrays of tables (`rule = []` in the defaults) are documented as `[[...rule]]`.
        let documented = text.contains(&format!("{key} = ")) || text.contains(&format!(".{key}]]"));
        assert!(
            documented,
            "deploy/guard.example.toml does not document `{key}`"
        );
    }
}

#[test]
fn empty_file_gives_the_builtin_defaults() {
    assert_eq!(parse("").expect("empty parses"), Config::default());
}

#[test]
fn unknown_key_is_named_with_its_line() {
    let (line, key, message) = invalid("[server]\nlisten = \"127.0.0.1:1\"\nlisen = 3\n");
    assert_eq!(line, Some(3));
    assert!(key.starts_with("server"), "key {key}");
    assert!(message.contains("lisen"), "message {message}");
}

#[test]
fn wrong_type_is_named_with_its_line() {
    let (line, key, _) = invalid("[upstream]\n\nmax_concurrency = \"two\"\n");
    assert_eq!((line, key.as_str()), (Some(3), "upstream.max_concurrency"));
}

#[test]
fn semantic_errors_name_key_and_line() {
    let text = "[classify]\ndefault = \"chat\"\n";
    let (line, key, message) = invalid(text);
    assert_eq!((line, key.as_str()), (Some(2), "classify.default"));
    assert!(message.contains("batch, interactive"), "{message}");

    let text = "[[classify.rule]]\nclass = \"batch\"\npath_prefix = \"/a\"\n\n[[classify.rule]]\nclass = \"nope\"\nmodel = \"x*\"\n";
    let (line, key, _) = invalid(text);
    assert_eq!((line, key.as_str()), (Some(6), "classify.rule[1].class"));

    let (_, key, message) =
        invalid("[class.batch]\ncgroup = \"/sys/fs/cgroup/b\"\nthrottle = \"slow\"\n");
    assert_eq!(key, "class.batch.throttle");
    assert!(message.contains("unknown throttle mode"), "{message}");

    let (_, key, _) = invalid("[upstream]\nurl = \"https://x:1\"\n");
    assert_eq!(key, "upstream.url");
    let (_, key, _) = invalid("[[classify.rule]]\nclass = \"batch\"\nsource = \"10.0.0.0/99\"\n");
    assert_eq!(key, "classify.rule[0].source");
    let (_, key, _) = invalid("[[classify.rule]]\nclass = \"batch\"\n");
    assert_eq!(key, "classify.rule[0].class");
}

#[test]
fn throttle_modes_parse() {
    assert_eq!("freeze".parse(), Ok(Throttle::Freeze));
    assert_eq!("cpu:10".parse(), Ok(Throttle::Cpu(10)));
    assert!("cpu:0".parse::<Throttle>().is_err());
    assert!("cpu:".parse::<Throttle>().is_err());
}

#[test]
fn syntax_error_has_a_line() {
    let (line, _, _) = invalid("[server]\nlisten = \n");
    assert_eq!(line, Some(2));
}
