//! Decides a request's class at the moment the queue decides: who the client is (the rules in
//! order, first match wins, then the default), and then the class header, which may only ask
//! for a class of equal or lower urgency unless the matching rule trusts it.

use std::{
    collections::{BTreeMap, HashMap},
    net::IpAddr,
    sync::{Arc, Mutex},
};

use globset::GlobMatcher;
use http::{HeaderMap, HeaderName, header};

use crate::{
    config::{Config, parse_cidr},
    metrics::{
        Counters, Family, Metrics,
        labels::{ByClaim, ByClassBy, Claim, ClassBy},
    },
    reap::peer::Peer,
    secret::Secret,
};

/// What the classifier may look at. The client's process is looked up only if a rule asks.
pub struct RequestFacts<'a> {
    pub path: &'a str,
    pub headers: &'a HeaderMap,
    pub model: Option<&'a str>,
    pub source: IpAddr,
    pub peer: &'a (dyn Fn() -> Option<Arc<Peer>> + Sync),
}

/// The class chosen and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    pub class: String,
    pub by: DecidedBy,
    /// A more urgent class the header asked for and did not get.
    pub refused_claim: Option<String>,
}

/// What chose a request's class.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecidedBy {
    /// The class header moved it (to a class no more urgent, or as a trusted rule allows).
    Header,
    /// `[[classify.rule]]` number N (1-based, in file order) matched.
    Rule(usize),
    /// Nothing matched.
    Default,
}

impl std::fmt::Display for DecidedBy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Header => f.write_str("header"),
            Self::Rule(n) => write!(f, "rule {n}"),
            Self::Default => f.write_str("default"),
        }
    }
}

/// The header named a class guard does not have.
#[derive(Debug, thiserror::Error)]
#[error("unknown class `{given}` in header {header}: known are {known}")]
pub struct UnknownClass {
    pub given: String,
    pub header: String,
    pub known: String,
}

pub struct Classifier {
    header: Option<HeaderName>,
    default: String,
    /// Each class's priority: lower is more urgent.
    priority: HashMap<String, i32>,
    rules: Vec<Rule>,
}

struct Rule {
    class: String,
    label: String,
    trust_header: bool,
    path_prefix: Option<String>,
    model: Option<GlobMatcher>,
    bearer: Option<Secret>,
    user_agent: Option<GlobMatcher>,
    source: Option<ipnet::IpNet>,
    cgroup_prefix: Option<String>,
    uid: Option<u32>,
    unit: Option<String>,
    exe: Option<GlobMatcher>,
    header: Option<(HeaderName, GlobMatcher)>,
    /// It has a matcher on the client's process (looked up only then).
    reads_process: bool,
}

impl Classifier {
    /// Builds from a validated config (patterns there are known to compile).
    pub fn new(config: &Config) -> Self {
        let glob = |pattern: &Option<String>| {
            pattern
                .as_deref()
                .and_then(|p| globset::Glob::new(p).ok())
                .map(|g| g.compile_matcher())
        };
        let rules = config
            .classify
            .rule
            .iter()
            .enumerate()
            .map(|(index, rule)| Rule {
                class: rule.class.clone(),
                label: rule.label(index),
                trust_header: rule.trust_header,
                path_prefix: rule.path_prefix.clone(),
                model: glob(&rule.model),
                bearer: rule.resolved.bearer.clone(),
                user_agent: glob(&rule.user_agent),
                source: rule.source.as_deref().and_then(|s| parse_cidr(s).ok()),
                cgroup_prefix: rule.cgroup_prefix.clone(),
                uid: rule.resolved.uid,
                unit: rule.unit.clone(),
                exe: glob(&rule.exe),
                reads_process: rule.reads_process(),
                header: rule.header.as_ref().and_then(|h| {
                    let name = HeaderName::try_from(h.name.as_str()).ok()?;
                    Some((name, glob(&Some(h.value.clone()))?))
                }),
            })
            .collect();
        Self {
            header: (!config.classify.header.is_empty())
                .then(|| HeaderName::try_from(config.classify.header.as_str()).ok())
                .flatten(),
            default: config.classify.default.clone(),
            priority: config
                .class
                .iter()
                .map(|(name, class)| (name.clone(), class.priority))
                .collect(),
            rules,
        }
    }

