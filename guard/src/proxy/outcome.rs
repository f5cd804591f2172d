//! How a request to a generation endpoint ended, and the one place that records it.

use std::time::Duration;

use crate::{
    metrics::{
        Metrics,
        labels::{
            Class, ClassKind, ClassModel, ClassOutcome, ClassReason, ClassResult, ClassSource,
            ClassStage, ClassWhich, Reason,
        },
    },
    proxy::error::ProxyError,
    queue::RejectReason,
    upstream::UpstreamError,
    upstream::usage::Usage,
};

/// Where a request was when it ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// Not admitted to a queue.
    Arrival,
    Queued,
    Running,
}

impl Stage {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Arrival => "arrival",
            Self::Queued => "queued",
            Self::Running => "running",
        }
    }
}

/// Bad input, refused before queueing and never forwarded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Invalid {
    BadPath,
    /// Two ways to read the body's length (request smuggling).
    Framing,
    BodyTooLarge,
    UnknownClass,
    BodyRead,
    /// A method guard never passes on (`CONNECT`, `TRACE`).
    Method,
    /// A request head hyper refuses to read (a method, URI, header or length it cannot take),
    /// which it answers 400 itself.
    MalformedHead,
    /// A request head hyper judges too large (over the connection's read buffer, or over 100
    /// header fields), which it answers 431 itself.
    HeadTooLarge,
}

/// The invalid reason of a body that did not arrive in time: a timeout, refused as bad input
/// (no class, no queue), so not an `Invalid` of its own.
const BODY_READ_TIMEOUT: &str = "body_read_timeout";

impl Invalid {
    pub const ALL: [Self; 8] = [
        Self::BadPath,
        Self::Framing,
        Self::BodyTooLarge,
        Self::UnknownClass,
        Self::BodyRead,
        Self::Method,
        Self::MalformedHead,
        Self::HeadTooLarge,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::BadPath => "bad_path",
            Self::Framing => "framing",
            Self::BodyTooLarge => "body_too_large",
            Self::UnknownClass => "unknown_class",
            Self::BodyRead => "body_read",
            Self::Method => "method",
            Self::MalformedHead => "malformed_head",
            Self::HeadTooLarge => "head_too_large",
        }
    }
}

/// Which of a class's time limits ran out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Timeout {
    /// The client did not send its whole body in time (before queueing).
    BodyRead,
    /// No frame from the upstream for that long, mid-answer.
    UpstreamIdle,
    /// A write to the client stayed blocked that long.
    ClientStall,
    /// The whole request took that long.
    MaxDuration,
}

impl Timeout {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::BodyRead => "body_read",
            Self::UpstreamIdle => "upstream_idle",
            Self::ClientStall => "client_stall",
            Self::MaxDuration => "max_duration",
        }
    }

    /// The config key that sets it.
    pub fn key(self) -> &'static str {
        match self {
            Self::BodyRead => "body_read_timeout_ms",
            Self::UpstreamIdle => "upstream_idle_ms",
            Self::ClientStall => "client_stall_ms",
            Self::MaxDuration => "max_duration_ms",
        }
    }
}

/// Why an accepted request failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailKind {
    /// No connection, or it broke before the answer's head.
    UpstreamUnreachable,
    /// No answer head within `upstream.response_timeout_ms`.
    UpstreamTimeout,
    /// The upstream answered 5xx (relayed as it was).
    UpstreamError,
    /// The answer broke off mid-body.
    UpstreamReset,
    /// guard let go of the request without deciding (its task was dropped).
    Internal,
}

impl FailKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::UpstreamUnreachable => "upstream_unreachable",
            Self::UpstreamTimeout => "upstream_timeout",
            Self::UpstreamError => "upstream_error",
            Self::UpstreamReset => "upstream_reset",
            Self::Internal => "internal",
        }
    }
}

/// How a request to a generation endpoint ended: exactly one per request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    Invalid(Invalid),
    /// Its model is served from elsewhere and its class may not ask for that (403).
    Refused {
        class: String,
        model: String,
    },
    Rejected {
        reason: RejectReason,
        stage: Stage,
    },
    Completed,
    Failed(FailKind),
    Reaped(Stage),
    TimedOut {
        which: Timeout,
        stage: Stage,
    },
}

/// The `outcome` label values of `guard_requests_total`.
pub const OUTCOMES: [&str; 5] = ["completed", "rejected", "reaped", "failed", "timed_out"];

const STAGES: [Stage; 2] = [Stage::Queued, Stage::Running];
const TIMEOUTS: [Timeout; 3] = [
    Timeout::UpstreamIdle,
    Timeout::ClientStall,
    Timeout::MaxDuration,
];
const FAIL_KINDS: [FailKind; 5] = [
    FailKind::UpstreamUnreachable,
    FailKind::UpstreamTimeout,
    FailKind::UpstreamError,
    FailKind::UpstreamReset,
    FailKind::Internal,
];

