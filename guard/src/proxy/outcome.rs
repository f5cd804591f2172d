//! How a request to a generation endpoint ended, and the one place that records it.

use std::time::Duration;

use crate::{metrics::Metrics, queue::RejectReason};

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
}

impl Invalid {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::BadPath => "bad_path",
            Self::Framing => "framing",
            Self::BodyTooLarge => "body_too_large",
            Self::UnknownClass => "unknown_class",
            Self::BodyRead => "body_read",
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
    metrics.preempted_total.with_label_values(&[class]);
    metrics.preempt_pause_seconds.with_label_values(&[class]);
    metrics
        .generation_tokens_per_second
        .with_label_values(&[class]);
    for result in ["valid", "invalid"] {
        metrics.jobs_total.with_label_values(&[class, result]);
    }
    for kind in ["prompt", "generated"] {
        metrics.tokens_total.with_label_values(&[class, kind]);
    }
    metrics
        .preempt_regenerated_tokens_total
        .with_label_values(&[class]);
    metrics
        .preempt_reread_tokens_total
        .with_label_values(&[class]);
    metrics.preempt_pad_tokens_total.with_label_values(&[class]);
    for kind in ["exact", "text", "restart"] {
        metrics
            .preempt_resumes_total
            .with_label_values(&[class, kind]);
    }
    for source in ["computed", "cached"] {
        metrics
            .prompt_tokens_total
            .with_label_values(&[class, source]);
    }
    for outcome in OUTCOMES {
        metrics.requests_total.with_label_values(&[class, outcome]);
    }
    for reason in RejectReason::ALL {
        metrics
            .rejected_total
            .with_label_values(&[class, reason.as_str()]);
    }
    for reason in [RejectReason::DeadlineExpired, RejectReason::ShuttingDown] {
        metrics
            .rejected_after_queueing_total
            .with_label_values(&[class, reason.as_str()]);
    }
    for stage in STAGES {
        metrics
            .reaped_total
            .with_label_values(&[class, stage.as_str()]);
    }
    for which in TIMEOUTS {
        metrics
            .timed_out_total
            .with_label_values(&[class, which.as_str()]);
    }
    for kind in FAIL_KINDS {
        metrics
            .failed_total
            .with_label_values(&[class, kind.as_str()]);
    }
    metrics.admitted_total.with_label_values(&[class]);
    for histogram in [
        &metrics.queue_wait_seconds,
        &metrics.ttft_seconds,
        &metrics.request_duration_seconds,
        &metrics.start_prediction_error_seconds,
    ] {
        histogram.with_label_values(&[class]);
    }
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
}

impl Outcome {
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
            } => invalid(metrics, "body_read_timeout"),
            Self::Refused { class, model } => metrics
                .remote_refused_total
                .with_label_values(&[class, model])
                .inc(),
            _ => {}
        }
        let (Some(class), Some(label)) = (facts.class, self.label()) else {
            return;
        };
        metrics
            .requests_total
            .with_label_values(&[class, label])
            .inc();
        timings(metrics, class, facts);
        match self {
            Self::Rejected { reason, stage } => {
                let reason = reason.as_str();
                metrics
                    .rejected_total
                    .with_label_values(&[class, reason])
                    .inc();
                if *stage != Stage::Arrival {
                    metrics
                        .rejected_after_queueing_total
                        .with_label_values(&[class, reason])
                        .inc();
                }
            }
            Self::Completed => duration(metrics, class, facts.elapsed),
            Self::Failed(kind) => {
                metrics
                    .failed_total
                    .with_label_values(&[class, kind.as_str()])
                    .inc();
                duration(metrics, class, facts.elapsed);
            }
            Self::Reaped(stage) => reaped(metrics, class, *stage, facts),
            Self::TimedOut { which, .. } => metrics
                .timed_out_total
                .with_label_values(&[class, which.as_str()])
                .inc(),
            Self::Invalid(_) | Self::Refused { .. } => {}
        }
    }
}

fn invalid(metrics: &Metrics, reason: &str) {
    metrics
        .invalid_requests_total
        .with_label_values(&[reason])
        .inc();
}

/// The request's histograms: queue wait, prediction error, time to first byte.
fn timings(metrics: &Metrics, class: &str, facts: &Facts<'_>) {
    if let Some(waited) = facts.queue_wait {
        metrics
            .queue_wait_seconds
            .with_label_values(&[class])
            .observe(waited.as_secs_f64());
    }
    if let Some(error) = facts.prediction_error {
        metrics
            .start_prediction_error_seconds
            .with_label_values(&[class])
            .observe(error);
    }
    if let Some(ttft) = facts.ttft {
        metrics
            .ttft_seconds
            .with_label_values(&[class])
            .observe(ttft.as_secs_f64());
    }
}

fn duration(metrics: &Metrics, class: &str, elapsed: Duration) {
    metrics
        .request_duration_seconds
        .with_label_values(&[class])
        .observe(elapsed.as_secs_f64());
}

fn reaped(metrics: &Metrics, class: &str, stage: Stage, facts: &Facts<'_>) {
    metrics
        .reaped_total
        .with_label_values(&[class, stage.as_str()])
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