    pub fn classify(&self, facts: &RequestFacts<'_>) -> Result<Decision, UnknownClass> {
        let claim = self.claim(facts.headers)?;
        let (class, by, trusted) = self.identify(facts);
        let Some(claimed) = claim.filter(|claimed| *claimed != class) else {
            return Ok(Decision {
                class,
                by,
                refused_claim: None,
            });
        };
        if trusted || self.priority(&claimed) >= self.priority(&class) {
            return Ok(Decision {
                class: claimed,
                by: DecidedBy::Header,
                refused_claim: None,
            });
        }
        Ok(Decision {
            class,
            by,
            refused_claim: Some(claimed),
        })
    }

    /// The class the header asks for, if it names one; an unknown name is an error.
    fn claim(&self, headers: &HeaderMap) -> Result<Option<String>, UnknownClass> {
        let Some(name) = &self.header else {
            return Ok(None);
        };
        let mut values = headers.get_all(name).iter();
        let Some(value) = values.next() else {
            return Ok(None);
        };
        if values.next().is_some() {
            // Two claims: a front end that appends rather than replaces would let the
            // client's own win. Neither is taken.
            return Err(self.unknown("(several values)"));
        }
        let given = value
            .to_str()
            .unwrap_or_default()
            .trim()
            .to_ascii_lowercase();
        if self.priority.contains_key(&given) {
            return Ok(Some(given));
        }
        Err(self.unknown(&given))
    }

    fn unknown(&self, given: &str) -> UnknownClass {
        let mut known: Vec<&str> = self.priority.keys().map(String::as_str).collect();
        known.sort_unstable();
        UnknownClass {
            given: crate::quote::quote(given),
            header: self
                .header
                .as_ref()
                .map(ToString::to_string)
                .unwrap_or_default(),
            known: known.join(", "),
        }
    }

    /// The class who the client is gives it, what decided, and whether that trusts the header.
    fn identify(&self, facts: &RequestFacts<'_>) -> (String, DecidedBy, bool) {
        let mut peer = None;
        for (index, rule) in self.rules.iter().enumerate() {
            if rule.matches(facts, &mut peer) {
                return (
                    rule.class.clone(),
                    DecidedBy::Rule(index + 1),
                    rule.trust_header,
                );
            }
        }
        (self.default.clone(), DecidedBy::Default, false)
    }

    fn priority(&self, class: &str) -> i32 {
        self.priority.get(class).copied().unwrap_or(i32::MAX)
    }

    /// How `/status` and the metrics name what decided.
    /// The name of the first rule whose bearer token the request carries: who the client is
    /// by its token, for the access log, without the token.
    pub fn token_rule(&self, headers: &HeaderMap) -> Option<&str> {
        self.rules
            .iter()
            .find(|rule| rule.bearer.as_ref().is_some_and(|s| s.authorizes(headers)))
            .map(|rule| rule.label.as_str())
    }

    pub fn label(&self, by: DecidedBy) -> &str {
        match by {
            DecidedBy::Header => "header",
            DecidedBy::Default => "default",
            DecidedBy::Rule(n) => self.rules.get(n - 1).map_or("rule", |r| r.label.as_str()),
        }
    }
}

