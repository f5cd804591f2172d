//! What the types alone cannot check: every limit and duration within a range that means what
//! `deploy/guard.example.toml` says, names that exist, patterns that compile.

use std::{net::SocketAddr, path::Path};

use super::{ClassConfig, Config, Problem, ResolvedRule, RuleConfig, UidSpec, overlap, parse_cidr};
use crate::secret::Secret;

/// The longest duration any `_ms` key may name: a week. Longer is surely a typo, and keeps
/// every deadline guard computes far from overflow.
pub const MAX_MS: u64 = 7 * 24 * 3_600_000;
/// More upstream slots than this is not a machine guard can protect.
pub const MAX_CONCURRENCY: u64 = 65_536;
/// A class queue longer than this holds more clients than one host can keep connected.
pub const MAX_QUEUE: u64 = 1_000_000;
/// A request body over this is not a generation request.
pub const MAX_BODY_BYTES: u64 = 1 << 30;
/// More client connections than this is more than a host's descriptors.
pub const MAX_CONNECTIONS: u64 = 1_000_000;

/// An offending key and why.
#[derive(Debug)]
pub(super) struct Invalid {
    pub key: String,
    pub problem: Problem,
    /// Where the line to show is, when the key itself is not written (a default that the
    /// file's other keys made wrong).
    pub place: Option<String>,
}

impl Invalid {
    fn new(key: impl Into<String>, message: impl Into<String>) -> Self {
        Self::caused(key, Problem::Said(message.into()))
    }

    /// The key and the error its value met.
    fn caused(key: impl Into<String>, problem: impl Into<Problem>) -> Self {
        Self {
            key: key.into(),
            problem: problem.into(),
            place: None,
        }
    }
}

/// One integer key and the range it must lie in.
pub(super) struct Range {
    key: String,
    value: u64,
    min: u64,
    max: u64,
}

impl Range {
    fn new(key: impl Into<String>, value: u64, min: u64, max: u64) -> Self {
        Self {
            key: key.into(),
            value,
            min,
            max,
        }
    }

    fn check(self) -> Result<(), Invalid> {
        if (self.min..=self.max).contains(&self.value) {
            return Ok(());
        }
        Err(Invalid::new(
            &self.key,
            self.out_of_range(&self.value.to_string()),
        ))
    }

    /// What the key takes, in words: "a whole number of milliseconds from 1 to 604800000".
    pub(super) fn words(&self) -> String {
        let unit = if self.key.ends_with("_ms") {
            " of milliseconds"
        } else if self.key.ends_with("_bytes") || self.key.ends_with("_bytes_in_flight") {
            " of bytes"
        } else {
            ""
        };
        format!("a whole number{unit} from {} to {}", self.min, self.max)
    }

    pub(super) fn out_of_range(&self, value: &str) -> String {
        format!("{value} is out of range: use {}", self.words())
    }
}

/// The range of an integer key (`class.NAME.KEY` for any name), as validation checks it.
pub(super) fn range_of(key: &str) -> Option<Range> {
    let defaults = Config::default();
    let mut ranges = defaults.ranges();
    if let Some(class) = key
        .strip_prefix("class.")
        .and_then(|rest| rest.rsplit_once('.'))
        .map(|(name, _)| name)
    {
        let mut every = ClassConfig::new(0, 0, Some(1));
        every.max_duration_ms = Some(1);
        every.max_queue_per_flow = Some(1);
        ranges.extend(class_ranges(class, &every));
    }
    ranges.into_iter().find(|range| range.key == key)
}

/// What a key that is not a whole number takes, in words.
pub(super) fn words_of(key: &str) -> Option<&'static str> {
    Some(match key {
        "risk.wait_fraction" | "risk.memory_pressure" | "risk.gpu_memory" => {
            "a fraction above 0 and at most 1 (such as 0.5)"
        }
        "risk.swap_in_pages_per_second" => "a number of pages per second, 0 or more",
        _ => return None,
    })
}

