//! Decides a request's class at the moment the queue decides: the class header first, then
//! the rules in order (first match wins), then the default.

use std::net::IpAddr;

use globset::GlobMatcher;
use http::{HeaderMap, HeaderName, header};

use crate::config::{Config, parse_cidr};

/// What the classifier may look at. The client's cgroup is looked up only if a rule asks.
pub struct RequestFacts<'a> {
    pub path: &'a str,
    pub headers: &'a HeaderMap,
    pub model: Option<&'a str>,
    pub source: IpAddr,
    pub cgroup: &'a (dyn Fn() -> Option<String> + Sync),
}

/// The class chosen and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    pub class: String,
    pub by: DecidedBy,
}

/// What chose a request's class.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecidedBy {
    /// The class header named it.
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
    known: Vec<String>,
    rules: Vec<Rule>,
}

struct Rule {
    class: String,
    path_prefix: Option<String>,
    model: Option<GlobMatcher>,
    bearer: Option<String>,
    user_agent: Option<GlobMatcher>,
    source: Option<ipnet::IpNet>,
    cgroup_prefix: Option<String>,
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
            .map(|rule| Rule {
                class: rule.class.clone(),
                path_prefix: rule.path_prefix.clone(),
                model: glob(&rule.model),
                bearer: rule.bearer.clone(),
                user_agent: glob(&rule.user_agent),
                source: rule.source.as_deref().and_then(|s| parse_cidr(s).ok()),
                cgroup_prefix: rule.cgroup_prefix.clone(),
            })
            .collect();
        Self {
            header: (!config.classify.header.is_empty())
                .then(|| HeaderName::try_from(config.classify.header.as_str()).ok())
                .flatten(),
            default: config.classify.default.clone(),
            known: config.class.keys().cloned().collect(),
            rules,
        }
    }
    pub fn classify(&self, facts: &RequestFacts<'_>) -> Result<Decision, UnknownClass> {
        if let Some(header) = &self.header
            && let Some(value) = facts.headers.get(header)
        {
            let given = value
                .to_str()
                .unwrap_or_default()
                .trim()
                .to_ascii_lowercase();
            if self.known.contains(&given) {
                return Ok(Decision {
                    class: given,
                    by: DecidedBy::Header,
                });
            }
            return Err(UnknownClass {
                given: crate::quote::quote(&given),
                header: header.to_string(),
                known: self.known.join(", "),
            });
        }
        let mut cgroup = None;
        for (index, rule) in self.rules.iter().enumerate() {
            if rule.matches(facts, &mut cgroup) {
                return Ok(Decision {
                    class: rule.class.clone(),
                    by: DecidedBy::Rule(index + 1),
                });
            }
        }
        Ok(Decision {
            class: self.default.clone(),
            by: DecidedBy::Default,
        })
    }
}