impl Rule {
    /// Every matcher the rule names must match. `peer` caches the lookup across rules.
    fn matches(&self, facts: &RequestFacts<'_>, peer: &mut Option<Option<Arc<Peer>>>) -> bool {
        if let Some(prefix) = &self.path_prefix
            && !facts.path.starts_with(prefix.as_str())
        {
            return false;
        }
        if let Some(model) = &self.model
            && !facts.model.is_some_and(|m| model.is_match(m))
        {
            return false;
        }
        if let Some(secret) = &self.bearer
            && !secret.authorizes(facts.headers)
        {
            return false;
        }
        if let Some(agent) = &self.user_agent {
            let presented = facts
                .headers
                .get(header::USER_AGENT)
                .and_then(|v| v.to_str().ok());
            if !presented.is_some_and(|ua| agent.is_match(ua)) {
                return false;
            }
        }
        if let Some(net) = &self.source
            && !net.contains(&facts.source.to_canonical())
        {
            return false;
        }
        // Every value of the header is tried; one that is not UTF-8 matches nothing.
        if let Some((name, value)) = &self.header
            && !facts
                .headers
                .get_all(name)
                .iter()
                .filter_map(|v| v.to_str().ok())
                .any(|v| value.is_match(v))
        {
            return false;
        }
        if !self.reads_process {
            return true;
        }
        let peer = peer.get_or_insert_with(|| (facts.peer)());
        peer.as_deref().is_some_and(|peer| self.matches_peer(peer))
    }

    /// The matchers on the client's process.
    fn matches_peer(&self, peer: &Peer) -> bool {
        let cgroup = peer.cgroup.as_deref();
        self.cgroup_prefix
            .as_ref()
            .is_none_or(|prefix| cgroup.is_some_and(|path| cgroup_has_prefix(path, prefix)))
            && self.uid.is_none_or(|uid| peer.uid == Some(uid))
            && self
                .unit
                .as_ref()
                .is_none_or(|unit| cgroup.is_some_and(|path| path.split('/').any(|c| c == unit)))
            && self
                .exe
                .as_ref()
                .is_none_or(|exe| peer.exe.as_ref().is_some_and(|path| exe.is_match(path)))
    }
}

/// Whether `prefix` is a whole-component prefix of `path`: `/a/b` is under `/a`, `/a/bc` is not
/// under `/a/b`.
fn cgroup_has_prefix(path: &str, prefix: &str) -> bool {
    let prefix = prefix.trim_end_matches('/');
    path == prefix || path.starts_with(&format!("{prefix}/")) || prefix.is_empty()
}

/// How many requests each rule (or the header, or the default) sent to each class since
/// start: the classifier's own count, which `/status` shows and the metrics export.
pub struct Tally {
    counts: Mutex<BTreeMap<String, BTreeMap<String, u64>>>,
    classified: Counters<ByClassBy>,
    refused_claims: Counters<ByClaim>,
}

impl Tally {
    pub fn new(metrics: &Metrics) -> Self {
        let classified = Family::counter(
            "guard_classified_total",
            "Requests given a class, by what decided it (a rule's name, header, default).",
        );
        let refused_claims = Family::counter(
            "guard_class_claims_refused_total",
            "Requests whose class header asked for a more urgent class than their client may have; served in their own class.",
        );
        metrics.register(classified.collector());
        metrics.register(refused_claims.collector());
        Self {
            counts: Mutex::default(),
            classified,
            refused_claims,
        }
    }

    /// Creates every series `classifier` can produce, at 0.
    pub fn prepare(&self, classifier: &Classifier) {
        let classes: Vec<&String> = classifier.priority.keys().collect();
        for rule in &classifier.rules {
            let (class, by) = (rule.class.as_str(), rule.label.as_str());
            self.classified.of(&ClassBy { class, by });
        }
        let class = classifier.default.as_str();
        self.classified.of(&ClassBy {
            class,
            by: "default",
        });
        for class in &classes {
            let class = class.as_str();
            self.classified.of(&ClassBy {
                class,
                by: "header",
            });
            for claimed in &classes {
                if classifier.priority(claimed) < classifier.priority(class) {
                    let claimed = claimed.as_str();
                    self.refused_claims.of(&Claim { claimed, class });
                }
            }
        }
    }