/// A class's integer limits, with their ranges.
fn class_ranges(name: &str, class: &ClassConfig) -> Vec<Range> {
    let key = |field: &str| format!("class.{name}.{field}");
    let mut ranges = vec![
        Range::new(key("max_queue"), class.max_queue as u64, 0, MAX_QUEUE),
        Range::new(
            key("body_read_timeout_ms"),
            class.body_read_timeout_ms,
            1,
            MAX_MS,
        ),
        Range::new(key("upstream_idle_ms"), class.upstream_idle_ms, 1, MAX_MS),
        Range::new(key("client_stall_ms"), class.client_stall_ms, 1, MAX_MS),
    ];
    if let Some(per_flow) = class.max_queue_per_flow {
        ranges.push(Range::new(
            key("max_queue_per_flow"),
            per_flow as u64,
            1,
            MAX_QUEUE,
        ));
    }
    for (field, value) in [
        ("deadline_ms", class.deadline_ms),
        ("max_duration_ms", class.max_duration_ms),
    ] {
        if let Some(value) = value {
            ranges.push(Range::new(key(field), value, 1, MAX_MS));
        }
    }
    ranges
}

impl Config {
    /// Checks what the types alone cannot: every offending key, and why.
    pub(super) fn validate(&self) -> Vec<Invalid> {
        let mut found = self.check_listeners();
        found.extend(self.ranges().into_iter().filter_map(|r| r.check().err()));
        found.extend(self.check_paths());
        found.extend(self.check_risk());
        found.extend(self.check_classes());
        found.extend(self.check_rules());
        found.extend(self.check_cluster());
        found
    }

    /// No two listening addresses, within a key or across keys, would take the same socket.
    fn check_listeners(&self) -> Vec<Invalid> {
        let keys = [
            ("server.listen", self.server.listen.addrs()),
            ("metrics.listen", self.metrics.listen.addrs()),
            ("cluster.agent_listen", self.cluster.agent_listen.as_slice()),
        ];
        let all: Vec<(&str, SocketAddr)> = keys
            .iter()
            .flat_map(|(key, addrs)| addrs.iter().map(|addr| (*key, *addr)))
            .collect();
        let mut found = Vec::new();
        for (n, &(key, addr)) in all.iter().enumerate() {
            if let Some((earlier, taken)) = all[..n].iter().find(|(_, a)| overlap(*a, addr)) {
                found.push(Invalid::new(
                    key,
                    format!("{addr} overlaps {taken} ({earlier}): each address once"),
                ));
            }
        }
        found
    }

    /// The agent's classes exist; the model-server path is a path of its own on the metrics
    /// listener.
    fn check_cluster(&self) -> Vec<Invalid> {
        let cluster = &self.cluster;
        let mut found: Vec<Invalid> = cluster
            .agent_classes
            .iter()
            .flatten()
            .filter(|class| !self.class.contains_key(*class))
            .map(|class| {
                Invalid::new(
                    "cluster.agent_classes",
                    format!("no class `{class}` (classes: {})", self.class_names()),
                )
            })
            .collect();
        let path = &cluster.model_server_path;
        let valid = path.starts_with('/')
            && path.len() <= 256
            && path
                .bytes()
                .all(|b| b.is_ascii_graphic() && b != b'?' && b != b'%')
            && !["/metrics", "/status"].contains(&path.as_str());
        if !valid {
            found.push(Invalid::new(
                "cluster.model_server_path",
                "a path of its own: starts with `/`, no `?` or `%`, not /metrics or /status",
            ));
        }
        found
    }

    /// Every integer limit outside the classes, with its range.
    fn ranges(&self) -> Vec<Range> {
        let server = &self.server;
        let mut ranges = self.fixed_ranges();
        // A body of the largest allowed size must fit, or it could never be read (and where
        // that size is itself refused, this would only repeat it).
        if (1..=MAX_BODY_BYTES).contains(&server.body_limit_bytes) {
            ranges.push(Range::new(
                "server.max_body_bytes_in_flight",
                server.max_body_bytes_in_flight,
                server.body_limit_bytes,
                64 << 30,
            ));
        }
        ranges
    }

