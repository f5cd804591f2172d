//! `guard doctor`: one line per thing guard needs from this host: ok; a notice (guard does
//! without it); a warning (guard runs, but this part fails); or missing (guard will not start
//! here), each with the fix. Only the last makes the exit status 1.

use std::{net::TcpStream, path::Path, time::Duration};

use guard::{config::Config, reap::ebpf, watch::energy::EnergyReader};

/// One check's outcome.
pub struct Check {
    pub name: &'static str,
    /// What was found, or what is missing and how to fix it.
    pub result: Result<String, Missing>,
}

/// What a check found missing, and how to fix it.
#[derive(Debug, thiserror::Error)]
pub enum Missing {
    #[error(transparent)]
    Ebpf(#[from] ebpf::PreflightError),
    #[error(
        "no cgroup filesystem mounted: no class can be throttled; mount cgroup2 at \
         /sys/fs/cgroup"
    )]
    NoCgroups,
    #[error(
        "no libnvidia-ml.so.1: no NVIDIA driver here; GPU metrics stay off \
         (guard_gpu_available 0). Nothing to do on a box without an NVIDIA GPU; where there \
         is one, install its driver"
    )]
    NoNvml,
    /// A notice: guard serves as well without it.
    #[error(
        "no energy counter here ({why}): the access log and guard_energy_joules_total carry \
         no energy"
    )]
    NoEnergy { why: String },
    #[error("{authority} cannot be resolved")]
    Resolve {
        authority: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{authority} resolves to nothing")]
    NoAddress { authority: String },
    #[error(
        "{url} does not accept connections (start the inference server there, or set \
         upstream.url)"
    )]
    Upstream {
        url: String,
        #[source]
        source: std::io::Error,
    },
    /// What the config asks of this host and does not get (config::host).
    #[error("{}", finding.why)]
    Host { finding: crate::host::Finding },
}

/// How much a missing thing matters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Weight {
    /// guard does without it (a fallback, or a feature off).
    Notice,
    /// guard runs, but this part fails until it is fixed.
    Warning,
    /// guard will not start here.
    Blocks,
}

impl Missing {
    pub fn weight(&self) -> Weight {
        match self {
            // eBPF: closes are seen from user space; cgroups: no throttling; NVML and energy:
            // those metrics stay off.
            Self::Ebpf(_) | Self::NoCgroups | Self::NoNvml | Self::NoEnergy { .. } => {
                Weight::Notice
            }
            // guard serves, answering 502 until the upstream is there.
            Self::Resolve { .. } | Self::NoAddress { .. } | Self::Upstream { .. } => {
                Weight::Warning
            }
            Self::Host { finding } if finding.fatal => Weight::Blocks,
            Self::Host { .. } => Weight::Warning,
        }
    }
}

/// Runs every check against `config`.
pub fn run(config: &Config) -> Vec<Check> {
    let mut checks: Vec<Check> = ebpf::preflight()
        .into_iter()
        .map(|(name, result)| Check {
            name,
            result: result.map_err(Missing::from),
        })
        .collect();
    let ebpf_ready = checks.iter().all(|c| c.result.is_ok());
    checks.push(Check {
        name: "client closes seen",
        result: ebpf::close_detection(config.ebpf.enabled).map_err(Missing::from),
    });
    checks.push(Check {
        name: "cgroups",
        result: cgroups(),
    });
    checks.push(Check {
        name: "NVIDIA GPU (NVML)",
        result: nvml(),
    });
    checks.push(Check {
        name: "energy per request",
        result: energy(&EnergyReader::open_host()),
    });
    checks.push(Check {
        name: "upstream",
        result: upstream(config),
    });
    if config
        .class
        .values()
        .any(|class| class.preemptible != guard::config::Preemptible::No)
    {
        checks.push(Check {
            name: "preempted requests go on",
            result: Ok(resume(config)),
        });
    }
    checks.push(Check {
        name: "capabilities",
        result: Ok(capabilities(config, ebpf_ready)),
    });
    checks.extend(host(config));
    checks
}

