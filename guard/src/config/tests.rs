use std::path::Path;

use super::*;

fn parse(text: &str) -> Result<Config, ConfigError> {
    Config::parse(text, Path::new("test.toml"))
}

fn invalid(text: &str) -> (Option<usize>, String, String) {
    match parse(text) {
        Err(ConfigError::Invalid {
            line, key, problem, ..
        }) => (line, key, crate::error_chain(&problem)),
        other => panic!("expected one invalid key, got {other:?}"),
    }
}

/// The problem a refused text has with `key` (among any others), as `invalid` gives it.
fn invalid_key(text: &str, key: &str) -> (Option<usize>, String, String) {
    let err = parse(text).expect_err("refused");
    err.problems()
        .into_iter()
        .find_map(|problem| match problem {
            ConfigError::Invalid {
                line,
                key: named,
                problem,
                ..
            } if named == key => Some((*line, named.clone(), crate::error_chain(problem))),
            _ => None,
        })
        .unwrap_or_else(|| panic!("{text}: no problem with {key} in {err:?}"))
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
fn a_header_rule_without_its_value_is_refused_not_read_as_empty() {
    let text =
        "[[classify.rule]]\nname = \"r\"\nclass = \"batch\"\nheader = { name = \"x-team\" }\n";
    let (line, key, message) = invalid(text);
    assert_eq!(line, Some(4));
    assert_eq!(key, "classify.rule[0].header");
    assert_eq!(message, "missing key `value`");
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

    let (_, key, message) = invalid_key(
        "[class.batch]\ncgroup = \"/sys/fs/cgroup/b\"\nthrottle = \"slow\"\n",
        "class.batch.throttle",
    );
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
fn a_value_that_meets_an_error_says_file_line_key_and_the_error_once() {
    let said = |text: &str| crate::error_chain(&parse(text).expect_err("refused"));
    let token = std::env::temp_dir().join(format!("guard-no-token-{}", std::process::id()));
    let text = format!("[metrics]\nbearer_token_file = \"{}\"\n", token.display());
    assert_eq!(
        said(&text),
        format!(
            "test.toml:2: metrics.bearer_token_file: cannot read {}: no such file or directory",
            token.display()
        )
    );
    assert_eq!(
        said("[[classify.rule]]\nclass = \"batch\"\nsource = \"10.0.0.0/99\"\n"),
        "test.toml:3: classify.rule[0].source: `10.0.0.0/99` is not an address or CIDR block: \
         invalid IP address syntax"
    );
    let url = said("[upstream]\nurl = \"http://x:1/v1\"\n");
    assert!(
        url.starts_with("test.toml:2: upstream.url: ")
            && url.contains("`http://x:1/v1`: give scheme, host and port only, no path"),
        "{url}"
    );
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

#[test]
fn zero_negative_and_huge_limits_are_refused_by_key_and_line() {
    for (text, key) in [
        (
            "[upstream]\nmax_concurrency = 0\n",
            "upstream.max_concurrency",
        ),
        (
            "[upstream]\nmax_concurrency = 70000\n",
            "upstream.max_concurrency",
        ),
        (
            "[upstream]\nmax_concurrency = -1\n",
            "upstream.max_concurrency",
        ),
        (
            "[server]\nheader_read_timeout_ms = 0\n",
            "server.header_read_timeout_ms",
        ),
        (
            "[server]\nbody_limit_bytes = 0\n",
            "server.body_limit_bytes",
        ),
        (
            "[upstream]\nresponse_timeout_ms = 18446744073709551615\n",
            "upstream.response_timeout_ms",
        ),
        (
            "[class.batch]\ndeadline_ms = 0\n",
            "class.batch.deadline_ms",
        ),
        (
            "[class.batch]\nmax_queue = 2000000\n",
            "class.batch.max_queue",
        ),
        (
            "[class.batch]\nupstream_idle_ms = 0\n",
            "class.batch.upstream_idle_ms",
        ),
        (
            "[class.batch]\nclient_stall_ms = 999999999999\n",
            "class.batch.client_stall_ms",
        ),
        (
            "[class.batch]\nbody_read_timeout_ms = 0\n",
            "class.batch.body_read_timeout_ms",
        ),
        (
            "[class.batch]\nmax_duration_ms = 0\n",
            "class.batch.max_duration_ms",
        ),
        (
            "[risk]\nswap_in_pages_per_second = nan\n",
            "risk.swap_in_pages_per_second",
        ),
        (
            "[risk]\nswap_in_pages_per_second = -1.0\n",
            "risk.swap_in_pages_per_second",
        ),
        ("[risk]\nwait_fraction = inf\n", "risk.wait_fraction"),
        ("[watch]\ninterval_ms = 10\n", "watch.interval_ms"),
    ] {
        let (line, named, message) = invalid_key(text, key);
        assert_eq!(named, key, "{text}: {message}");
        assert!(line.is_some(), "{text}: no line");
    }
}

#[test]
fn zero_means_what_the_example_file_says() {
    let config = parse(
        "[server]\ndrain_grace_ms = 0\n[estimate]\ninitial_service_ms = 0\n\
         [class.interactive]\n[class.batch]\nmax_queue = 0\n[risk]\nhold_ms = 0\n",
    )
    .expect("zero is meaningful here");
    assert_eq!(config.class["batch"].max_queue, 0);
}

mod properties {
    use std::sync::Arc;

    use proptest::prelude::*;

    use super::*;
    use crate::{
        metrics::Metrics,
        queue::{Job, Scheduler},
    };

    /// Every integer and float key, with the table it lives in.
    const INTEGERS: &[(&str, &str)] = &[
        ("server", "header_read_timeout_ms"),
        ("server", "body_limit_bytes"),
        ("server", "drain_grace_ms"),
        ("upstream", "max_concurrency"),
        ("upstream", "connect_timeout_ms"),
        ("upstream", "response_timeout_ms"),
        ("estimate", "initial_service_ms"),
        ("watch", "interval_ms"),
        ("watch", "cold_load_ms"),
        ("risk", "hold_ms"),
        ("risk", "ttft_min_samples"),
        ("risk", "protect_priority"),
        ("class.batch", "priority"),
        ("class.batch", "max_queue"),
        ("class.batch", "deadline_ms"),
        ("class.batch", "body_read_timeout_ms"),
        ("class.batch", "upstream_idle_ms"),
        ("class.batch", "client_stall_ms"),
        ("class.batch", "max_duration_ms"),
    ];
    const FLOATS: &[(&str, &str)] = &[
        ("risk", "wait_fraction"),
        ("risk", "swap_in_pages_per_second"),
        ("risk", "memory_pressure"),
        ("risk", "gpu_memory"),
    ];

    fn integer() -> impl Strategy<Value = i64> {
        prop_oneof![
            Just(0),
            Just(-1),
            Just(1),
            Just(i64::MAX),
            Just(i64::MIN),
            0..10_000i64,
            any::<i64>(),
        ]
    }

    fn float() -> impl Strategy<Value = String> {
        prop_oneof![
            Just("nan".to_owned()),
            Just("inf".to_owned()),
            Just("-inf".to_owned()),
            any::<f64>().prop_map(|f| format!("{f:?}")),
            (0.0..1.5f64).prop_map(|f| format!("{f:?}")),
        ]
    }

    /// A config text setting some keys, and the keys it set.
    fn config_text() -> impl Strategy<Value = (String, Vec<String>)> {
        let ints = proptest::collection::vec((0..INTEGERS.len(), integer()), 0..4);
        let floats = proptest::collection::vec((0..FLOATS.len(), float()), 0..2);
        (ints, floats).prop_map(|(ints, floats)| {
            let mut tables: std::collections::BTreeMap<&str, Vec<String>> = Default::default();
            // The default class must stay: a [class.*] table replaces the built-in classes.
            tables.insert("class.interactive", Vec::new());
            let mut keys: Vec<String> = Vec::new();
            let mut set = |(table, key): (&'static str, &str), value: String| {
                let name = format!("{table}.{key}");
                if !keys.contains(&name) {
                    tables
                        .entry(table)
                        .or_default()
                        .push(format!("{key} = {value}"));
                    keys.push(name);
                }
            };
            for (index, value) in ints {
                set(INTEGERS[index], value.to_string());
            }
            for (index, value) in floats {
                set(FLOATS[index], value);
            }
            let text = tables
                .iter()
                .map(|(table, lines)| format!("[{table}]\n{}\n", lines.join("\n")))
                .collect::<String>();
            (text, keys)
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: 512,
            rng_seed: proptest::test_runner::RngSeed::Fixed(0xc0f16),
            ..ProptestConfig::default()
        })]

        /// Any values: the loader never panics; a refusal names a key the text set, with its
        /// line; an accepted config drives the scheduler without overflow or division by zero.
        #[test]
        fn random_values_are_refused_by_key_or_used_safely(
            (text, keys) in config_text(),
            tokens in proptest::option::of(any::<u64>()),
        ) {
            match parse(&text) {
                Err(err) => {
                    for problem in err.problems() {
                        let ConfigError::Invalid { key, line, .. } = problem else {
                            return Err(TestCaseError::fail(format!("{problem}")));
                        };
                        let named = keys.contains(key);
                        prop_assert!(named, "{key} is none of {keys:?}\n{text}");
                        prop_assert!(line.is_some(), "no line for {key}\n{text}");
                    }
                }
                Ok(config) => exercise(&config, tokens),
            }
        }
    }

    /// Admits, predicts and reports with an accepted config.
    fn exercise(config: &Config, tokens: Option<u64>) {
        let scheduler: Arc<Scheduler> = Scheduler::new(config, Metrics::new());
        let mut tickets = Vec::new();
        for class in ["batch", "interactive", "batch"] {
            let job = Job {
                class: class.to_owned(),
                model: Some("m".to_owned()),
                tokens,
                preemptible: class == "batch",
                flow: 0,
                prompt_tokens: 10,
            };
            if let Ok(ticket) = scheduler.enqueue(job) {
                tickets.push(ticket);
            }
        }
        let _ = scheduler.snapshot();
        let _ = scheduler.wait_fractions();
        for class in config.class.values() {
            let _ = class.timeouts();
        }
        drop(tickets);
        assert_eq!(scheduler.load().0, 0);
    }
}

#[test]
fn listeners_take_a_list_and_refuse_an_overlap_naming_the_key() {
    let config =
        parse("[server]\nlisten = [\"127.0.0.1:7000\", \"[::1]:7000\"]\n").expect("a list");
    assert_eq!(config.server.listen.addrs().len(), 2);
    let cases = [
        (
            "[server]\nlisten = [\"127.0.0.1:7000\", \"0.0.0.0:7000\"]\n",
            "server.listen",
        ),
        (
            "[server]\nlisten = \"[::]:7000\"\n[metrics]\nlisten = [\"127.0.0.1:7001\", \"[::1]:7000\"]\n",
            "metrics.listen",
        ),
        (
            "[cluster]\nagent_listen = \"127.0.0.1:9464\"\n",
            "cluster.agent_listen",
        ),
    ];
    for (text, expected) in cases {
        let (line, key, message) = invalid(text);
        assert_eq!(key, expected, "{text}");
        assert!(line.is_some(), "{text}");
        assert!(message.contains("overlaps"), "{message}");
    }
}

/// Every leaf key path where two serialised configs differ (a list counts as one leaf).
fn differences(a: &toml::Value, b: &toml::Value, path: &str, out: &mut Vec<String>) {
    match (a, b) {
        (toml::Value::Table(a), toml::Value::Table(b)) => {
            let keys: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
            for key in keys {
                let path = if path.is_empty() {
                    key.clone()
                } else {
                    format!("{path}.{key}")
                };
                match (a.get(key), b.get(key)) {
                    (Some(a), Some(b)) => differences(a, b, &path, out),
                    _ => out.push(path),
                }
            }
        }
        (a, b) if a != b => out.push(path.to_owned()),
        _ => {}
    }
}

/// The comment lines right above line `line` (1-based) and that line's own comment.
fn comments_at(text: &str, line: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    let own = lines[line - 1].split_once('#').map_or("", |(_, c)| c);
    let above = lines[..line - 1]
        .iter()
        .rev()
        .take_while(|l| l.trim_start().starts_with('#'))
        .copied()
        .collect::<Vec<_>>();
    format!("{} {own}", above.join(" "))
}

/// The example is the truth: where it sets a key to other than what a run without a config
/// has, a comment right above the key (or on its line) says "Not the default" and what is.
#[test]
fn the_example_differs_from_a_config_less_run_only_where_it_says_so() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/guard.example.toml");
    let text = std::fs::read_to_string(&path).expect("read example");
    let example = toml::Value::try_from(Config::load(&path).expect("parses")).expect("value");
    let defaults = toml::Value::try_from(Config::default()).expect("value");
    let mut differ = Vec::new();
    differences(&example, &defaults, "", &mut differ);
    let undocumented: Vec<&String> = differ
        .iter()
        .filter(|key| {
            let line = locate::line_of_written_key(&text, key)
                .or_else(|| locate::line_of_written_key(&text, &format!("{key}[0]")));
            !line.is_some_and(|line| comments_at(&text, line).contains("Not the default"))
        })
        .collect();
    assert!(
        undocumented.is_empty(),
        "deploy/guard.example.toml sets these unlike a run without a config, and no \
         \"Not the default\" comment above them says so: {undocumented:?} (all that differ: \
         {differ:?})"
    );
}

/// Each problem as `line: key`, in the order they are reported.
fn problems(text: &str) -> Vec<String> {
    parse(text)
        .expect_err("refused")
        .problems()
        .into_iter()
        .map(|problem| match problem {
            ConfigError::Invalid { line, key, .. } => format!("{}: {key}", line.unwrap_or(0)),
            other => panic!("{other}"),
        })
        .collect()
}

#[test]
fn every_problem_is_reported_once_on_its_own_line() {
    let text = "top = 1\n[sever]\nx = 1\n[server]\nlisten = 5\nbody_limit_bytes = \"big\"\n\
                [[classify.rule]]\nclass = \"batch\"\nheader = { name = \"x\", valu = \"y\" }\n\
                [[classify.rule]]\nclass = \"nope\"\npath_prefix = \"/a\"\n\
                [class.interactive]\n[class.batch]\ndeadline_ms = 0\nmax_queue = -1\n";
    assert_eq!(
        problems(text),
        [
            "1: top",
            "2: sever",
            "5: server.listen",
            "6: server.body_limit_bytes",
            "9: classify.rule[0].header.valu",
            "11: classify.rule[1].class",
            "15: class.batch.deadline_ms",
            "16: class.batch.max_queue",
        ]
    );
}

#[test]
fn a_class_table_that_replaces_the_built_in_ones_says_so_at_its_line() {
    let err = parse("# mine\n[class.chat]\ndeadline_ms = 1000\n").expect_err("refused");
    let said = crate::error_chain(&err);
    assert!(
        said.starts_with("test.toml:2: classify.default: unknown class `interactive`: known are chat. A [class.NAME] table replaces the built-in classes (batch, interactive)"),
        "{said}"
    );
    let rule = "[class.chat]\n[classify]\ndefault = \"chat\"\n[[classify.rule]]\nclass = \"batch\"\nmodel = \"x\"\n";
    let said = crate::error_chain(&parse(rule).expect_err("refused"));
    assert!(
        said.starts_with("test.toml:5: classify.rule[0].class: unknown class `batch`: known are chat. A [class.NAME] table replaces"),
        "{said}"
    );
}