    /// The integer limits whose ranges depend on no other key.
    // xtask: table
    fn fixed_ranges(&self) -> Vec<Range> {
        let (server, upstream) = (&self.server, &self.upstream);
        vec![
            Range::new(
                "server.header_read_timeout_ms",
                server.header_read_timeout_ms,
                1,
                MAX_MS,
            ),
            Range::new(
                "server.body_limit_bytes",
                server.body_limit_bytes,
                1,
                MAX_BODY_BYTES,
            ),
            Range::new("server.drain_grace_ms", server.drain_grace_ms, 0, MAX_MS),
            Range::new(
                "server.max_connections",
                u64::from(server.max_connections),
                1,
                MAX_CONNECTIONS,
            ),
            Range::new(
                "server.ready_connections",
                u64::from(server.ready_connections),
                0,
                MAX_CONNECTIONS,
            ),
            Range::new(
                "upstream.max_passthrough",
                u64::from(upstream.max_passthrough),
                1,
                MAX_CONCURRENCY,
            ),
            Range::new(
                "metrics.max_connections",
                u64::from(self.metrics.max_connections),
                1,
                4_096,
            ),
            Range::new(
                "metrics.header_read_timeout_ms",
                self.metrics.header_read_timeout_ms,
                1,
                MAX_MS,
            ),
            Range::new(
                "upstream.max_concurrency",
                u64::from(upstream.max_concurrency),
                1,
                MAX_CONCURRENCY,
            ),
            Range::new(
                "upstream.connect_timeout_ms",
                upstream.connect_timeout_ms,
                1,
                MAX_MS,
            ),
            Range::new(
                "upstream.response_timeout_ms",
                upstream.response_timeout_ms,
                1,
                MAX_MS,
            ),
            Range::new(
                "estimate.initial_service_ms",
                self.estimate.initial_service_ms,
                0,
                MAX_MS,
            ),
            Range::new("watch.interval_ms", self.watch.interval_ms, 100, MAX_MS),
            Range::new("watch.cold_load_ms", self.watch.cold_load_ms, 0, MAX_MS),
            Range::new("risk.hold_ms", self.risk.hold_ms, 0, MAX_MS),
            Range::new("risk.max_throttle_ms", self.risk.max_throttle_ms, 1, MAX_MS),
            // 0 would take a hold again the moment max_throttle_ms let it go.
            Range::new("risk.min_release_ms", self.risk.min_release_ms, 1, MAX_MS),
            Range::new(
                "risk.preempt_grace_ms",
                self.risk.preempt_grace_ms,
                0,
                MAX_MS,
            ),
            Range::new("risk.min_run_ms", self.risk.min_run_ms, 0, MAX_MS),
            Range::new(
                "risk.ttft_min_samples",
                self.risk.ttft_min_samples as u64,
                0,
                1_000,
            ),
        ]
    }

    fn check_paths(&self) -> Vec<Invalid> {
        let mut found = Vec::new();
        for (index, path) in self.server.queued_paths.iter().enumerate() {
            let key = format!("server.queued_paths[{index}]");
            if !path.starts_with('/') {
                found.push(Invalid::new(key, format!("`{path}` must start with /")));
            } else if let Err(err) = crate::route::normalize(path) {
                found.push(Invalid::caused(key, err));
            }
        }
        if let Some(access) = &self.log.access
            && access != "-"
            && !std::path::Path::new(access).is_absolute()
        {
            found.push(Invalid::new(
                "log.access",
                "an absolute path, or \"-\" for standard output",
            ));
        }
        found
    }

    fn check_risk(&self) -> Vec<Invalid> {
        let mut found = Vec::new();
        for (key, value) in [
            ("risk.wait_fraction", self.risk.wait_fraction),
            ("risk.memory_pressure", self.risk.memory_pressure),
            ("risk.gpu_memory", self.risk.gpu_memory),
        ] {
            // NaN fails both comparisons.
            if !(value > 0.0 && value <= 1.0) {
                let words = words_of(key).unwrap_or_default();
                found.push(Invalid::new(
                    key,
                    format!("{value} is out of range: use {words}"),
                ));
            }
        }
        let rate = self.risk.swap_in_pages_per_second;
        if !(rate.is_finite() && rate >= 0.0) {
            found.push(Invalid::new(
                "risk.swap_in_pages_per_second",
                format!("{rate} is not a rate: use 0 or more"),
            ));
        }
        if !self.risk.state_dir.is_absolute() {
            found.push(Invalid::new("risk.state_dir", "must be an absolute path"));
        }
        found
    }

