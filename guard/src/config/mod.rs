//! guard's configuration: the TOML file of docs/design.md §5, its defaults and its validation.
//!
//! Every key is documented in `deploy/guard.example.toml`; a test parses that file.

mod error;
mod listen;
mod locate;
mod plain;
mod read;
mod validate;

use std::{
    collections::BTreeMap,
    net::SocketAddr,
    path::{Path, PathBuf},
    time::Duration,
};

use serde::{Deserialize, Serialize};

pub use error::{CidrError, ConfigError, Problem, ThrottleModeError, UrlError};
pub use listen::{Listen, overlap};

/// Where `guard run` looks when `--config` is not given.
pub const DEFAULT_PATH: &str = "/etc/guard/guard.toml";

/// The whole configuration, after validation.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub server: ServerConfig,
    pub upstream: UpstreamConfig,
    pub metrics: MetricsConfig,
    pub ebpf: EbpfConfig,
    pub estimate: EstimateConfig,
    pub watch: WatchConfig,
    pub risk: RiskConfig,
    pub class: BTreeMap<String, ClassConfig>,
    pub classify: ClassifyConfig,
    pub cluster: ClusterConfig,
    pub log: LogConfig,
}

/// What guard writes besides its own log (docs/design.md §7a).
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct LogConfig {
    /// The access log: an absolute path, or `-` for standard output. Absent: off.
    pub access: Option<String>,
}

/// What guard tells the balancers above it (docs/design.md §11).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ClusterConfig {
    /// HAProxy's agent check: one line a connection on this address. Absent: off.
    pub agent_listen: Option<SocketAddr>,
    /// The classes the balancer's frontend serves: the agent's weight is their free room.
    /// Absent: every class.
    pub agent_classes: Option<Vec<String>>,
    /// Where the metrics listener serves the model-server view the llm-d router scrapes.
    pub model_server_path: String,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        Self {
            agent_listen: None,
            agent_classes: None,
            model_server_path: "/metrics/model-server".to_owned(),
        }
    }
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// One address or a list; every listener shares the limits below.
    pub listen: Listen,
    /// A client must send its whole request head within this time.
    pub header_read_timeout_ms: u64,
    /// Largest request body accepted on a queued endpoint; larger gets 413.
    pub body_limit_bytes: u64,
    /// On SIGTERM, how long running requests may take to finish.
    pub drain_grace_ms: u64,
    /// Whether a client's half-close (FIN) while its request is pending means it has gone.
    pub half_close_means_gone: bool,
    /// Paths whose POSTs are generation work (queued), matched as the upstream decodes them.
    pub queued_paths: Vec<String>,
    /// Client connections open at once; one more is answered 503 and closed.
    pub max_connections: u32,
    /// Client connections hyper may keep between requests; past it an idle one is parked.
    pub ready_connections: u32,
    /// Bytes of request bodies being read or waiting, over all connections; past it: 503.
    pub max_body_bytes_in_flight: u64,
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct UpstreamConfig {
    pub url: UpstreamUrl,
    pub api: Api,
    pub max_concurrency: u32,
    pub connect_timeout_ms: u64,
    /// Time from sending a request to the upstream's response head; past it guard answers 504.
    pub response_timeout_ms: u64,
    /// Refuse (403) requests for models served from elsewhere (Ollama's remote/cloud models):
    /// the default of every class's `allow_remote_models` is its opposite.
    pub refuse_remote_models: bool,
    /// Pass-through requests in flight at once; one more is answered 503.
    pub max_passthrough: u32,
}