impl Rule {
    /// Every matcher the rule names must match. `cgroup` caches the lookup across rules.
    fn matches(&self, facts: &RequestFacts<'_>, cgroup: &mut Option<Option<String>>) -> bool {
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
        if let Some(token) = &self.bearer {
            let presented = facts
                .headers
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "));
            if presented != Some(token.as_str()) {
                return false;
            }
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
        if let Some(prefix) = &self.cgroup_prefix {
            let path = cgroup.get_or_insert_with(|| (facts.cgroup)());
            if !path
                .as_deref()
                .is_some_and(|p| cgroup_has_prefix(p, prefix))
            {
                return false;
            }
        }
        true
    }
}

/// Whether `prefix` is a whole-component prefix of `path`: `/a/b` is under `/a`, `/a/bc` is not
/// under `/a/b`.
fn cgroup_has_prefix(path: &str, prefix: &str) -> bool {
    let prefix = prefix.trim_end_matches('/');
    path == prefix || path.starts_with(&format!("{prefix}/")) || prefix.is_empty()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn classifier(rules: &str) -> Classifier {
        let text = format!("[classify]\nheader = \"x-guard-class\"\n{rules}");
        let config = Config::parse(&text, std::path::Path::new("t.toml")).expect("config");
        Classifier::new(&config)
    }

    fn facts<'a>(
        path: &'a str,
        headers: &'a HeaderMap,
        model: Option<&'a str>,
        cgroup: &'a (dyn Fn() -> Option<String> + Sync),
    ) -> RequestFacts<'a> {
        RequestFacts {
            path,
            headers,
            model,
            source: "10.1.2.3".parse().expect("ip"),
            cgroup,
        }
    }

    const NO_CGROUP: &(dyn Fn() -> Option<String> + Sync) = &|| None;

    #[test]
    fn header_wins_and_an_unknown_one_is_an_error() {
        let c = classifier("[[classify.rule]]\nclass = \"batch\"\npath_prefix = \"/\"\n");
        let mut headers = HeaderMap::new();
        headers.insert("x-guard-class", "Interactive".parse().expect("value"));
        let decision = c
            .classify(&facts("/v1/x", &headers, None, NO_CGROUP))
            .expect("ok");
        assert_eq!(
            (decision.class.as_str(), decision.by),
            ("interactive", DecidedBy::Header)
        );
        headers.insert("x-guard-class", "vip".parse().expect("value"));
        let err = c
            .classify(&facts("/v1/x", &headers, None, NO_CGROUP))
            .expect_err("unknown");
        assert_eq!(err.known, "batch, interactive");
    }

    #[test]
    fn first_matching_rule_wins_and_all_matchers_must_match() {
        let c = classifier(
            "[[classify.rule]]\nclass = \"interactive\"\nmodel = \"chat-*\"\npath_prefix = \"/api/chat\"\n\
             [[classify.rule]]\nclass = \"batch\"\nmodel = \"*\"\n",
        );
        let headers = HeaderMap::new();
        let decide = |path, model| {
            c.classify(&facts(path, &headers, model, NO_CGROUP))
                .expect("ok")
        };
        assert_eq!(
            decide("/api/chat", Some("chat-small")).by,
            DecidedBy::Rule(1)
        );
        assert_eq!(decide("/api/generate", Some("chat-small")).class, "batch");
        assert_eq!(decide("/api/generate", None).by, DecidedBy::Default);
    }

    #[test]
    fn bearer_user_agent_and_source() {
        let c = classifier(
            "[[classify.rule]]\nclass = \"batch\"\nbearer = \"nightly\"\n\
             [[classify.rule]]\nclass = \"batch\"\nuser_agent = \"extractor/*\"\n\
             [[classify.rule]]\nclass = \"batch\"\nsource = \"10.1.0.0/16\"\n",
        );
        let mut headers = HeaderMap::new();
        headers.insert(header::AUTHORIZATION, "Bearer nightly".parse().expect("v"));
        assert_eq!(
            c.classify(&facts("/", &headers, None, NO_CGROUP))
                .expect("ok")
                .by,
            DecidedBy::Rule(1)
        );
        let mut headers = HeaderMap::new();
        headers.insert(header::USER_AGENT, "extractor/2.1".parse().expect("v"));
        assert_eq!(
            c.classify(&facts("/", &headers, None, NO_CGROUP))
                .expect("ok")
                .by,
            DecidedBy::Rule(2)
        );
        let headers = HeaderMap::new();
        assert_eq!(
            c.classify(&facts("/", &headers, None, NO_CGROUP))
                .expect("ok")
                .by,
            DecidedBy::Rule(3)
        );
    }

    #[test]
    fn cgroup_prefix_matches_whole_path_components_and_is_looked_up_once() {
        let c = classifier(
            "[[classify.rule]]\nclass = \"batch\"\ncgroup_prefix = \"/guard/batch\"\npath_prefix = \"/nope\"\n\
             [[classify.rule]]\nclass = \"batch\"\ncgroup_prefix = \"/guard/batch\"\n",
        );
        let headers = HeaderMap::new();
        let lookups = std::sync::atomic::AtomicUsize::new(0);
        let in_batch = || {
            lookups.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Some("/guard/batch/job-1".to_owned())
        };
        assert_eq!(
            c.classify(&facts("/", &headers, None, &in_batch))
                .expect("ok")
                .by,
            DecidedBy::Rule(2)
        );
        assert_eq!(lookups.load(std::sync::atomic::Ordering::Relaxed), 1);
        let elsewhere = || Some("/guard/batchy".to_owned());
        assert_eq!(
            c.classify(&facts("/", &headers, None, &elsewhere))
                .expect("ok")
                .by,
            DecidedBy::Default
        );
    }
}