    fn check_classes(&self) -> Vec<Invalid> {
        if self.class.is_empty() {
            return vec![Invalid::new("class", "at least one class is needed")];
        }
        self.class
            .iter()
            .flat_map(|(name, class)| check_class(name, class))
            .collect()
    }

    fn check_rules(&self) -> Vec<Invalid> {
        let mut found = Vec::new();
        if !self.class.contains_key(&self.classify.default) {
            found.push(self.unknown_class("classify.default", &self.classify.default));
        }
        for (index, rule) in self.classify.rule.iter().enumerate() {
            let key = |field: &str| format!("classify.rule[{index}].{field}");
            if rule.class.is_empty() {
                found.push(Invalid::new(
                    key("class"),
                    format!(
                        "a rule needs the class it gives: class = \"NAME\" (one of {})",
                        self.class_names()
                    ),
                ));
            } else if !self.class.contains_key(&rule.class) {
                found.push(self.unknown_class(&key("class"), &rule.class));
            }
            found.extend(
                rule.check()
                    .into_iter()
                    .map(|field| Invalid::caused(key(&field.key), field.problem)),
            );
        }
        found
    }

    /// `key` names a class that is not defined; where it is a built-in one that the file's
    /// own classes replaced, it says so, and the line shown is the first class table's.
    fn unknown_class(&self, key: &str, class: &str) -> Invalid {
        let known = self.class_names();
        let builtin = Config::default();
        if !builtin.class.contains_key(class) {
            return Invalid::new(key, format!("unknown class `{class}`: known are {known}"));
        }
        let first = self.class.keys().next().cloned().unwrap_or_default();
        let mut invalid = Invalid::new(
            key,
            format!(
                "unknown class `{class}`: known are {known}. A [class.NAME] table replaces the \
                 built-in classes ({}): define [class.{class}] too, or set {key} to one of \
                 yours",
                builtin.class_names()
            ),
        );
        invalid.place = Some(format!("class.{first}"));
        invalid
    }
}

/// One class's name, limits and cgroup.
fn check_class(name: &str, class: &ClassConfig) -> Vec<Invalid> {
    let key = |field: &str| format!("class.{name}.{field}");
    let valid_name = name
        .chars()
        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '-');
    let mut found = Vec::new();
    if !valid_name || name.is_empty() || name.len() > 64 {
        found.push(Invalid::new(
            format!("class.{name}"),
            "class names use 1 to 64 of a-z, 0-9, '_' and '-'",
        ));
    }
    found.extend(
        class_ranges(name, class)
            .into_iter()
            .filter_map(|r| r.check().err()),
    );
    if let Some(cgroup) = &class.cgroup
        && !cgroup.is_absolute()
    {
        found.push(Invalid::new(
            key("cgroup"),
            format!("{} is not an absolute path", cgroup.display()),
        ));
    }
    if class.throttle.is_some() && class.cgroup.is_none() {
        found.push(Invalid::new(
            key("throttle"),
            format!("throttle needs the cgroup it holds back: set class.{name}.cgroup"),
        ));
    }
    found
}

impl Config {
    /// Reads what the config names but does not hold: bearer tokens (from digests and files,
    /// relative to `dir`, the config's folder) and user names. Returns what could not be read.
    pub(super) fn resolve(&mut self, dir: &Path) -> Vec<Invalid> {
        let mut found = Vec::new();
        if let Some(file) = &self.metrics.bearer_token_file {
            match Secret::from_file(&dir.join(file)) {
                Ok(secret) => self.metrics.bearer = Some(secret),
                Err(err) => found.push(Invalid::caused("metrics.bearer_token_file", err)),
            }
        }
        for (index, rule) in self.classify.rule.iter_mut().enumerate() {
            match rule.resolve(dir) {
                Ok(resolved) => rule.resolved = resolved,
                Err(field) => found.push(Invalid::caused(
                    format!("classify.rule[{index}].{}", field.key),
                    field.problem,
                )),
            }
        }
        found
    }
}