/// The config's listening addresses, class cgroups, state directory and access log, as
/// `guard run` would meet them.
fn host(config: &Config) -> Vec<Check> {
    let mut checks: Vec<Check> = crate::host::addresses(config)
        .map(|(key, addr)| Check {
            name: key,
            result: match crate::host::listen(key, addr) {
                Some(finding) => Err(Missing::Host { finding }),
                None => Ok(format!("{addr} is free")),
            },
        })
        .collect();
    let findings = crate::host::files(config);
    let cgroups: Vec<String> = config
        .class
        .iter()
        .filter_map(|(name, class)| Some(format!("{name} {}", class.cgroup.as_ref()?.display())))
        .collect();
    if !cgroups.is_empty() && !findings.iter().any(|f| f.key.starts_with("class.")) {
        checks.push(Check {
            name: "class cgroups",
            result: Ok(format!("usable: {}", cgroups.join(", "))),
        });
    }
    checks.extend(findings.into_iter().map(|finding| Check {
        name: topic(&finding.key),
        result: Err(Missing::Host { finding }),
    }));
    checks
}

/// The check a file-system finding belongs to, by its key.
fn topic(key: &str) -> &'static str {
    match key {
        "log.access" => "access log",
        "risk.state_dir" => "state directory",
        _ => "class cgroups",
    }
}

/// Renders checks one per line; the bool says whether guard can run here (nothing blocks it).
pub fn render(checks: &[Check]) -> (String, bool) {
    let mut out = String::new();
    let mut runs = true;
    for check in checks {
        let (word, text) = match &check.result {
            Ok(text) => ("ok", text.clone()),
            Err(missing) => {
                let word = match missing.weight() {
                    Weight::Notice => "notice",
                    Weight::Warning => "warning",
                    Weight::Blocks => {
                        runs = false;
                        "missing"
                    }
                };
                (word, guard::error_chain(missing))
            }
        };
        out.push_str(&format!("{word:<7} {:<38} {text}\n", check.name));
    }
    (out, runs)
}

fn cgroups() -> Result<String, Missing> {
    let v2 = guard::throttle::cgroup::mounts()
        .into_iter()
        .find(|m| m.v1_controllers.is_none())
        .map(|m| m.root);
    let v1_cpu = Path::new("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").exists();
    let v1_freezer = Path::new("/sys/fs/cgroup/freezer").is_dir();
    let v2_cpu = v2
        .as_ref()
        .and_then(|root| std::fs::read_to_string(root.join("cgroup.controllers")).ok())
        .is_some_and(|controllers| controllers.split_whitespace().any(|c| c == "cpu"));
    match v2 {
        None if !v1_cpu && !v1_freezer => Err(Missing::NoCgroups),
        _ => Ok(format!(
            "v2 at {} (freeze{}), v1 cpu quota {}, v1 freezer {}",
            v2.as_ref()
                .map_or("-".to_owned(), |root| root.display().to_string()),
            if v2_cpu {
                ", cpu.max"
            } else {
                "; no cpu controller"
            },
            if v1_cpu { "yes" } else { "no" },
            if v1_freezer { "yes" } else { "no" },
        )),
    }
}

/// What this process holds, what a running guard keeps after start, and where it learns who
/// a client is.
fn capabilities(config: &Config, ebpf_ready: bool) -> String {
    let held = guard::privileges::held();
    let mut kept: Vec<String> =
        guard::privileges::needed(config, ebpf_ready && config.ebpf.enabled)
            .iter()
            .map(ToString::to_string)
            .collect();
    kept.sort();
    let held = if held.is_empty() {
        "none".to_owned()
    } else {
        held.join(" ")
    };
    let kept = if kept.is_empty() {
        "none".to_owned()
    } else {
        kept.join(" ")
    };
    let peers = if ebpf_ready && config.ebpf.enabled {
        "clients identified from the eBPF record (no CAP_SYS_PTRACE needed)"
    } else {
        "only the /proc fallback identifies clients: another user's process needs \
         CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH"
    };
    format!("held here: {held}; guard keeps after start: {kept}; {peers}")
}

fn nvml() -> Result<String, Missing> {
    const LIBRARY_DIRS: &[&str] = &[
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib64",
        "/usr/lib",
        "/usr/local/nvidia/lib64",
    ];
    LIBRARY_DIRS
        .iter()
        .map(|dir| Path::new(dir).join("libnvidia-ml.so.1"))
        .find(|path| path.exists())
        .map(|path| format!("{} present", path.display()))
        .ok_or(Missing::NoNvml)
}

/// The counter guard shares among requests by their slot time, or that there is none.
fn energy(reader: &EnergyReader) -> Result<String, Missing> {
    match reader.source() {
        Some(_) => Ok(format!(
            "{}: each request's share in the access log and guard_energy_joules_total",
            reader.describe()
        )),
        None => Err(Missing::NoEnergy {
            why: reader.describe(),
        }),
    }
}