/// The upstream's API flavour: decides the error body shape on paths it does not name itself.
#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Api {
    Ollama,
    Openai,
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsConfig {
    /// One address or a list.
    pub listen: Listen,
    /// Scrapers connected at once; more are closed at once.
    pub max_connections: u32,
    /// A scraper must send its request head within this time.
    pub header_read_timeout_ms: u64,
    /// A file whose first line is the token `/metrics` and `/status` then require
    /// (`Authorization: Bearer TOKEN`); absent means open.
    pub bearer_token_file: Option<PathBuf>,
    /// The token's digest, read from `bearer_token_file` when the config is read.
    #[serde(skip)]
    pub bearer: Option<crate::secret::Secret>,
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct EbpfConfig {
    /// Load the kernel program; with `false` guard detects closes in user space only.
    pub enabled: bool,
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct EstimateConfig {
    /// Service time assumed before the first request completes.
    pub initial_service_ms: u64,
}

impl Default for EstimateConfig {
    fn default() -> Self {
        Self {
            initial_service_ms: 1_000,
        }
    }
}

/// The watchers of what fails quietly.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct WatchConfig {
    pub interval_ms: u64,
    /// The inference server's pid; 0 finds it by the upstream's listening port.
    pub upstream_pid: u32,
    /// A model load (Ollama's load_duration) longer than this counts as a cold load.
    pub cold_load_ms: u64,
    /// Read llama-server's `/metrics` each tick (its own queue and KV usage). Off by default:
    /// each read resets llama-server's throughput gauges for every other scraper.
    pub upstream_metrics: bool,
}

impl Default for WatchConfig {
    fn default() -> Self {
        Self {
            interval_ms: 1_000,
            upstream_pid: 0,
            cold_load_ms: 1_000,
            upstream_metrics: false,
        }
    }
}

/// When protected classes' deadlines are at risk (docs/design.md §8).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct RiskConfig {
    /// Classes with a priority value at or below this are protected; those above are held back
    /// and throttled while at risk.
    pub protect_priority: i32,
    /// At risk when a protected request has waited this share of its deadline.
    pub wait_fraction: f64,
    /// At risk when a protected class's recent TTFT p95 exceeds its deadline (needs this many
    /// samples in the window).
    pub ttft_min_samples: usize,
    /// At risk above this swap-in rate.
    pub swap_in_pages_per_second: f64,
    /// At risk above this memory pressure (PSI full avg10, 0..1).
    pub memory_pressure: f64,
    /// At risk above this share of GPU memory used.
    pub gpu_memory: f64,
    /// Risk must stay clear this long before holds and throttles are lifted.
    pub hold_ms: u64,
    /// No class stays frozen or capped longer than this in one go, risk or not.
    pub max_throttle_ms: u64,
    /// After a release a class runs at least this long before it can be held again.
    pub min_release_ms: u64,
    /// A preemptible request the estimator expects to end within this is left to finish.
    pub preempt_grace_ms: u64,
    /// A preempted request that waited `max_throttle_ms` runs at least this long before it may
    /// be stopped again.
    pub min_run_ms: u64,
    /// Where guard records cgroup values before it changes them, to restore after a crash.
    pub state_dir: PathBuf,
}

impl Default for RiskConfig {
    fn default() -> Self {
        Self {
            protect_priority: 0,
            wait_fraction: 0.5,
            ttft_min_samples: 5,
            swap_in_pages_per_second: 100.0,
            memory_pressure: 0.10,
            gpu_memory: 0.95,
            hold_ms: 10_000,
            max_throttle_ms: 60_000,
            min_release_ms: 5_000,
            preempt_grace_ms: 100,
            min_run_ms: 1_000,
            state_dir: PathBuf::from("/var/lib/guard"),
        }
    }
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ClassConfig {
    /// Lower is served first.
    #[serde(default)]
    pub priority: i32,
    /// Requests that may wait; one more is rejected.
    #[serde(default = "default_max_queue")]
    pub max_queue: usize,
    /// Time-to-first-token deadline; absent means the class may wait.
    #[serde(default)]
    pub deadline_ms: Option<u64>,
    /// The cgroup this class's workloads run in.
    #[serde(default)]
    pub cgroup: Option<PathBuf>,
    /// How to throttle that cgroup while a higher class is at risk.
    #[serde(default)]
    pub throttle: Option<Throttle>,
    /// A client must send its whole body within this time (408, and nothing is queued).
    #[serde(default = "default_body_read_timeout_ms")]
    pub body_read_timeout_ms: u64,
    /// Mid-answer, the upstream must send its next frame within this time.
    #[serde(default = "default_upstream_idle_ms")]
    pub upstream_idle_ms: u64,
    /// A write to the client may stay blocked (the client does not read) this long.
    #[serde(default = "default_client_stall_ms")]
    pub client_stall_ms: u64,
    /// Arrival to last byte; absent means no limit.
    #[serde(default)]
    pub max_duration_ms: Option<u64>,
    /// Requests of one client are served in turn with other clients' (round robin weighted by
    /// estimated work), told apart by this: "uid", "unit", "cgroup", "token", "source" or
    /// "header:NAME"; absent: first come, first served.
    #[serde(default)]
    pub fair_by: Option<FairBy>,
    /// What a valid job's answer must be: "json" (its text parses as JSON).
    #[serde(default)]
    pub expect: Option<Expect>,
    /// Requests one flow may have waiting; one more is 503 (queue_full). Absent: max_queue.
    #[serde(default)]
    pub max_queue_per_flow: Option<usize>,
    /// Whether guard may stop this class's running generations for a more urgent class, and
    /// continue them later: `true`, `false`, or `"resume-only"` (never restart from scratch).
    #[serde(default)]
    pub preemptible: Preemptible,
    /// Whether this class may ask for a model served elsewhere (Ollama's remote and `-cloud`
    /// models); absent means the opposite of `upstream.refuse_remote_models`.
    #[serde(default)]
    pub allow_remote_models: Option<bool>,
}

impl ClassConfig {
    /// A class with the given priority, queue and deadline, and every other key at its default.
    pub fn new(priority: i32, max_queue: usize, deadline_ms: Option<u64>) -> Self {
        Self {
            priority,
            max_queue,
            deadline_ms,
            cgroup: None,
            throttle: None,
            body_read_timeout_ms: default_body_read_timeout_ms(),
            upstream_idle_ms: default_upstream_idle_ms(),
            client_stall_ms: default_client_stall_ms(),
            max_duration_ms: None,
            allow_remote_models: None,
            preemptible: Preemptible::No,
            fair_by: None,
            max_queue_per_flow: None,
            expect: None,
        }
    }