/// Makes every per-class series this record writes exist at zero, so dashboards and
/// `absent()` alerts see a class before its first request.
pub fn init_class(metrics: &Metrics, class: &str) {
    let by_class = Class { class };
    for family in [
        &metrics.preempted_total,
        &metrics.preempt_regenerated_tokens_total,
        &metrics.preempt_reread_tokens_total,
        &metrics.preempt_pad_tokens_total,
        &metrics.admitted_total,
    ] {
        family.of(&by_class);
    }
    for family in [
        &metrics.preempt_pause_seconds,
        &metrics.generation_tokens_per_second,
        &metrics.queue_wait_seconds,
        &metrics.ttft_seconds,
        &metrics.request_duration_seconds,
        &metrics.start_prediction_error_seconds,
    ] {
        family.of(&by_class);
    }
    for result in ["valid", "invalid"] {
        metrics.jobs_total.of(&ClassResult { class, result });
    }
    for kind in ["prompt", "generated"] {
        metrics.tokens_total.of(&ClassKind { class, kind });
    }
    for kind in ["exact", "text", "restart"] {
        metrics.preempt_resumes_total.of(&ClassKind { class, kind });
    }
    for source in ["computed", "cached"] {
        metrics
            .prompt_tokens_total
            .of(&ClassSource { class, source });
    }
    for outcome in OUTCOMES {
        metrics.requests_total.of(&ClassOutcome { class, outcome });
    }
    for reason in RejectReason::ALL.map(RejectReason::as_str) {
        metrics.rejected_total.of(&ClassReason { class, reason });
    }
    for reason in [RejectReason::DeadlineExpired, RejectReason::ShuttingDown] {
        let reason = reason.as_str();
        metrics
            .rejected_after_queueing_total
            .of(&ClassReason { class, reason });
    }
    for stage in STAGES.map(Stage::as_str) {
        metrics.reaped_total.of(&ClassStage { class, stage });
    }
    for which in TIMEOUTS.map(Timeout::as_str) {
        metrics.timed_out_total.of(&ClassWhich { class, which });
    }
    for kind in FAIL_KINDS.map(FailKind::as_str) {
        metrics.failed_total.of(&ClassKind { class, kind });
    }
}

/// What preemption cost a request: written with its outcome. (The stop itself is counted
/// as it happens, `guard_preempted_total`, like an admission: operators watch it live.)
#[derive(Debug, Default)]
pub struct Preemptions {
    /// How it went on ("exact", "text", "restart"), once it did.
    pub kind: Option<&'static str>,
    /// Each pause's length, for those that went on.
    pub pauses: Vec<Duration>,
    /// Tokens generated and thrown away (a restart from scratch).
    pub regenerated: u64,
    /// Prompt tokens the server read again to go on.
    pub reread: u64,
    /// Tokens the server read after a short job's state to keep it from the urgent request.
    pub pad: u64,
}

/// A dispatched request as a job: its answer's counts and whether it is valid.
pub struct Job<'a> {
    /// Completed with the server's own end marker (and, where the class expects it, JSON).
    pub valid: bool,
    pub usage: &'a Usage,
    /// The steady decode rate, as the server said or guard saw it.
    pub tokens_per_second: Option<f64>,
    pub preemptions: &'a Preemptions,
    /// Its share of the energy the box measured while it held its slot, where it measures.
    pub joules: Option<f64>,
}

/// What the record needs besides the outcome.
pub struct Facts<'a> {
    pub peer: std::net::SocketAddr,
    pub class: Option<&'a str>,
    /// Arrival to now.
    pub elapsed: Duration,
    /// Of an admitted request: arrival to dispatch, or to leaving the queue.
    pub queue_wait: Option<Duration>,
    /// Of a dispatched request: its actual start minus the start predicted on arrival.
    pub prediction_error: Option<f64>,
    /// Arrival to the first byte sent to the client, where one was.
    pub ttft: Option<Duration>,
    /// Kernel (or user-space) clock of the client's departure, and of now, for reaps.
    pub gone_at: Option<Duration>,
    pub now_monotonic: Duration,
    /// Of a dispatched request.
    pub job: Option<Job<'a>>,
}

