//! A queued request's place in line (`Ticket`) and its right to be at the upstream (`Permit`).

use std::{sync::Arc, time::Duration};

use tokio::{sync::oneshot, time::Instant};

use super::{Grant, Job, Progress, RejectReason, Rejection, Scheduler};

/// A queued request's place in line. Dropping it (the client left) takes it out of the queue,
/// or hands back a permit that arrived meanwhile.
pub struct Ticket {
    scheduler: Arc<Scheduler>,
    id: u64,
    class: Arc<str>,
    job: Option<Job>,
    arrived: Instant,
    predicted: Duration,
    deadline: Option<Instant>,
    granted: Option<oneshot::Receiver<Grant>>,
}

/// When a ticket's request arrived, when guard predicted it would start, and its deadline.
pub(super) struct Times {
    pub arrived: Instant,
    pub predicted: Duration,
    pub deadline: Option<Duration>,
}

impl Ticket {
    pub(super) fn new(
        scheduler: Arc<Scheduler>,
        id: u64,
        class: Arc<str>,
        job: Job,
        times: Times,
        granted: oneshot::Receiver<Grant>,
    ) -> Self {
        Self {
            scheduler,
            id,
            class,
            job: Some(job),
            arrived: times.arrived,
            predicted: times.predicted,
            // A deadline too far to represent never passes.
            deadline: times.deadline.and_then(|d| times.arrived.checked_add(d)),
            granted: Some(granted),
        }
    }

    /// When guard predicted, on arrival, that this request would start (from arrival).
    pub fn predicted(&self) -> Duration {
        self.predicted
    }

    /// Waits for this request's turn; past its deadline it leaves the queue with a rejection.
    pub async fn wait(mut self) -> Result<Permit, Rejection> {
        let Some(granted) = self.granted.as_mut() else {
            return Err(self.rejection(RejectReason::ShuttingDown));
        };
        let outcome = match self.deadline {
            Some(deadline) => tokio::select! {
                outcome = granted => Some(outcome),
                () = tokio::time::sleep_until(deadline) => None,
            },
            None => Some(granted.await),
        };
        let outcome = match outcome {
            Some(outcome) => outcome,
            None if self.scheduler.remove(self.id, &self.class) => {
                self.granted = None;
                return Err(self.rejection(RejectReason::DeadlineExpired));
            }
            // The permit was sent as the deadline passed: take it.
            None => match self.granted.as_mut().map(oneshot::Receiver::try_recv) {
                Some(Ok(outcome)) => Ok(outcome),
                _ => Ok(Err(RejectReason::DeadlineExpired)),
            },
        };
        self.granted = None;
        match outcome {
            Ok(Ok(progress)) => Ok(Permit {
                scheduler: Arc::clone(&self.scheduler),
                id: self.id,
                class: Arc::clone(&self.class),
                job: self.job.take().unwrap_or_default(),
                waited: self.arrived.elapsed(),
                dispatched: Instant::now(),
                progress,
                released: false,
            }),
            Ok(Err(reason)) => Err(self.rejection(reason)),
            Err(_) => Err(self.rejection(RejectReason::ShuttingDown)),
        }
    }

    /// Whether its permit has been sent (without waiting for it).
    pub fn is_granted(&self) -> bool {
        self.granted.as_ref().is_some_and(|rx| !rx.is_empty())
    }

    fn rejection(&self, reason: RejectReason) -> Rejection {
        Rejection {
            reason,
            retry_after: self.scheduler.head_start(&self.class),
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let Some(mut granted) = self.granted.take() else {
            return;
        };
        if self.scheduler.remove(self.id, &self.class) {
            return;
        }
        // Not queued any more: a permit may be waiting in the channel; give it back.
        if let Ok(Ok(_)) = granted.try_recv() {
            self.scheduler.release(self.id, &self.class, None);
        }
    }
}

/// The right to have one request at the upstream. Its owner returns it once the upstream
/// exchange is over; dropping it (the last resort) frees the slot too.
pub struct Permit {
    scheduler: Arc<Scheduler>,
    id: u64,
    class: Arc<str>,
    job: Job,
    waited: Duration,
    dispatched: Instant,
    progress: Arc<Progress>,
    released: bool,
}

impl Permit {
    /// Time from arrival to dispatch.
    pub fn waited(&self) -> Duration {
        self.waited
    }

    /// Where the relay reports the tokens it passes on.
    pub fn progress(&self) -> &Progress {
        &self.progress
    }

    /// The same, held apart from the permit (to watch for a preemption while the permit's
    /// holder is busy).
    pub fn progress_shared(&self) -> Arc<Progress> {
        Arc::clone(&self.progress)
    }

    /// Frees the slot and teaches the estimator how long this completed request took, with
    /// the tokens the server said it generated and its decode rate, where it said.
    pub fn complete(mut self, generated: Option<u64>, decode_per_second: Option<f64>) {
        self.released = true;
        let seen = super::estimator::Observation {
            class: &self.class,
            model: self.job.model.as_deref(),
            tokens: self.job.tokens,
            prompt: self.job.prompt_tokens,
            generated,
            decode_per_second,
            took: self.dispatched.elapsed(),
        };
        self.scheduler.release(self.id, &self.class, Some(seen));
    }

    /// Stops here for a more urgent request: the slot goes back, and the returned ticket
    /// resolves to a new permit when this request may go on.
    pub fn requeue(mut self, arrived: Instant) -> Ticket {
        self.released = true;
        let job = std::mem::take(&mut self.job);
        self.scheduler.requeue(self.id, &self.class, job, arrived)
    }

    /// Frees the slot without teaching the estimator (the request did not complete).
    pub fn release(mut self) {
        self.released = true;
        self.scheduler.release(self.id, &self.class, None);
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        if !self.released {
            self.scheduler.release(self.id, &self.class, None);
        }
    }
}

impl std::fmt::Debug for Ticket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ticket")
            .field("id", &self.id)
            .field("class", &self.class)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for Permit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Permit")
            .field("id", &self.id)
            .field("class", &self.class)
            .finish_non_exhaustive()
    }
}