    /// Counts one request's final decision.
    pub fn record(&self, classifier: &Classifier, decision: &Decision) {
        let by = classifier.label(decision.by);
        let class = decision.class.as_str();
        self.classified.of(&ClassBy { class, by }).inc();
        if let Some(claimed) = &decision.refused_claim {
            let claimed = claimed.as_str();
            self.refused_claims.of(&Claim { claimed, class }).inc();
        }
        let mut counts = self
            .counts
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // Names are copied only the first time they are counted.
        match counts.get_mut(&decision.class) {
            Some(by_what) => match by_what.get_mut(by) {
                Some(count) => *count += 1,
                None => {
                    by_what.insert(by.to_owned(), 1);
                }
            },
            None => {
                let by_what = BTreeMap::from([(by.to_owned(), 1)]);
                counts.insert(decision.class.clone(), by_what);
            }
        }
    }

    /// Per class, what sent how many requests there.
    pub fn snapshot(&self) -> BTreeMap<String, BTreeMap<String, u64>> {
        self.counts
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reap::peer::PeerSource;

    fn classifier(rules: &str) -> Classifier {
        let text = format!("[classify]\nheader = \"x-guard-class\"\n{rules}");
        let config = Config::parse(&text, std::path::Path::new("t.toml")).expect("config");
        Classifier::new(&config)
    }

    type PeerFn<'a> = &'a (dyn Fn() -> Option<Arc<Peer>> + Sync);

    fn facts<'a>(
        path: &'a str,
        headers: &'a HeaderMap,
        model: Option<&'a str>,
        peer: PeerFn<'a>,
    ) -> RequestFacts<'a> {
        RequestFacts {
            path,
            headers,
            model,
            source: "10.1.2.3".parse().expect("ip"),
            peer,
        }
    }

    const NO_PEER: PeerFn<'static> = &|| None;

    fn claiming(class: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert("x-guard-class", class.parse().expect("value"));
        headers
    }

    #[test]
    fn the_header_moves_a_request_only_to_a_class_no_more_urgent() {
        let c = classifier(
            "[[classify.rule]]\nclass = \"batch\"\npath_prefix = \"/batch\"\n\
             [[classify.rule]]\nclass = \"batch\"\npath_prefix = \"/front\"\ntrust_header = true\n",
        );
        let decide = |path, headers: &HeaderMap| {
            c.classify(&facts(path, headers, None, NO_PEER))
                .expect("ok")
        };
        // Batch by rule, claiming interactive: refused, served as batch.
        let refused = decide("/batch/x", &claiming("Interactive"));
        assert_eq!(refused.class, "batch");
        assert_eq!(refused.by, DecidedBy::Rule(1));
        assert_eq!(refused.refused_claim.as_deref(), Some("interactive"));
        // Interactive by default, asking to be batch: honoured.
        let lowered = decide("/other", &claiming("batch"));
        assert_eq!(
            (lowered.class.as_str(), lowered.by),
            ("batch", DecidedBy::Header)
        );
        assert_eq!(lowered.refused_claim, None);
        // A trusted front end may claim any class.
        let trusted = decide("/front", &claiming("interactive"));
        assert_eq!(
            (trusted.class.as_str(), trusted.by),
            ("interactive", DecidedBy::Header)
        );
        // Claiming one's own class changes nothing.
        assert_eq!(decide("/batch", &claiming("batch")).by, DecidedBy::Rule(1));
        let mut twice = claiming("batch");
        twice.append("x-guard-class", "interactive".parse().expect("value"));
        assert!(
            c.classify(&facts("/front", &twice, None, NO_PEER)).is_err(),
            "two claims"
        );
        let err = c
            .classify(&facts("/batch", &claiming("vip"), None, NO_PEER))
            .expect_err("unknown");
        assert_eq!(err.known, "batch, interactive");
    }

    #[test]
    fn first_matching_rule_wins_and_all_matchers_must_match() {
        let c = classifier(
            "[[classify.rule]]\nclass = \"interactive\"\nmodel = \"chat-*\"\npath_prefix = \"/api/chat\"\n\
             [[classify.rule]]\nclass = \"batch\"\nmodel = \"*\"\nname = \"any model\"\n",
        );
        let headers = HeaderMap::new();
        let decide = |path, model| {
            c.classify(&facts(path, &headers, model, NO_PEER))
                .expect("ok")
        };
        assert_eq!(
            decide("/api/chat", Some("chat-small")).by,
            DecidedBy::Rule(1)
        );
        let batch = decide("/api/generate", Some("chat-small"));
        assert_eq!(batch.class, "batch");
        assert_eq!(c.label(batch.by), "any model");
        assert_eq!(c.label(DecidedBy::Rule(1)), "rule 1");
        assert_eq!(decide("/api/generate", None).by, DecidedBy::Default);
    }

    #[test]
    fn bearer_user_agent_and_source() {
        let digest = hex::encode(<sha2::Sha256 as sha2::Digest>::digest(b"hashed"));
        let c = classifier(&format!(
            "[[classify.rule]]\nclass = \"batch\"\nbearer = \"nightly\"\n\
             [[classify.rule]]\nclass = \"batch\"\nbearer_sha256 = \"{digest}\"\n\
             [[classify.rule]]\nclass = \"batch\"\nuser_agent = \"extractor/*\"\n\
             [[classify.rule]]\nclass = \"batch\"\nheader = {{ name = \"x-team\", value = \"nightly\" }}\n\
             [[classify.rule]]\nclass = \"batch\"\nsource = \"10.1.0.0/16\"\n",
        ));
        let by = |name: http::HeaderName, value: &str| {
            let mut headers = HeaderMap::new();
            headers.insert(name, value.parse().expect("v"));
            c.classify(&facts("/", &headers, None, NO_PEER))
                .expect("ok")
                .by
        };
        assert_eq!(
            by(header::AUTHORIZATION, "Bearer nightly"),
            DecidedBy::Rule(1)
        );
        assert_eq!(
            by(header::AUTHORIZATION, "Bearer hashed"),
            DecidedBy::Rule(2)
        );
        assert_eq!(by(header::USER_AGENT, "extractor/2.1"), DecidedBy::Rule(3));
        let team = http::HeaderName::from_static("x-team");
        assert_eq!(by(team.clone(), "nightly"), DecidedBy::Rule(4));
        assert_eq!(by(team, "nightly2"), DecidedBy::Rule(5));
        assert_eq!(
            by(header::AUTHORIZATION, "Bearer nightlyx"),
            DecidedBy::Rule(5)
        );
        // The access log names a token's rule, never the token.
        let token = |value: &str| {
            let mut headers = HeaderMap::new();
            headers.insert(header::AUTHORIZATION, value.parse().expect("v"));
            c.token_rule(&headers).map(str::to_owned)
        };
        assert_eq!(token("Bearer hashed").as_deref(), Some("rule 2"));
        assert_eq!(token("Bearer nightlyx"), None);
    }

    #[test]
    fn a_header_rule_matches_its_value_as_a_glob_on_any_of_its_values() {
        let c = classifier(
            "[[classify.rule]]\nclass = \"batch\"\n\
             header = { name = \"x-llm-d-inference-fairness-id\", value = \"tenant-*\" }\n",
        );
        let by = |values: &[&str]| {
            let mut headers = HeaderMap::new();
            for value in values {
                headers.append("x-llm-d-inference-fairness-id", value.parse().expect("v"));
            }
            c.classify(&facts("/", &headers, None, NO_PEER))
                .expect("ok")
                .by
        };
        assert_eq!(by(&["tenant-42"]), DecidedBy::Rule(1));
        assert_eq!(by(&["other", "tenant-7"]), DecidedBy::Rule(1));
        assert_eq!(by(&["other-42"]), DecidedBy::Default);
        assert_eq!(by(&[]), DecidedBy::Default);
    }

    fn peer(uid: u32, cgroup: &str, exe: &str) -> Option<Arc<Peer>> {
        let mut peer = Peer::new(42, Some(uid), Some(cgroup.to_owned()), PeerSource::Ebpf);
        peer.exe = Some(exe.into());
        Some(Arc::new(peer))
    }

    #[test]
    fn who_the_client_is_uid_unit_exe_and_cgroup_looked_up_once() {
        let c = classifier(
            "[[classify.rule]]\nclass = \"batch\"\ncgroup_prefix = \"/guard/batch\"\npath_prefix = \"/nope\"\n\
             [[classify.rule]]\nclass = \"batch\"\ncgroup_prefix = \"/guard/batch\"\n\
             [[classify.rule]]\nclass = \"batch\"\nunit = \"nightly-extract.service\"\n\
             [[classify.rule]]\nclass = \"batch\"\nuid = 1000\n\
             [[classify.rule]]\nclass = \"batch\"\nexe = \"/opt/extract/*\"\n",
        );
        let headers = HeaderMap::new();
        let lookups = std::sync::atomic::AtomicUsize::new(0);
        let in_batch = || {
            lookups.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            peer(0, "/guard/batch/job-1", "/usr/bin/curl")
        };
        let by = |p: PeerFn<'_>| c.classify(&facts("/", &headers, None, p)).expect("ok").by;
        assert_eq!(by(&in_batch), DecidedBy::Rule(2));
        assert_eq!(lookups.load(std::sync::atomic::Ordering::Relaxed), 1);
        assert_eq!(
            by(&|| peer(0, "/guard/batchy", "/bin/x")),
            DecidedBy::Default
        );
        let unit = || peer(0, "/system.slice/nightly-extract.service", "/bin/x");
        assert_eq!(by(&unit), DecidedBy::Rule(3));
        assert_eq!(
            by(&|| peer(0, "/system.slice/nightly-extract.service.d", "/bin/x")),
            DecidedBy::Default
        );
        assert_eq!(
            by(&|| peer(1000, "/user.slice", "/bin/x")),
            DecidedBy::Rule(4)
        );
        assert_eq!(
            by(&|| peer(7, "/user.slice", "/opt/extract/run")),
            DecidedBy::Rule(5)
        );
        assert_eq!(by(NO_PEER), DecidedBy::Default);
    }

    #[test]
    fn the_tally_counts_per_class_what_decided() {
        let c = classifier(
            "[[classify.rule]]\nclass = \"batch\"\npath_prefix = \"/b\"\nname = \"nightly\"\n",
        );
        let metrics = Metrics::new();
        let tally = Tally::new(&metrics);
        tally.prepare(&c);
        let text = metrics.render();
        assert!(
            text.contains(
                "guard_class_claims_refused_total{claimed=\"interactive\",class=\"batch\"} 0"
            ),
            "{text}"
        );
        assert!(
            text.contains("guard_classified_total{by=\"nightly\",class=\"batch\"} 0"),
            "{text}"
        );
        for path in ["/b", "/b", "/x"] {
            let decision = c
                .classify(&facts(path, &claiming("interactive"), None, NO_PEER))
                .expect("ok");
            tally.record(&c, &decision);
        }
        let counts = tally.snapshot();
        assert_eq!(counts["batch"]["nightly"], 2);
        assert_eq!(counts["interactive"]["default"], 1);
        let text = metrics.render();
        assert!(
            text.contains(
                "guard_class_claims_refused_total{claimed=\"interactive\",class=\"batch\"} 2"
            ),
            "{text}"
        );
    }
}