impl Outcome {
    /// The outcome of a request whose client is told `error`, at `stage`; `model_label` names
    /// a refused model within the metrics' bounded set.
    pub fn of(error: &ProxyError, stage: Stage, model_label: impl FnOnce() -> String) -> Self {
        match error {
            ProxyError::Framing(_) => Self::Invalid(Invalid::Framing),
            ProxyError::BodyRead(_) => Self::Invalid(Invalid::BodyRead),
            ProxyError::UnknownClass(_) => Self::Invalid(Invalid::UnknownClass),
            ProxyError::BadPath(_) => Self::Invalid(Invalid::BadPath),
            ProxyError::BodyTooLarge { .. } => Self::Invalid(Invalid::BodyTooLarge),
            ProxyError::Rejected { reason, .. } => Self::Rejected {
                reason: *reason,
                stage,
            },
            ProxyError::RemoteModel { class, .. } => Self::Refused {
                class: class.clone(),
                model: model_label(),
            },
            ProxyError::Upstream(UpstreamError::Timeout(_)) | ProxyError::UpstreamTimeout(_) => {
                Self::Failed(FailKind::UpstreamTimeout)
            }
            ProxyError::Upstream(_) | ProxyError::Exchange(_) => {
                Self::Failed(FailKind::UpstreamUnreachable)
            }
            // An answer that broke off, or could not go on: never passed off as whole.
            ProxyError::UpstreamReset(_)
            | ProxyError::Continuation(_)
            | ProxyError::Diverged(_)
            | ProxyError::UpstreamSaid(_)
            | ProxyError::Truncated => Self::Failed(FailKind::UpstreamReset),
            ProxyError::BodyReadTimeout { .. } => Self::TimedOut {
                which: Timeout::BodyRead,
                stage: Stage::Arrival,
            },
            ProxyError::TimedOut { which, .. } => Self::TimedOut {
                which: *which,
                stage,
            },
            // Connection-level refusals never reach a queued request.
            ProxyError::TooManyConnections
            | ProxyError::PassthroughFull { .. }
            | ProxyError::MethodNotAllowed { .. }
            | ProxyError::Internal => Self::Failed(FailKind::Internal),
        }
    }

    /// The access log's words for it: the outcome, its reason and the stage it ended at.
    pub fn words(&self) -> (&'static str, Option<&'static str>, Option<&'static str>) {
        match self {
            Self::Invalid(reason) => ("invalid", Some(reason.as_str()), None),
            Self::TimedOut {
                which: Timeout::BodyRead,
                ..
            } => ("invalid", Some(BODY_READ_TIMEOUT), None),
            Self::Refused { .. } => ("refused", Some("remote_model"), None),
            Self::Rejected { reason, stage } => {
                ("rejected", Some(reason.as_str()), Some(stage.as_str()))
            }
            Self::Completed => ("completed", None, None),
            Self::Failed(kind) => ("failed", Some(kind.as_str()), None),
            Self::Reaped(stage) => ("reaped", None, Some(stage.as_str())),
            Self::TimedOut { which, stage } => {
                ("timed_out", Some(which.as_str()), Some(stage.as_str()))
            }
        }
    }

    /// The `outcome` label of `guard_requests_total`; none for requests never classified.
    pub fn label(&self) -> Option<&'static str> {
        match self {
            Self::Invalid(_) | Self::Refused { .. } => None,
            Self::TimedOut {
                which: Timeout::BodyRead,
                ..
            } => None,
            Self::Rejected { .. } => Some("rejected"),
            Self::Completed => Some("completed"),
            Self::Failed(_) => Some("failed"),
            Self::Reaped(_) => Some("reaped"),
            Self::TimedOut { .. } => Some("timed_out"),
        }
    }

    /// Writes this outcome to the metrics: the only writer of the per-request counters.
    pub fn record(&self, metrics: &Metrics, facts: &Facts<'_>) {
        match self {
            Self::Invalid(reason) => invalid(metrics, reason.as_str()),
            // A body that never arrived is bad input: no class, no queue.
            Self::TimedOut {
                which: Timeout::BodyRead,
                ..
            } => invalid(metrics, BODY_READ_TIMEOUT),
            Self::Refused { class, model } => metrics
                .remote_refused_total
                .of(&ClassModel { class, model })
                .inc(),
            _ => {}
        }
        let (Some(class), Some(outcome)) = (facts.class, self.label()) else {
            return;
        };
        metrics
            .requests_total
            .of(&ClassOutcome { class, outcome })
            .inc();
        timings(metrics, class, facts);
        if let Some(job) = &facts.job {
            record_job(metrics, class, job);
        }
        match self {
            Self::Rejected { reason, stage } => {
                let reason = reason.as_str();
                metrics
                    .rejected_total
                    .of(&ClassReason { class, reason })
                    .inc();
                if *stage != Stage::Arrival {
                    metrics
                        .rejected_after_queueing_total
                        .of(&ClassReason { class, reason })
                        .inc();
                }
            }
            Self::Completed => duration(metrics, class, facts.elapsed),
            Self::Failed(kind) => {
                let kind = kind.as_str();
                metrics.failed_total.of(&ClassKind { class, kind }).inc();
                duration(metrics, class, facts.elapsed);
            }
            Self::Reaped(stage) => reaped(metrics, class, *stage, facts),
            Self::TimedOut { which, .. } => {
                let which = which.as_str();
                metrics
                    .timed_out_total
                    .of(&ClassWhich { class, which })
                    .inc();
            }
            Self::Invalid(_) | Self::Refused { .. } => {}
        }
    }
}