    /// The class's timeouts, as durations.
    pub fn timeouts(&self) -> ClassTimeouts {
        ClassTimeouts {
            body_read: Duration::from_millis(self.body_read_timeout_ms),
            upstream_idle: Duration::from_millis(self.upstream_idle_ms),
            client_stall: Duration::from_millis(self.client_stall_ms),
            max_duration: self.max_duration_ms.map(Duration::from_millis),
        }
    }
}

/// The limits on how long each part of a class's request may take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClassTimeouts {
    pub body_read: Duration,
    pub upstream_idle: Duration,
    pub client_stall: Duration,
    pub max_duration: Option<Duration>,
}

/// How a class's cgroup is held back.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Throttle {
    Freeze,
    /// CPU quota, in percent of one CPU.
    Cpu(u32),
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ClassifyConfig {
    pub default: String,
    /// A request naming a known class in this header gets it; "" turns it off.
    pub header: String,
    pub rule: Vec<RuleConfig>,
}

/// One classification rule: every matcher it names must match; the first matching rule wins.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RuleConfig {
    /// Left out, validation names it (rather than the reader stopping at a missing field).
    #[serde(default)]
    pub class: String,
    /// How `/status` and `guard_classified_total` name the rule; `rule N` when absent.
    pub name: Option<String>,
    /// Its matches may claim any class with the class header (a trusted front end).
    #[serde(default)]
    pub trust_header: bool,
    pub path_prefix: Option<String>,
    pub model: Option<String>,
    /// The bearer token itself (prefer `bearer_sha256` or `bearer_file`: no secret in the config).
    pub bearer: Option<String>,
    /// The hex SHA-256 digest of the bearer token.
    pub bearer_sha256: Option<String>,
    /// A file whose first line is the bearer token.
    pub bearer_file: Option<PathBuf>,
    pub user_agent: Option<String>,
    pub source: Option<String>,
    pub cgroup_prefix: Option<String>,
    /// The connecting process's user: a uid or a user name.
    pub uid: Option<UidSpec>,
    /// The systemd unit or slice the connecting process runs in (a component of its cgroup
    /// path, e.g. `nightly-extract.service` or `batch.slice`).
    pub unit: Option<String>,
    /// The connecting process's executable path (a glob).
    pub exe: Option<String>,
    /// A request header with exactly this value.
    pub header: Option<HeaderRule>,
    /// What the config's words resolve to, filled in when the config is read.
    #[serde(skip)]
    pub resolved: ResolvedRule,
}

/// What a class's answers must be to count as valid jobs.
#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Expect {
    Json,
}

/// What tells one client's requests from another's, for fair turns inside a class.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FairBy {
    Uid,
    Unit,
    Cgroup,
    Token,
    Source,
    Header(http::HeaderName),
}