impl RuleConfig {
    fn resolve(&self, dir: &Path) -> Result<ResolvedRule, Invalid> {
        let bearer = match (&self.bearer, &self.bearer_sha256, &self.bearer_file) {
            (Some(token), None, None) => Some(Secret::of(token)),
            (None, Some(digest), None) => {
                Some(Secret::from_hex(digest).map_err(|e| Invalid::caused("bearer_sha256", e))?)
            }
            (None, None, Some(file)) => Some(
                Secret::from_file(&dir.join(file))
                    .map_err(|e| Invalid::caused("bearer_file", e))?,
            ),
            (None, None, None) => None,
            _ => {
                return Err(Invalid::new(
                    "bearer",
                    "give one of bearer, bearer_sha256 and bearer_file",
                ));
            }
        };
        let uid = match &self.uid {
            None => None,
            Some(UidSpec::Id(id)) => Some(*id),
            Some(UidSpec::Name(name)) => Some(
                nix::unistd::User::from_name(name)
                    .ok()
                    .flatten()
                    .ok_or_else(|| {
                        Invalid::new("uid", format!("no user `{}`", crate::quote::quote(name)))
                    })?
                    .uid
                    .as_raw(),
            ),
        };
        Ok(ResolvedRule { bearer, uid })
    }

    /// Checks that the rule matches on something and that its patterns compile: each key
    /// that does not.
    fn check(&self) -> Vec<Invalid> {
        let mut found = Vec::new();
        let matchers = [
            self.path_prefix.is_some(),
            self.model.is_some(),
            self.bearer.is_some() || self.bearer_sha256.is_some() || self.bearer_file.is_some(),
            self.user_agent.is_some(),
            self.source.is_some(),
            self.cgroup_prefix.is_some(),
            self.uid.is_some(),
            self.unit.is_some(),
            self.exe.is_some(),
            self.header.is_some(),
        ];
        if !matchers.contains(&true) {
            found.push(Invalid::new(
                "class",
                "a rule needs one of path_prefix, model, bearer, bearer_sha256, bearer_file, \
                 user_agent, source, cgroup_prefix, uid, unit, exe, header",
            ));
        }
        if let Some(unit) = &self.unit
            && (unit.is_empty() || unit.contains('/'))
        {
            found.push(Invalid::new(
                "unit",
                "name one unit or slice, e.g. `nightly-extract.service` (no `/`)",
            ));
        }
        if let Some(header) = &self.header
            && http::HeaderName::try_from(header.name.as_str()).is_err()
        {
            found.push(Invalid::new("header.name", "not a header name"));
        }
        if self
            .name
            .as_ref()
            .is_some_and(|n| n.is_empty() || n.len() > 64 || n == "header" || n == "default")
        {
            found.push(Invalid::new(
                "name",
                "give 1 to 64 characters, not `header` or `default` (what guard calls those)",
            ));
        }
        if self
            .bearer
            .as_ref()
            .is_some_and(|token| token.trim().is_empty())
        {
            found.push(Invalid::new(
                "bearer",
                "an empty token would match any client",
            ));
        }
        let header_value = self.header.as_ref().map(|h| h.value.clone());
        for (field, glob) in [
            ("model", &self.model),
            ("user_agent", &self.user_agent),
            ("exe", &self.exe),
            ("header.value", &header_value),
        ] {
            if let Some(glob) = glob
                && let Err(err) = globset::Glob::new(glob)
            {
                found.push(Invalid::caused(field, err));
            }
        }
        if let Some(source) = &self.source
            && let Err(err) = parse_cidr(source)
        {
            found.push(Invalid::caused("source", err));
        }
        found
    }
}