/// Makes every `guard_invalid_requests_total` series exist at zero (its reasons have no class).
pub fn init_invalid(metrics: &Metrics) {
    let reasons = Invalid::ALL.map(Invalid::as_str);
    for reason in reasons.into_iter().chain([BODY_READ_TIMEOUT]) {
        metrics.invalid_requests_total.of(&Reason { reason });
    }
}

/// A request refused before it had an owner (a bad path, framing, a method).
pub fn invalid(metrics: &Metrics, reason: &str) {
    metrics.invalid_requests_total.of(&Reason { reason }).inc();
}

/// A job's result, its tokens by the server's own count, its decode rate and what
/// preemption cost it.
fn record_job(metrics: &Metrics, class: &str, job: &Job<'_>) {
    let result = if job.valid { "valid" } else { "invalid" };
    metrics.jobs_total.of(&ClassResult { class, result }).inc();
    let usage = job.usage;
    for (kind, count) in [("prompt", usage.prompt), ("generated", usage.generated)] {
        if let Some(count) = count {
            metrics
                .tokens_total
                .of(&ClassKind { class, kind })
                .inc_by(count);
        }
    }
    let read = [
        ("computed", usage.prompt_computed),
        ("cached", usage.prompt_cached),
    ];
    for (source, count) in read {
        if let Some(count) = count {
            let series = metrics
                .prompt_tokens_total
                .of(&ClassSource { class, source });
            series.inc_by(count);
        }
    }
    if let Some(rate) = job.tokens_per_second {
        let series = metrics.generation_tokens_per_second.of(&Class { class });
        series.observe(rate);
    }
    if let Some(joules) = job.joules {
        metrics.add_energy(class, joules);
    }
    let paid = job.preemptions;
    if let Some(kind) = paid.kind {
        let series = metrics.preempt_resumes_total.of(&ClassKind { class, kind });
        series.inc_by(paid.pauses.len() as u64);
    }
    for pause in &paid.pauses {
        let series = metrics.preempt_pause_seconds.of(&Class { class });
        series.observe(pause.as_secs_f64());
    }
    for (family, count) in [
        (&metrics.preempt_regenerated_tokens_total, paid.regenerated),
        (&metrics.preempt_reread_tokens_total, paid.reread),
        (&metrics.preempt_pad_tokens_total, paid.pad),
    ] {
        family.of(&Class { class }).inc_by(count);
    }
}

/// The request's histograms: queue wait, prediction error, time to first byte.
fn timings(metrics: &Metrics, class: &str, facts: &Facts<'_>) {
    let by_class = Class { class };
    if let Some(waited) = facts.queue_wait {
        let series = metrics.queue_wait_seconds.of(&by_class);
        series.observe(waited.as_secs_f64());
    }
    if let Some(error) = facts.prediction_error {
        let series = metrics.start_prediction_error_seconds.of(&by_class);
        series.observe(error);
    }
    if let Some(ttft) = facts.ttft {
        metrics
            .ttft_seconds
            .of(&by_class)
            .observe(ttft.as_secs_f64());
    }
}

fn duration(metrics: &Metrics, class: &str, elapsed: Duration) {
    let series = metrics.request_duration_seconds.of(&Class { class });
    series.observe(elapsed.as_secs_f64());
}

fn reaped(metrics: &Metrics, class: &str, stage: Stage, facts: &Facts<'_>) {
    let label = stage.as_str();
    metrics
        .reaped_total
        .of(&ClassStage {
            class,
            stage: label,
        })
        .inc();
    let latency = facts
        .gone_at
        .map(|gone_at| facts.now_monotonic.saturating_sub(gone_at));
    if let Some(latency) = latency {
        metrics.reap_latency_seconds.observe(latency.as_secs_f64());
    }
    tracing::debug!(
        peer = %facts.peer,
        class,
        stage = stage.as_str(),
        latency_us = latency.map(|l| l.as_micros() as u64),
        dropped_at_ns = facts.now_monotonic.as_nanos() as u64,
        "reaped: the client left"
    );
}
