//! `guard run`: starts every part, waits for signals, and shuts down in order.

use std::{
    net::SocketAddr,
    path::PathBuf,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use tokio::{
    net::TcpListener,
    signal::unix::{Signal, SignalKind, signal},
    sync::{mpsc, watch},
    task::JoinHandle,
};

use crate::access::AccessLog;
use crate::metrics::labels::{Listener, Reload};
use crate::{
    classify::Tally,
    config::{Config, Listen},
    metrics::{self, Metrics},
    proxy::{self, Proxy, ProxyError},
    queue::Scheduler,
    reap::{ConnEvent, EbpfError, EbpfTracker, Loaded, reaper, registry::Registry},
    status::{EbpfStatus, RiskStatus, Status, UpstreamStatus},
    throttle::{ThrottleSetupError, Throttler, risk, ttft::TtftWindow},
    upstream,
    watch::{self as watchers, Watched},
};

#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error("cannot listen on {addr} ({key})")]
    Bind {
        key: &'static str,
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error(transparent)]
    Proxy(#[from] ProxyError),
    #[error("cannot install a signal handler")]
    Signal(#[source] std::io::Error),
    #[error(transparent)]
    Workers(#[from] proxy::WorkersError),
    #[error("cannot make the model-server metrics")]
    Metrics(#[source] prometheus::Error),
    #[error(transparent)]
    Throttle(#[from] ThrottleSetupError),
    #[error("log.access")]
    AccessLog(#[source] crate::access::OpenError),
}

/// The kernel half's state, as /status and /metrics report it.
struct EbpfState {
    tracker: Option<Arc<EbpfTracker>>,
    unavailable: Option<String>,
}

/// What `guard run` does before any thread exists: bind the listeners and load the eBPF
/// program, the only steps that may need privileges (see `privileges`).
pub struct Setup {
    metrics: Metrics,
    throttler: Throttler,
    /// One socket for each of `server.listen`'s addresses.
    proxy: Vec<Bound>,
    metrics_listener: Vec<Bound>,
    /// HAProxy's agent check (`cluster.agent_listen`), where configured.
    agent: Option<Bound>,
    /// The ports the proxy's sockets got (the kernel's choice where the config said 0).
    ports: Vec<u16>,
    ebpf: Result<Loaded, EbpfError>,
}

impl Setup {
    pub fn new(config: &Config) -> Result<Self, DaemonError> {
        let metrics = Metrics::new();
        // Before anything else: checks and locks each class cgroup and restores what a crash
        // left (a second guard on the same cgroups stops here, naming the key).
        let throttler = Throttler::new(config, &metrics)?;
        let proxy = bind_all("server.listen", &config.server.listen)?;
        let metrics_listener = bind_all("metrics.listen", &config.metrics.listen)?;
        let agent = config
            .cluster
            .agent_listen
            .map(|addr| bind("cluster.agent_listen", addr))
            .transpose()?;
        let mut ports: Vec<u16> = proxy.iter().map(|bound| bound.port()).collect();
        ports.sort_unstable();
        ports.dedup();
        let ebpf = if config.ebpf.enabled {
            EbpfTracker::load(&ports)
        } else {
            Err(EbpfError::Disabled)
        };
        Ok(Self {
            metrics,
            throttler,
            proxy,
            metrics_listener,
            agent,
            ports,
            ebpf,
        })
    }

    /// Whether the kernel program is attached.
    pub fn ebpf_attached(&self) -> bool {
        self.ebpf.is_ok()
    }
}

/// Runs until SIGTERM or SIGINT; returns once everything is shut down and restored.
pub async fn run(
    config: Config,
    config_path: Option<PathBuf>,
    setup: Setup,
) -> Result<(), DaemonError> {
    let started = Instant::now();
    let mut signals = Signals::install()?;
    raise_open_file_limit();
    crate::memory::return_large_blocks_to_the_system();
    let Setup {
        metrics,
        throttler,
        proxy: proxy_sockets,
        metrics_listener,
        agent,
        ports,
        ebpf,
    } = setup;
    for result in [RELOAD_APPLIED, RELOAD_REFUSED] {
        metrics.config_reloads_total.of(&Reload { result });
    }
    let proxy_listeners = listening(proxy_sockets)?;
    let metrics_listeners = listening(metrics_listener)?;
    let access = open_access_log(&config, &metrics)?;
    let parts = Parts::start(&config, metrics, throttler, ebpf, ports, access)?;
    let sources = Arc::new(parts.status_sources(&config, config_path.clone(), started));
    let metrics_task = spawn_metrics(&config, &parts.metrics, metrics_listeners, &sources)?;
    let agent_task = agent.map(|bound| spawn_agent(bound, &parts.metrics, &sources));
    let agent_task = agent_task.transpose()?;
    let (configs, configs_seen) = watch::channel(config.clone());
    let risk_task = tokio::spawn(risk::run(configs_seen, parts.detector(&sources.risk)));
    let (stop, stopped) = watch::channel(false);
    let grace = Duration::from_millis(config.server.drain_grace_ms);
    let workers = proxy::Workers::per_cpu()?;
    let proxy_task = tokio::spawn(proxy::serve(
        proxy_listeners,
        Arc::clone(&parts.proxy),
        stopped,
        grace,
        workers,
    ));
    tracing::info!(
        listen = %config.server.listen,
        upstream = %config.upstream.url,
        metrics = %config.metrics.listen,
        "guard is serving"
    );
    signals
        .until_stopped(config, config_path.as_deref(), &parts, &configs)
        .await;
    let tasks = Tasks {
        stop,
        proxy: proxy_task,
        metrics: metrics_task,
        agent: agent_task,
        risk: risk_task,
    };
    shut_down(tasks, &parts).await;
    Ok(())
}

/// The access log where `log.access` names one; opened here, after the privileged setup, so
/// that its writer thread never holds a capability.
fn open_access_log(config: &Config, metrics: &Metrics) -> Result<AccessLog, DaemonError> {
    match &config.log.access {
        Some(path) => {
            let dropped = metrics.access_log_dropped_total.clone();
            AccessLog::open(path, dropped).map_err(DaemonError::AccessLog)
        }
        None => Ok(AccessLog::off()),
    }
}

/// The signals guard answers. Installed before anything serves: a SIGTERM or SIGHUP that
/// comes as soon as guard answers must not meet the default action, which kills guard before
/// it restores any cgroup.
struct Signals {
    terminate: Signal,
    interrupt: Signal,
    hangup: Signal,
    /// SIGUSR1: the access log is opened anew (after logrotate moved it).
    reopen: Signal,
}

impl Signals {
    fn install() -> Result<Self, DaemonError> {
        let install = |kind| signal(kind).map_err(DaemonError::Signal);
        Ok(Self {
            terminate: install(SignalKind::terminate())?,
            interrupt: install(SignalKind::interrupt())?,
            hangup: install(SignalKind::hangup())?,
            reopen: install(SignalKind::user_defined1())?,
        })
    }

    /// Waits for SIGTERM or SIGINT; each SIGHUP meanwhile reloads the config and hands the
    /// new one to `configs`' watchers.
    async fn until_stopped(
        &mut self,
        mut config: Config,
        path: Option<&std::path::Path>,
        parts: &Parts,
        configs: &watch::Sender<Config>,
    ) {
        loop {
            tokio::select! {
                _ = self.terminate.recv() => { tracing::info!("SIGTERM"); return; }
                _ = self.interrupt.recv() => { tracing::info!("SIGINT"); return; }
                _ = self.hangup.recv() => {
                    config = reload(config, path, &parts.proxy, &parts.metrics);
                    configs.send_replace(config.clone());
                }
                _ = self.reopen.recv() => parts.access.reopen(),
            }
        }
    }
}

/// What serves, made from the setup: the proxy and the owners of what it shares with the
/// other tasks and with `/status`.
struct Parts {
    metrics: Metrics,
    throttler: Arc<Mutex<Throttler>>,
    ebpf: Arc<Mutex<EbpfState>>,
    scheduler: Arc<Scheduler>,
    watched: Arc<Watched>,
    ttft: Arc<TtftWindow>,
    tally: Arc<Tally>,
    throughput: Arc<proxy::Throughput>,
    resume_kinds: Arc<proxy::resumes::ResumeKinds>,
    access: AccessLog,
    proxy: Arc<Proxy>,
}

impl Parts {
    /// Starts reading the kernel program (and reaping from its events), the upstream watchers
    /// and the scheduler, and makes the proxy over them.
    fn start(
        config: &Config,
        metrics: Metrics,
        throttler: Throttler,
        ebpf: Result<Loaded, EbpfError>,
        listen_ports: Vec<u16>,
        access: AccessLog,
    ) -> Result<Self, DaemonError> {
        let (ebpf, events) = start_ebpf(ebpf, &listen_ports);
        metrics.ebpf_attached.set(i64::from(ebpf.tracker.is_some()));
        let tracker = ebpf.tracker.clone();
        let connections = Arc::new(Registry::default());
        if let Some(events) = events {
            tokio::spawn(reaper::run(events, Arc::clone(&connections), listen_ports));
        }
        let scheduler = Scheduler::new(config, metrics.clone());
        let running: watchers::RunningFn = {
            let scheduler = Arc::clone(&scheduler);
            Arc::new(move || scheduler.load().1)
        };
        let upstream = upstream::Client::new(&config.upstream);
        let watched = watchers::spawn(config, &metrics, upstream, running);
        let ttft = Arc::new(TtftWindow::default());
        let tally = Arc::new(Tally::new(&metrics));
        let throughput = Arc::new(proxy::Throughput::default());
        let resume_kinds = Arc::new(proxy::resumes::ResumeKinds::default());
        let proxy_parts = proxy::Parts {
            metrics: metrics.clone(),
            scheduler: Arc::clone(&scheduler),
            connections,
            tracker,
            watched: Arc::clone(&watched),
            ttft: Arc::clone(&ttft),
            tally: Arc::clone(&tally),
            throughput: Arc::clone(&throughput),
            resume_kinds: Arc::clone(&resume_kinds),
            access: access.clone(),
        };
        let proxy = Arc::new(Proxy::new(config, proxy_parts)?);
        Ok(Self {
            metrics,
            throttler: Arc::new(Mutex::new(throttler)),
            ebpf: Arc::new(Mutex::new(ebpf)),
            scheduler,
            watched,
            ttft,
            tally,
            throughput,
            resume_kinds,
            access,
            proxy,
        })
    }

    /// Where `/status`, the model-server view and the agent check read from.
    fn status_sources(
        &self,
        config: &Config,
        config_path: Option<PathBuf>,
        started: Instant,
    ) -> StatusSources {
        StatusSources {
            config: config.clone(),
            config_path,
            metrics: self.metrics.clone(),
            ebpf: Arc::clone(&self.ebpf),
            scheduler: Arc::clone(&self.scheduler),
            watched: Arc::clone(&self.watched),
            risk: Arc::new(risk::RiskView::default()),
            throttler: Arc::clone(&self.throttler),
            tally: Arc::clone(&self.tally),
            throughput: Arc::clone(&self.throughput),
            resume_kinds: Arc::clone(&self.resume_kinds),
            started,
        }
    }

    /// The risk detector, writing to the view `/status` reads.
    fn detector(&self, view: &Arc<risk::RiskView>) -> risk::Detector {
        risk::Detector {
            scheduler: Arc::clone(&self.scheduler),
            watched: Arc::clone(&self.watched),
            metrics: self.metrics.clone(),
            throttler: Arc::clone(&self.throttler),
            ttft: Arc::clone(&self.ttft),
            view: Arc::clone(view),
        }
    }
}

/// Serves `/metrics`, `/status` and the model-server view.
fn spawn_metrics(
    config: &Config,
    metrics: &Metrics,
    listeners: Vec<TcpListener>,
    sources: &Arc<StatusSources>,
) -> Result<JoinHandle<()>, DaemonError> {
    let status: metrics::StatusFn = {
        let sources = Arc::clone(sources);
        Arc::new(move || serde_json::to_string(&sources.status()).unwrap_or_default())
    };
    let limits = metrics::Limits {
        max_connections: config.metrics.max_connections as usize,
        header_read_timeout: Duration::from_millis(config.metrics.header_read_timeout_ms),
        bearer: config.metrics.bearer.clone(),
    };
    let model_server =
        crate::cluster::model_server::ModelServer::new().map_err(DaemonError::Metrics)?;
    let extra = metrics::Extra {
        path: config.cluster.model_server_path.clone(),
        render: {
            let sources = Arc::clone(sources);
            Arc::new(move || model_server.render(&sources.cluster()))
        },
    };
    Ok(tokio::spawn(metrics::serve(
        listeners,
        metrics.clone(),
        status,
        limits,
        extra,
    )))
}

/// Answers HAProxy's agent check (`cluster.agent_listen`).
fn spawn_agent(
    bound: Bound,
    metrics: &Metrics,
    sources: &Arc<StatusSources>,
) -> Result<JoinHandle<()>, DaemonError> {
    let listener = bound.into_tokio()?;
    let sources = Arc::clone(sources);
    let refused = metrics
        .connections_refused_total
        .of(&Listener { listener: "agent" });
    let line: crate::cluster::agent::LineFn = Arc::new(move || sources.cluster().agent);
    Ok(tokio::spawn(crate::cluster::agent::serve(
        listener, line, refused,
    )))
}

/// The tasks that run until shutdown.
struct Tasks {
    /// Tells the proxy to stop taking connections.
    stop: watch::Sender<bool>,
    proxy: JoinHandle<()>,
    metrics: JoinHandle<()>,
    agent: Option<JoinHandle<()>>,
    risk: JoinHandle<()>,
}

/// Stops in order: no new connections, queued requests refused, running ones given the
/// grace to finish; then every cgroup put back and the kernel program let go.
async fn shut_down(tasks: Tasks, parts: &Parts) {
    tracing::info!(
        "stopping: no new connections; queued requests get 503; running ones may finish"
    );
    let _ = tasks.stop.send(true);
    parts.scheduler.shut_down();
    if let Err(err) = tasks.proxy.await {
        tracing::error!(%err, "proxy task failed");
    }
    tasks.metrics.abort();
    if let Some(agent) = tasks.agent {
        agent.abort();
    }
    tasks.risk.abort();
    // Every request has concluded: what the log holds goes to its file.
    parts.access.close();
    parts
        .throttler
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .restore(crate::throttle::Reason::Shutdown);
    // The program detaches when the last holder of the tracker lets go (the proxy holds one
    // too); the process exit that follows closes it at the latest.
    parts
        .ebpf
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .tracker
        .take();
    tracing::info!("stopped");
}

/// Each waiting client holds a socket: lift the soft limit on open files to the hard one.
fn raise_open_file_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    if let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE)
        && soft < hard
        && let Err(err) = setrlimit(Resource::RLIMIT_NOFILE, hard, hard)
    {
        tracing::warn!(%err, soft, hard, "could not raise the open-file limit");
    }
}

/// A listening socket made before the runtime exists, with the key and address it is for.
struct Bound {
    key: &'static str,
    addr: SocketAddr,
    socket: std::net::TcpListener,
}

impl Bound {
    fn port(&self) -> u16 {
        self.socket
            .local_addr()
            .map_or(self.addr.port(), |a| a.port())
    }

    fn into_tokio(self) -> Result<TcpListener, DaemonError> {
        let Self { key, addr, socket } = self;
        TcpListener::from_std(socket).map_err(|source| DaemonError::Bind { key, addr, source })
    }
}

fn listening(bound: Vec<Bound>) -> Result<Vec<TcpListener>, DaemonError> {
    bound.into_iter().map(Bound::into_tokio).collect()
}

fn bind_all(key: &'static str, listen: &Listen) -> Result<Vec<Bound>, DaemonError> {
    listen.addrs().iter().map(|&addr| bind(key, addr)).collect()
}

/// A listening socket as tokio's own bind makes one (SO_REUSEADDR, a backlog of 1024),
/// made before the runtime exists, non-blocking for it. An IPv6 one takes IPv6 only, so that
/// `[::]` and `0.0.0.0` are two listeners, each as configured.
fn bind(key: &'static str, addr: SocketAddr) -> Result<Bound, DaemonError> {
    use socket2::{Domain, Socket, Type};
    let fail = |source| DaemonError::Bind { key, addr, source };
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, None).map_err(fail)?;
    if addr.is_ipv6() {
        socket.set_only_v6(true).map_err(fail)?;
    }
    socket.set_reuse_address(true).map_err(fail)?;
    socket.set_nonblocking(true).map_err(fail)?;
    socket.bind(&addr.into()).map_err(fail)?;
    socket.listen(1024).map_err(fail)?;
    Ok(Bound {
        key,
        addr,
        socket: socket.into(),
    })
}

/// Starts reading from the kernel program, or says once, clearly, why guard runs without it.
fn start_ebpf(
    loaded: Result<Loaded, EbpfError>,
    ports: &[u16],
) -> (EbpfState, Option<mpsc::Receiver<ConnEvent>>) {
    match loaded.and_then(Loaded::start) {
        Ok((tracker, events)) => {
            tracing::info!(?ports, "eBPF program attached to sock/inet_sock_set_state");
            let state = EbpfState {
                tracker: Some(tracker),
                unavailable: None,
            };
            (state, Some(events))
        }
        Err(err) => {
            let why = crate::error_chain(&err);
            tracing::warn!(
                "eBPF is off: {why}; guard runs on and notices departed clients in user space"
            );
            let state = EbpfState {
                tracker: None,
                unavailable: Some(why),
            };
            (state, None)
        }
    }
}

/// Each class's cgroup and throttle mode: set up (and locked) at start only.
fn cgroups(config: &Config) -> Vec<(&String, Option<&std::path::PathBuf>, Option<String>)> {
    config
        .class
        .iter()
        .map(|(name, c)| (name, c.cgroup.as_ref(), c.throttle.map(|t| t.to_string())))
        .collect()
}

/// The `result` label of `guard_config_reloads_total`.
const RELOAD_APPLIED: &str = "ok";
const RELOAD_REFUSED: &str = "refused";

/// SIGHUP: re-reads the config file; a bad one is refused and the running one kept.
fn reload(
    current: Config,
    path: Option<&std::path::Path>,
    proxy: &Proxy,
    metrics: &Metrics,
) -> Config {
    let Some(path) = path else {
        tracing::warn!("SIGHUP: guard runs on built-in defaults; there is no file to reload");
        return current;
    };
    match Config::load(path) {
        Ok(next) => {
            for (key, changed) in [
                ("server.listen", next.server.listen != current.server.listen),
                (
                    "metrics.listen",
                    next.metrics.listen != current.metrics.listen,
                ),
                ("upstream.url", next.upstream.url != current.upstream.url),
                (
                    "server.max_connections",
                    next.server.max_connections != current.server.max_connections,
                ),
                (
                    "server.header_read_timeout_ms",
                    next.server.header_read_timeout_ms != current.server.header_read_timeout_ms,
                ),
                (
                    "server.ready_connections",
                    next.server.ready_connections != current.server.ready_connections,
                ),
                (
                    "metrics.max_connections / header_read_timeout_ms / bearer_token_file",
                    next.metrics != current.metrics,
                ),
                ("ebpf.enabled", next.ebpf.enabled != current.ebpf.enabled),
                (
                    "class.*.cgroup / throttle",
                    cgroups(&next) != cgroups(&current),
                ),
                (
                    "risk.state_dir",
                    next.risk.state_dir != current.risk.state_dir,
                ),
                ("log.access", next.log.access != current.log.access),
            ] {
                if changed {
                    tracing::warn!(key, "SIGHUP: this key takes effect at the next start only");
                }
            }
            proxy.reload(&next);
            metrics
                .config_reloads_total
                .of(&Reload {
                    result: RELOAD_APPLIED,
                })
                .inc();
            tracing::info!(path = %path.display(), classes = %next.class_names(), "config reloaded");
            next
        }
        Err(err) => {
            metrics
                .config_reloads_total
                .of(&Reload {
                    result: RELOAD_REFUSED,
                })
                .inc();
            let why = crate::error_chain(&err);
            tracing::error!("SIGHUP: config refused, the running one stays: {why}");
            current
        }
    }
}

/// Where `/status` reads each part from its owner.
struct StatusSources {
    config: Config,
    config_path: Option<PathBuf>,
    metrics: Metrics,
    ebpf: Arc<Mutex<EbpfState>>,
    scheduler: Arc<Scheduler>,
    watched: Arc<Watched>,
    risk: Arc<risk::RiskView>,
    throttler: Arc<Mutex<Throttler>>,
    tally: Arc<Tally>,
    throughput: Arc<proxy::Throughput>,
    resume_kinds: Arc<proxy::resumes::ResumeKinds>,
    started: Instant,
}

impl StatusSources {
    fn status(&self) -> Status {
        let ebpf = self
            .ebpf
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(tracker) = &ebpf.tracker {
            // The kernel's counters, brought up to date for /metrics too.
            Metrics::mirror(&self.metrics.ebpf_events_total, tracker.events_sent());
            Metrics::mirror(&self.metrics.ebpf_ring_drops_total, tracker.ring_drops());
        }
        let config = &self.config;
        // Each owner read once: the cluster view is made of the same readings /status shows.
        let classes = self.scheduler.snapshot();
        let watch = self.watched.status();
        let risk = self.risk.signals();
        let cluster = self.cluster_of(&classes, &watch, &risk);
        // The same view under guard's own names, for an engine config that maps them.
        self.metrics
            .cluster_waiting
            .set(i64::try_from(cluster.waiting).unwrap_or(i64::MAX));
        self.metrics
            .cluster_running
            .set(i64::try_from(cluster.running).unwrap_or(i64::MAX));
        self.metrics.cluster_usage.set(cluster.usage);
        Status {
            version: env!("CARGO_PKG_VERSION").to_owned(),
            uptime_seconds: self.started.elapsed().as_secs(),
            config: self.config_path.as_ref().map(|p| p.display().to_string()),
            listen: config.server.listen.to_string(),
            upstream: UpstreamStatus {
                url: config.upstream.url.to_string(),
                api: config.upstream.api,
                max_concurrency: config.upstream.max_concurrency,
            },
            ebpf: EbpfStatus {
                attached: ebpf.tracker.is_some(),
                unavailable_reason: ebpf.unavailable.clone(),
                events_total: self.metrics.ebpf_events_total.get(),
                ring_drops_total: self.metrics.ebpf_ring_drops_total.get(),
            },
            classes,
            classified: self.tally.snapshot(),
            preemption: self.preemption(),
            last_hour: self.throughput.last_hour(),
            capabilities: crate::privileges::held(),
            risk: RiskStatus {
                signals: risk,
                throttled_classes: self
                    .throttler
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .throttled(),
            },
            watch,
            cluster,
        }
    }

    /// Per preemptible class, its setting and how its requests last went on.
    fn preemption(&self) -> std::collections::BTreeMap<String, crate::status::PreemptStatus> {
        let seen = self.resume_kinds.snapshot();
        self.config
            .class
            .iter()
            .filter(|(_, class)| class.preemptible != crate::config::Preemptible::No)
            .map(|(name, class)| {
                let status = crate::status::PreemptStatus {
                    preemptible: class.preemptible,
                    resume: seen.get(name).copied(),
                };
                (name.clone(), status)
            })
            .collect()
    }

    /// What the balancers are told now.
    fn cluster(&self) -> crate::cluster::ClusterView {
        let classes = self.scheduler.snapshot();
        self.cluster_of(&classes, &self.watched.status(), &self.risk.signals())
    }

    /// The view from readings already taken.
    fn cluster_of(
        &self,
        classes: &[crate::queue::ClassSnapshot],
        watch: &crate::watch::WatchStatus,
        risk: &[crate::throttle::risk::Signal],
    ) -> crate::cluster::ClusterView {
        let upstream = watch.upstream.as_ref();
        crate::cluster::Inputs {
            classes,
            capacity: self.config.upstream.max_concurrency,
            served: self.config.cluster.agent_classes.as_deref(),
            at_risk: !risk.is_empty(),
            protect_priority: self.config.risk.protect_priority,
            shutting_down: self.scheduler.is_shutting_down(),
            upstream_up: upstream.map(|u| u.up),
            upstream_waiting: upstream.and_then(|u| u.deferred),
            upstream_kv_usage: upstream.and_then(|u| u.kv_usage),
        }
        .view()
    }
}