impl<'de> Deserialize<'de> for FairBy {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let word = String::deserialize(deserializer)?;
        Ok(match word.as_str() {
            "uid" => Self::Uid,
            "unit" => Self::Unit,
            "cgroup" => Self::Cgroup,
            "token" => Self::Token,
            "source" => Self::Source,
            other => {
                let name = other
                    .strip_prefix("header:")
                    .and_then(|name| http::HeaderName::try_from(name.trim()).ok());
                Self::Header(name.ok_or_else(|| {
                    serde::de::Error::custom(format!(
                        "`{}`: use uid, unit, cgroup, token, source or header:NAME",
                        crate::quote::quote(other)
                    ))
                })?)
            }
        })
    }
}

impl Serialize for FairBy {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let word = match self {
            Self::Uid => "uid".to_owned(),
            Self::Unit => "unit".to_owned(),
            Self::Cgroup => "cgroup".to_owned(),
            Self::Token => "token".to_owned(),
            Self::Source => "source".to_owned(),
            Self::Header(name) => format!("header:{name}"),
        };
        serializer.serialize_str(&word)
    }
}

/// Whether a class's running generations may be stopped and continued later.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Preemptible {
    #[default]
    No,
    /// Continued from where it stopped, or restarted where that is not possible.
    Yes,
    /// Only where it can be continued from where it stopped.
    ResumeOnly,
    /// Only where it can be continued from the exact tokens it stopped at (llama-server).
    ExactOnly,
}

impl<'de> Deserialize<'de> for Preemptible {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(PreemptibleVisitor)
    }
}

struct PreemptibleVisitor;

impl serde::de::Visitor<'_> for PreemptibleVisitor {
    type Value = Preemptible;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("true, false, \"resume-only\" or \"exact-only\"")
    }

    fn visit_bool<E: serde::de::Error>(self, flag: bool) -> Result<Preemptible, E> {
        Ok(if flag {
            Preemptible::Yes
        } else {
            Preemptible::No
        })
    }

    fn visit_str<E: serde::de::Error>(self, word: &str) -> Result<Preemptible, E> {
        match word {
            "resume-only" => Ok(Preemptible::ResumeOnly),
            "exact-only" => Ok(Preemptible::ExactOnly),
            other => Err(E::invalid_value(serde::de::Unexpected::Str(other), &self)),
        }
    }
}

impl Serialize for Preemptible {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::No => serializer.serialize_bool(false),
            Self::Yes => serializer.serialize_bool(true),
            Self::ResumeOnly => serializer.serialize_str("resume-only"),
            Self::ExactOnly => serializer.serialize_str("exact-only"),
        }
    }
}

/// A header a rule matches: `header = { name = "x-team", value = "nightly-*" }` (the value a
/// glob: `*`, `?`, `[...]`, `{a,b}`; a value without them matches exactly).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct HeaderRule {
    pub name: String,
    pub value: String,
}

/// A user, by id or name.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
#[serde(untagged)]
pub enum UidSpec {
    Id(u32),
    Name(String),
}

impl<'de> Deserialize<'de> for UidSpec {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(UidVisitor)
    }
}

struct UidVisitor;

impl serde::de::Visitor<'_> for UidVisitor {
    type Value = UidSpec;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a uid (a whole number from 0 to 4294967295) or a user name in quotes")
    }

    fn visit_i64<E: serde::de::Error>(self, id: i64) -> Result<UidSpec, E> {
        u32::try_from(id)
            .map(UidSpec::Id)
            .map_err(|_| E::invalid_value(serde::de::Unexpected::Signed(id), &self))
    }

    fn visit_u64<E: serde::de::Error>(self, id: u64) -> Result<UidSpec, E> {
        u32::try_from(id)
            .map(UidSpec::Id)
            .map_err(|_| E::invalid_value(serde::de::Unexpected::Unsigned(id), &self))
    }

    fn visit_str<E: serde::de::Error>(self, name: &str) -> Result<UidSpec, E> {
        Ok(UidSpec::Name(name.to_owned()))
    }
}

/// A rule's bearer token and user, as resolved from digests, files and the user database.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ResolvedRule {
    pub bearer: Option<crate::secret::Secret>,
    pub uid: Option<u32>,
}

