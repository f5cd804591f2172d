//! Relaying a preemptible request: the upstream always streams (guard keeps what it needs to go
//! on), and when the scheduler asks, the exchange stops, the slot goes back, and when this
//! request's turn comes again it goes on where it stopped. On llama-server it goes on from the
//! exact token ids (`upstream::exact`); elsewhere from the text. A client that streams sees its
//! stream pause and go on; one that asked for one answer gets it whole at the end, in its API's
//! shape.

use std::{sync::Arc, time::Duration};

use bytes::Bytes;
use http::{header, request, response};
use tokio::time::Instant;

use super::{
    Ending, Place, QueuedRequest, Running, Shared,
    tracked::{Engine, Tracked},
};
use crate::{
    config::Api,
    metrics::labels::Class,
    proxy::error::ProxyError,
    queue::Progress,
    upstream::{
        api::{self, llama},
        exact::ExactError,
        exchange::Exchange,
        frames::{Lines, StreamFormat},
        headers_of,
        resume::{Continuation, Endpoint, Transcript},
    },
};

/// How long guard waits for llama-server to let go of a stopped generation's slot. It lets go
/// at its next token, which on a loaded CPU box can take a second or more; the request that
/// preempted could not start there sooner anyway, and the stopped job's last tokens are
/// counted (`generated_alone`) only once it has let go. A bound only for a server that hangs.
const SLOT_FREE_BOUND: Duration = Duration::from_secs(5);

impl QueuedRequest {
    /// Sends a preemptible request upstream and relays its answer, pausing and going on as
    /// the scheduler asks. A text run stops at once, also while the server still reads its
    /// prompt; an exact run at the server's first token (see `may_stop`).
    pub(super) async fn run_tracked(
        &mut self,
        mut tracked: Tracked,
        head: &request::Parts,
    ) -> Ending {
        // The same for its first segment: it finds whatever of its prompt the cache holds.
        self.flush(&mut tracked, false).await;
        let (segment_head, body) = tracked.first(head);
        let upstream_head = segment_head.as_ref().unwrap_or(head);
        let started = match &tracked.engine {
            Engine::Exact(_) => {
                let headers = headers_of(&upstream_head.headers);
                self.forward(upstream_head, headers, body).await.map(Some)
            }
            Engine::Text(_) => self.forward_preemptible(upstream_head, body).await,
        };
        let started = match started {
            Ok(Some(started)) => Ok(started),
            Ok(None) => self.pause(&mut tracked, head).await,
            Err(ending) => Err(ending),
        };
        match started {
            Ok((exchange, answer)) => self.relay(exchange, answer, Some(tracked), head).await,
            Err(ending) => ending,
        }
    }