/// How a preemptible class's requests go on: from the exact token ids where the upstream is
/// llama-server (its `/props` answers with a build), else from their text.
fn resume(config: &Config) -> String {
    if config.upstream.api == guard::config::Api::Ollama {
        return "from their text: Ollama's API gives no token ids (preemptible = \"exact-only\" \
                never stops them)"
            .to_owned();
    }
    let props = get(config, "/props")
        .and_then(|body| serde_json::from_slice::<guard::upstream::api::llama::Props>(&body).ok());
    match props.and_then(|p| p.build_info) {
        Some(build) => format!(
            "from the exact token ids: llama-server {build} (its prompt cache, --cache-ram, \
             on by default, holds the state; keep it on)"
        ),
        None => "from their text: the upstream is not llama-server, or did not answer /props \
                 (preemptible = \"exact-only\" never stops them)"
            .to_owned(),
    }
}

/// One bodiless GET to the upstream; its body where it answers 200.
fn get(config: &Config, path: &str) -> Option<Vec<u8>> {
    use std::io::{Read as _, Write as _};
    let authority = config.upstream.url.authority();
    let addr = std::net::ToSocketAddrs::to_socket_addrs(authority.as_str())
        .ok()?
        .next()?;
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).ok()?;
    let mut answer = Vec::new();
    stream.take(1 << 20).read_to_end(&mut answer).ok()?;
    let mut headers = [httparse::EMPTY_HEADER; 32];
    let mut response = httparse::Response::new(&mut headers);
    let httparse::Status::Complete(at) = response.parse(&answer).ok()? else {
        return None;
    };
    (response.code == Some(200)).then(|| answer[at..].to_vec())
}

fn upstream(config: &Config) -> Result<String, Missing> {
    let authority = config.upstream.url.authority();
    let addr = std::net::ToSocketAddrs::to_socket_addrs(authority.as_str())
        .map_err(|source| Missing::Resolve {
            authority: authority.to_string(),
            source,
        })?
        .next()
        .ok_or_else(|| Missing::NoAddress {
            authority: authority.to_string(),
        })?;
    TcpStream::connect_timeout(&addr, Duration::from_secs(2))
        .map(|_| format!("{} accepts connections", config.upstream.url))
        .map_err(|source| Missing::Upstream {
            url: config.upstream.url.to_string(),
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_what_stops_guard_fails_doctor() {
        let root = std::env::temp_dir().join(format!("guard-doctor-rapl-{}", std::process::id()));
        let zone = root.join("intel-rapl:0");
        std::fs::create_dir_all(&zone).expect("zone");
        std::fs::write(zone.join("name"), "package-0\n").expect("name");
        std::fs::write(zone.join("energy_uj"), "42\n").expect("energy");
        let found = energy(&EnergyReader::new(None, &root)).expect("a zone");
        assert!(
            found.contains("RAPL powercap") && found.contains("intel-rapl:0 (package-0)"),
            "{found}"
        );
        std::fs::remove_dir_all(&root).expect("clean up");

        let checks = [
            Check {
                name: "cgroups",
                result: Ok("v2".to_owned()),
            },
            Check {
                name: "energy per request",
                result: energy(&EnergyReader::new(None, &root)),
            },
        ];
        let (text, all_ok) = render(&checks);
        let line = text
            .lines()
            .find(|l| l.contains("energy"))
            .expect("energy line");
        assert!(
            line.starts_with("notice ") && line.contains("carry no energy"),
            "{line}"
        );
        assert!(
            all_ok,
            "a missing energy counter does not fail doctor:\n{text}"
        );
        let information = [
            Check {
                name: "cgroups",
                result: Err(Missing::NoCgroups),
            },
            Check {
                name: "NVIDIA GPU (NVML)",
                result: Err(Missing::NoNvml),
            },
            Check {
                name: "upstream",
                result: Err(Missing::NoAddress {
                    authority: "x:1".to_owned(),
                }),
            },
        ];
        let (text, runs) = render(&information);
        assert!(
            runs,
            "a CPU-only box without cgroups or upstream yet runs guard:\n{text}"
        );
        assert!(text.starts_with("notice  cgroups"), "{text}");
        assert!(text.contains("warning upstream"), "{text}");
        let taken = crate::host::Finding {
            key: "server.listen".to_owned(),
            fatal: true,
            why: "127.0.0.1:11434 is taken by ollama (pid 7)".to_owned(),
        };
        let blocking = [Check {
            name: "server.listen",
            result: Err(Missing::Host { finding: taken }),
        }];
        let (text, runs) = render(&blocking);
        assert!(!runs && text.starts_with("missing server.listen"), "{text}");
    }
}