impl RuleConfig {
    /// The rule's label: its name, or `rule N` (1-based).
    pub fn label(&self, index: usize) -> String {
        self.name
            .clone()
            .unwrap_or_else(|| format!("rule {}", index + 1))
    }

    /// Whether the rule looks at the client's process (cgroup, user, unit, executable).
    pub fn reads_process(&self) -> bool {
        self.cgroup_prefix.is_some()
            || self.uid.is_some()
            || self.unit.is_some()
            || self.exe.is_some()
    }
}

impl Default for Config {
    fn default() -> Self {
        let class = BTreeMap::from([
            (
                "interactive".to_owned(),
                ClassConfig::new(0, 8, Some(2_000)),
            ),
            ("batch".to_owned(), ClassConfig::new(10, 1_000, None)),
        ]);
        Self {
            server: ServerConfig::default(),
            upstream: UpstreamConfig::default(),
            metrics: MetricsConfig::default(),
            ebpf: EbpfConfig::default(),
            estimate: EstimateConfig::default(),
            watch: WatchConfig::default(),
            risk: RiskConfig::default(),
            class,
            classify: ClassifyConfig::default(),
            cluster: ClusterConfig::default(),
            log: LogConfig::default(),
        }
    }
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            listen: Listen::one(SocketAddr::from(([127, 0, 0, 1], 11434))),
            header_read_timeout_ms: 10_000,
            body_limit_bytes: 16 << 20,
            drain_grace_ms: 30_000,
            half_close_means_gone: true,
            queued_paths: crate::route::DEFAULT_QUEUED
                .iter()
                .map(|p| (*p).to_owned())
                .collect(),
            max_connections: 4_096,
            ready_connections: 256,
            max_body_bytes_in_flight: 256 << 20,
        }
    }
}

impl Default for UpstreamConfig {
    fn default() -> Self {
        Self {
            url: UpstreamUrl::parse("http://127.0.0.1:11435")
                .unwrap_or_else(|_| unreachable!("the default upstream URL is well formed")),
            api: Api::Ollama,
            max_concurrency: 1,
            connect_timeout_ms: 2_000,
            response_timeout_ms: 300_000,
            refuse_remote_models: true,
            max_passthrough: 64,
        }
    }
}

impl Default for MetricsConfig {
    fn default() -> Self {
        Self {
            listen: Listen::one(SocketAddr::from(([127, 0, 0, 1], 9464))),
            max_connections: 32,
            header_read_timeout_ms: 5_000,
            bearer_token_file: None,
            bearer: None,
        }
    }
}

impl Default for EbpfConfig {
    fn default() -> Self {
        Self { enabled: true }
    }
}

impl Default for ClassifyConfig {
    fn default() -> Self {
        Self {
            default: "interactive".to_owned(),
            header: "x-guard-class".to_owned(),
            rule: Vec::new(),
        }
    }
}

fn default_max_queue() -> usize {
    64
}

fn default_body_read_timeout_ms() -> u64 {
    30_000
}

fn default_upstream_idle_ms() -> u64 {
    60_000
}

fn default_client_stall_ms() -> u64 {
    30_000
}

impl<'de> Deserialize<'de> for Throttle {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

impl Serialize for Throttle {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl std::fmt::Display for Throttle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Freeze => f.write_str("freeze"),
            Self::Cpu(percent) => write!(f, "cpu:{percent}"),
        }
    }
}

impl std::str::FromStr for Throttle {
    type Err = ThrottleModeError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        if text == "freeze" {
            return Ok(Self::Freeze);
        }
        let percent = text
            .strip_prefix("cpu:")
            .and_then(|n| n.parse::<u32>().ok())
            .filter(|n| (1..=100_000).contains(n));
        percent.map(Self::Cpu).ok_or_else(|| ThrottleModeError {
            text: text.to_owned(),
        })
    }
}

