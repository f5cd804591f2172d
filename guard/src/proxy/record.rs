//! One accepted request's outcome, recorded exactly once: completed, failed, rejected after
//! queueing, or (when it is dropped unfinished because its client left) reaped.

use std::sync::Arc;

use tokio::time::Instant;

use crate::{
    metrics::Metrics,
    queue::RejectReason,
    reap::{event::monotonic_now, registry::Connection},
};

/// Where an accepted request is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    Queued,
    Running,
}

impl Stage {
    fn as_str(self) -> &'static str {
        match self {
            Self::Queued => "queued",
            Self::Running => "running",
        }
    }
}

pub enum Outcome {
    Completed,
    Failed,
    Rejected(RejectReason),
}

pub struct RequestRecord {
    metrics: Metrics,
    class: String,
    arrived: Instant,
    stage: Stage,
    connection: Arc<Connection>,
    finished: bool,
}

impl RequestRecord {
    /// Counts the request as accepted into `class`'s queue.
    pub fn admitted(
        metrics: &Metrics,
        class: &str,
        arrived: Instant,
        connection: Arc<Connection>,
    ) -> Self {
        metrics.admitted_total.with_label_values(&[class]).inc();
        Self {
            metrics: metrics.clone(),
            class: class.to_owned(),
            arrived,
            stage: Stage::Queued,
            connection,
            finished: false,
        }
    }

    pub fn dispatched(&mut self) {
        self.stage = Stage::Running;
    }

    /// The first response byte goes to the client now.
    pub fn first_byte(&self) {
        let ttft = self.arrived.elapsed();
        self.metrics
            .ttft_seconds
            .with_label_values(&[&self.class])
            .observe(ttft.as_secs_f64());
        self.metrics.ttft_window.record(&self.class, ttft);
    }

    pub fn finish(mut self, outcome: Outcome) {
        self.finished = true;
        let class = self.class.as_str();
        let label = match outcome {
            Outcome::Completed => "completed",
            Outcome::Failed => "failed",
            Outcome::Rejected(reason) => {
                self.metrics
                    .rejected_total
                    .with_label_values(&[class, reason.as_str()])
                    .inc();
                self.metrics
                    .rejected_after_queueing_total
                    .with_label_values(&[class, reason.as_str()])
                    .inc();
                "rejected"
            }
        };
        self.metrics
            .requests_total
            .with_label_values(&[class, label])
            .inc();
        if !matches!(outcome, Outcome::Rejected(_)) {
            self.metrics
                .request_duration_seconds
                .with_label_values(&[class])
                .observe(self.arrived.elapsed().as_secs_f64());
        }
    }
}

impl Drop for RequestRecord {
    /// Dropped unfinished: the connection was dropped under the request, because its client
    /// left (the kernel said so, or hyper found the socket closed).
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        let stage = self.stage.as_str();
        let class = self.class.as_str();
        self.metrics
            .requests_total
            .with_label_values(&[class, "reaped"])
            .inc();
        self.metrics
            .reaped_total
            .with_label_values(&[class, stage])
            .inc();
        let dropped_at = monotonic_now();
        let latency = self
            .connection
            .gone_at()
            .map(|gone_at| dropped_at.saturating_sub(gone_at));
        if let Some(latency) = latency {
            self.metrics
                .reap_latency_seconds
                .observe(latency.as_secs_f64());
        }
        tracing::debug!(
            peer = %self.connection.peer,
            class,
            stage,
            latency_us = latency.map(|l| l.as_micros() as u64),
            dropped_at_ns = dropped_at.as_nanos() as u64,
            "reaped: the client left"
        );
    }
}