    /// Forwards, unless the scheduler asks this request to stop first (the server may still be
    /// reading its prompt): then None, and the exchange is dropped.
    async fn forward_preemptible(
        &mut self,
        head: &request::Parts,
        body: Bytes,
    ) -> Result<Option<(Exchange, response::Parts)>, Ending> {
        let progress: Option<Arc<Progress>> = self.place.permit().map(|p| p.progress_shared());
        let preempted = async {
            match &progress {
                Some(progress) => progress.preempted().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            biased;
            () = preempted => Ok(None),
            started = self.forward(head, headers_of(&head.headers), body) => started.map(Some),
        }
    }

    /// Takes a continuation's exchange as the one to relay, where its answer is a stream;
    /// else the client's answer is cut short, and must not end as if whole.
    pub(super) fn went_on(
        &mut self,
        exchange: Exchange,
        answer: &response::Parts,
    ) -> Option<Ending> {
        let streams =
            StreamFormat::of(answer.headers.get(header::CONTENT_TYPE)) != StreamFormat::Whole;
        if !answer.status.is_success() || !streams {
            return Some(Ending::Told(ProxyError::Continuation(answer.status)));
        }
        self.place.set_exchange(Some(exchange));
        None
    }

    /// When an exact run stops, its state is put where the urgent request will not take it
    /// (`Exact::pad`); before it goes on, the slot's state goes into the server's prompt cache
    /// so that the continuation finds its own there (`Exact::flush`). A server that cannot
    /// take either cannot take the continuation: that request fails as its own.
    async fn pad(&mut self, tracked: &mut Tracked) {
        let Engine::Exact(run) = &tracked.engine else {
            return;
        };
        match run.exact.pad(&self.shared.upstream, run.ids.exact()).await {
            Ok(work) => {
                tracked.read.side(work);
                self.preemptions.pad += work.read;
            }
            Err(err) => kept_nothing(&err),
        }
    }

    /// `going_on`: before a continuation, where the token read counts as read again.
    async fn flush(&mut self, tracked: &mut Tracked, going_on: bool) {
        let Engine::Exact(run) = &tracked.engine else {
            return;
        };
        match run.exact.flush(&self.shared.upstream).await {
            Ok(work) => {
                tracked.read.side(work);
                if going_on {
                    tracked.read.reread(work.read);
                    self.count_reread(work.read);
                }
            }
            Err(err) => kept_nothing(&err),
        }
    }

    pub(super) fn count_reread(&mut self, tokens: u64) {
        self.preemptions.reread += tokens;
    }

    /// Stops for a more urgent request: the exchange ends, the slot goes back once the
    /// upstream has let go of it, and when this request's turn comes again it goes on: the
    /// continuation's exchange and answer head.
    pub(super) async fn pause(
        &mut self,
        tracked: &mut Tracked,
        head: &request::Parts,
    ) -> Result<(Exchange, response::Parts), Ending> {
        let exact = matches!(tracked.engine, Engine::Exact(_));
        let before = generated_alone(Arc::clone(&self.shared), exact).await;
        self.place.set_exchange(None);
        let proxy = Arc::clone(&self.shared);
        if self.settings.api == Api::Openai {
            let watch = self.watch();
            tokio::select! {
                biased;
                interrupt = watch.interrupted() => return Err(self.interrupted(interrupt)),
                _ = tokio::time::timeout(SLOT_FREE_BOUND, wait_for_free_slot(&proxy.upstream)) => {}
            }
        }
        let after = match before {
            Some(_) => generated_alone(Arc::clone(&self.shared), exact).await,
            None => None,
        };
        if let (Some(before), Some(after)) = (before, after)
            && let Engine::Exact(run) = &mut tracked.engine
        {
            // The stopped task's tokens are counted as it ends: past what its stream said
            // are those it made before it saw the stream closed.
            let ended = (after - before).max(0.0) as u64;
            run.unseen += ended.saturating_sub(run.ids.segment_tokens());
        }
        self.pad(tracked).await;
        let paused = Instant::now();
        let class = self.class.clone().unwrap_or_default();
        let stopped = proxy.metrics.preempted_total.of(&Class { class: &class });
        stopped.inc();
        let Some((permit, held)) = self.place.give_back(&self.shared) else {
            return Err(Ending::Told(ProxyError::Internal));
        };
        self.account.held(&held);
        tracing::debug!(class, tokens = tracked.generated(), "preempted");
        let ticket = permit.requeue(self.arrived);
        let watch = self.watch();
        let granted = tokio::select! {
            biased;
            interrupt = watch.interrupted() => return Err(self.interrupted(interrupt)),
            granted = ticket.wait() => granted,
        };
        let permit = granted.map_err(|rejection| {
            Ending::Told(ProxyError::Rejected {
                class: class.clone(),
                reason: rejection.reason,
                retry_after: rejection.retry_after,
            })
        })?;
        self.place = Place::Running(Running::new(permit, &self.shared));
        self.preemptions.pauses.push(paused.elapsed());
        Box::pin(self.go_on(tracked, head)).await
    }

    /// Sends the continuation. Preempted again before its answer begins, it pauses again.
    async fn go_on(
        &mut self,
        tracked: &mut Tracked,
        head: &request::Parts,
    ) -> Result<(Exchange, response::Parts), Ending> {
        self.preemptions.kind = Some(tracked.kind());
        tracked.lines = Lines::default();
        tracked.read.next_segment();
        self.flush(tracked, true).await;
        let (segment_head, body) = match &mut tracked.engine {
            Engine::Exact(run) => {
                let before = run.ids.regenerated;
                let generated = run.ids.resume();
                let body = run.exact.segment(generated);
                self.preemptions.regenerated += run.ids.regenerated - before;
                (Some(run.exact.head(head)), body)
            }
            Engine::Text(transcript) => {
                if tracked.plan.continuation == Continuation::Restart {
                    self.preemptions.regenerated += transcript.generated;
                    *transcript = Transcript::default();
                } else {
                    // llama-server repeats an assistant prefill at the start of its answer.
                    let echoes = tracked.plan.endpoint == Endpoint::OpenAiChat
                        && self.settings.api == Api::Openai;
                    transcript.continue_after(echoes);
                }
                let body = tracked
                    .plan
                    .continued_body(&transcript.text, transcript.generated);
                (None, body)
            }
        };
        let upstream_head = segment_head.as_ref().unwrap_or(head);
        let started = match &tracked.engine {
            Engine::Exact(_) => {
                let headers = headers_of(&upstream_head.headers);
                Some(self.forward(upstream_head, headers, body).await?)
            }
            Engine::Text(_) => self.forward_preemptible(upstream_head, body).await?,
        };
        match started {
            Some(started) => Ok(started),
            None => Box::pin(self.pause(tracked, head)).await,
        }
    }
}

/// The server's own count of the tokens it generated, where an exact run is the only request
/// guard has running there (else another's end would be taken for this one's).
async fn generated_alone(shared: Arc<Shared>, exact: bool) -> Option<f64> {
    if !exact || shared.scheduler.load().1 != 1 {
        return None;
    }
    let text = shared.upstream.get("/metrics").await?;
    llama::Load::parse(std::str::from_utf8(&text).ok()?)?.predicted_total
}

fn kept_nothing(err: &ExactError) {
    let error = crate::upstream::error_chain(err);
    tracing::debug!(%error, "keeping a preempted state failed");
}

/// llama-server notices a closed stream at its next token; a request dispatched before it has
/// would wait inside the server. Polls `/slots` until one is free, within a bound (a server
/// without `/slots` is not waited for).
async fn wait_for_free_slot(upstream: &crate::upstream::Client) {
    loop {
        let Some(body) = upstream.get("/slots").await else {
            return;
        };
        let slots: Option<Vec<llama::Slot>> = api::parse(&body);
        if slots.is_none_or(|slots| slots.iter().any(|s| !s.is_processing)) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