impl Config {
    /// Reads, parses and validates a file. A file that sets no key at all (empty, or
    /// comments only) is refused rather than taken for the built-in defaults: at start as on
    /// a reload, a half-written file must not wipe every class and rule.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            file: path.to_owned(),
            source,
        })?;
        if text
            .parse::<toml::Table>()
            .is_ok_and(|table| table.is_empty())
        {
            return Err(ConfigError::Empty {
                file: path.to_owned(),
            });
        }
        Self::parse(&text, path)
    }

    /// Model names the config spells out (rules' `model` without glob characters): with those
    /// the upstream lists, the only values a `model` label may take.
    pub fn named_models(&self) -> Vec<String> {
        self.classify
            .rule
            .iter()
            .filter_map(|rule| rule.model.clone())
            .filter(|model| !model.contains(['*', '?', '[', '{']))
            .collect()
    }

    /// Parses and validates TOML text; `file` only names it in errors. Every problem found is
    /// reported, in the file's order (`ConfigError::Several` where there is more than one).
    pub fn parse(text: &str, file: &Path) -> Result<Self, ConfigError> {
        read::parse(text, file)
    }

    /// Where the config at `path` keeps throttle records, read as leniently as can be: a
    /// config that fails validation still names its state dir, and anything unreadable means
    /// the default. For restoring cgroups before a config is known to be good.
    pub fn state_dir_of(path: Option<&Path>) -> PathBuf {
        #[derive(Deserialize)]
        struct Lenient {
            risk: Option<LenientRisk>,
        }
        #[derive(Deserialize)]
        struct LenientRisk {
            state_dir: Option<PathBuf>,
        }
        path.and_then(|p| std::fs::read_to_string(p).ok())
            .and_then(|text| toml::from_str::<Lenient>(&text).ok())
            .and_then(|config| config.risk?.state_dir)
            .unwrap_or_else(|| RiskConfig::default().state_dir)
    }

    /// The class names, comma-separated, for error messages.
    pub fn class_names(&self) -> String {
        self.class.keys().cloned().collect::<Vec<_>>().join(", ")
    }

    pub fn header_read_timeout(&self) -> Duration {
        Duration::from_millis(self.server.header_read_timeout_ms)
    }
}

/// The 1-based line where `key` (`class.batch.cgroup`) is written in `text`, else its nearest
/// written parent's.
pub fn line_of_key(text: &str, key: &str) -> Option<usize> {
    locate::line_of_key(text, key)
}

/// Parses `10.0.0.0/8`, `::1/128` or a bare address (a single host).
pub fn parse_cidr(text: &str) -> Result<ipnet::IpNet, CidrError> {
    // Not a block: then a bare address, whose error is the one worth showing.
    text.parse::<ipnet::IpNet>()
        .or_else(|_| text.parse::<std::net::IpAddr>().map(ipnet::IpNet::from))
        .map_err(|source| CidrError {
            text: text.to_owned(),
            source,
        })
}

/// The upstream's address: an `http://host:port` URL, parsed once, when the config is read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UpstreamUrl {
    text: String,
    authority: http::uri::Authority,
}

impl UpstreamUrl {
    pub fn parse(url: &str) -> Result<Self, UrlError> {
        let uri: http::Uri = url.parse().map_err(|source| UrlError::NotUrl {
            url: url.to_owned(),
            source,
        })?;
        let url_owned = || url.to_owned();
        if uri.scheme_str() != Some("http") {
            return Err(UrlError::NotHttp { url: url_owned() });
        }
        if uri.path() != "/" && !uri.path().is_empty() {
            return Err(UrlError::HasPath { url: url_owned() });
        }
        let authority = uri
            .authority()
            .cloned()
            .ok_or_else(|| UrlError::NoHost { url: url_owned() })?;
        if authority.port_u16().is_none() {
            return Err(UrlError::NoPort { url: url_owned() });
        }
        Ok(Self {
            text: url.to_owned(),
            authority,
        })
    }

    /// `host:port`.
    pub fn authority(&self) -> &http::uri::Authority {
        &self.authority
    }

    pub fn port(&self) -> u16 {
        self.authority.port_u16().unwrap_or(80)
    }
}

impl std::fmt::Display for UpstreamUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.text)
    }
}

impl std::str::FromStr for UpstreamUrl {
    type Err = UrlError;

    fn from_str(url: &str) -> Result<Self, UrlError> {
        Self::parse(url)
    }
}

impl Serialize for UpstreamUrl {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.text)
    }
}

impl<'de> Deserialize<'de> for UpstreamUrl {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        // The TOML error carries text only: the chain goes in whole.
        Self::parse(&text).map_err(|err| serde::de::Error::custom(crate::error_chain(&err)))
    }
}

#[cfg(test)]
mod tests;
