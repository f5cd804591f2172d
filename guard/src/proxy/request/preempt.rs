//! Relaying a preemptible request: the upstream always streams (guard keeps what it needs to go
//! on), and when the scheduler asks, the exchange stops, the slot goes back, and when this
//! request's turn comes again it goes on where it stopped. On llama-server it goes on from the
//! exact token ids (`upstream::exact`); elsewhere from the text. A client that streams sees its
//! stream pause and go on; one that asked for one answer gets it whole at the end, in its API's
//! shape.

use std::{sync::Arc, time::Duration};

use bytes::Bytes;
use http::{Response, header, request, response};
use http_body::Frame;
use http_body_util::BodyExt as _;
use tokio::time::Instant;

use super::{
    Ending, Interrupt, QueuedRequest,
    relay::Relay,
    tracked::{Broke, Engine, Tracked},
};
use crate::{
    config::Api,
    proxy::{
        client_body::{ClientBody, Offer},
        error::ProxyError,
        outcome::{FailKind, Outcome, Stage, Timeout},
    },
    queue::Progress,
    upstream::{
        api::{self, llama},
        exact::ExactError,
        exchange::Exchange,
        frames::{Lines, StreamFormat},
        full,
        resume::{self, Continuation, Endpoint, Transcript},
        strip_hop_by_hop,
        usage::Usage,
    },
};

/// How long guard waits for llama-server to let go of a stopped generation's slot.
const SLOT_FREE_BOUND: Duration = Duration::from_millis(500);

/// What the upstream side did next.
enum Next {
    Data(Bytes),
    Other,
    End,
    Idle,
    Broken(hyper::Error),
    Preempted,
    Interrupted(Interrupt),
}

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
            Engine::Exact(_) => self.forward(upstream_head, body).await.map(Some),
            Engine::Text(_) => self.forward_preemptible(upstream_head, body).await,
        };
        let started = match started {
            Ok(Some(started)) => Ok(started),
            Ok(None) => self.pause(&mut tracked, head).await,
            Err(ending) => Err(ending),
        };
        match started {
            Ok((exchange, answer)) => self.relay_tracked(exchange, answer, tracked, head).await,
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
        let progress: Option<Arc<Progress>> = self.permit.as_ref().map(|p| p.progress_shared());
        let preempted = async {
            match &progress {
                Some(progress) => progress.preempted().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            biased;
            () = preempted => Ok(None),
            started = self.forward(head, body) => started.map(Some),
        }
    }

    /// Relays a preemptible request's answer, pausing and going on as the scheduler asks.
    async fn relay_tracked(
        &mut self,
        exchange: Exchange,
        mut answer: response::Parts,
        mut tracked: Tracked,
        head: &request::Parts,
    ) -> Ending {
        strip_hop_by_hop(&mut answer.headers);
        tracked.format = StreamFormat::of(answer.headers.get(header::CONTENT_TYPE));
        if !answer.status.is_success() || tracked.format == StreamFormat::Whole {
            // An error, or not a stream after all: relayed as it is.
            return self.relay(exchange, answer).await;
        }
        self.exchange = Some(exchange);
        if tracked.plan.client_streams && !self.open_stream(answer, tracked.format) {
            return Ending::quiet(Outcome::Reaped(Stage::Running));
        }
        let watch = self.watch();
        let interrupted = watch.interrupted();
        tokio::pin!(interrupted);
        // Asked to stop where it may not yet: it stops at the first point it may.
        let mut stop_due = false;
        loop {
            let next = self.next_tracked(interrupted.as_mut(), !stop_due).await;
            let ending = match next {
                Next::Data(data) => match self.pass_tracked(&mut tracked, &data).await {
                    None if stop_due && tracked.may_stop() => {
                        stop_due = false;
                        self.pause_and_go_on(&mut tracked, head).await
                    }
                    passed => passed,
                },
                Next::Preempted if !tracked.may_stop() => {
                    stop_due = true;
                    None
                }
                Next::Other => None,
                Next::End => Some(self.end_tracked(&mut tracked)),
                Next::Idle => Some(self.timed_out_ending(Timeout::UpstreamIdle)),
                Next::Broken(err) => Some(Ending::new(
                    Outcome::Failed(FailKind::UpstreamReset),
                    ProxyError::UpstreamReset(err),
                )),
                // A client that leaves once the server has said its last word had its answer.
                Next::Interrupted(Interrupt::ClientGone) if tracked.ended() => {
                    Some(Ending::quiet(Outcome::Completed))
                }
                Next::Interrupted(interrupt) => Some(self.interrupted(interrupt)),
                Next::Preempted => self.pause_and_go_on(&mut tracked, head).await,
            };
            if let Some(ending) = ending {
                return ending;
            }
        }
    }

    async fn pause_and_go_on(
        &mut self,
        tracked: &mut Tracked,
        head: &request::Parts,
    ) -> Option<Ending> {
        match self.pause(tracked, head).await {
            Ok((exchange, answer)) => self.went_on(exchange, &answer),
            Err(ending) => Some(ending),
        }
    }

    /// Takes a continuation's exchange as the one to relay, where its answer is a stream;
    /// else the client's answer is cut short, and must not end as if whole.
    fn went_on(&mut self, exchange: Exchange, answer: &response::Parts) -> Option<Ending> {
        let streams =
            StreamFormat::of(answer.headers.get(header::CONTENT_TYPE)) != StreamFormat::Whole;
        if !answer.status.is_success() || !streams {
            return Some(Ending::new(
                Outcome::Failed(FailKind::UpstreamReset),
                ProxyError::Continuation(answer.status),
            ));
        }
        self.exchange = Some(exchange);
        None
    }

    /// Sends the response head of a stream now: its events follow as they come.
    fn open_stream(&mut self, answer: response::Parts, format: StreamFormat) -> bool {
        let (body, feed) = ClientBody::channel(http_body::SizeHint::default());
        let response = self.tag(Response::from_parts(
            answer,
            body.map_err(Into::into).boxed(),
        ));
        let sent = self
            .respond
            .take()
            .is_some_and(|respond| respond.send(response).is_ok());
        self.relay = Some(Relay::new(feed, format));
        sent
    }

    async fn next_tracked(
        &mut self,
        interrupted: std::pin::Pin<&mut impl Future<Output = Interrupt>>,
        heed_preemption: bool,
    ) -> Next {
        let idle = self.timeouts.upstream_idle;
        let (Some(exchange), Some(permit)) = (self.exchange.as_mut(), self.permit.as_ref()) else {
            return Next::End;
        };
        let progress = permit.progress();
        let preempted = async {
            match heed_preemption {
                true => progress.preempted().await,
                false => std::future::pending().await,
            }
        };
        tokio::select! {
            biased;
            interrupt = interrupted => Next::Interrupted(interrupt),
            () = preempted => Next::Preempted,
            frame = tokio::time::timeout(idle, exchange.frame()) => match frame {
                Err(_) => Next::Idle,
                Ok(None) => Next::End,
                Ok(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) => Next::Data(data),
                    Err(_) => Next::Other,
                },
                Ok(Some(Err(err))) => Next::Broken(err),
            },
        }
    }

    /// Reads one chunk, and passes it on where the client streams.
    async fn pass_tracked(&mut self, tracked: &mut Tracked, data: &[u8]) -> Option<Ending> {
        let (out, tokens, reread) = match tracked.read(data) {
            Ok(read) => read,
            Err(broke) => return Some(self.broke(tracked, broke)),
        };
        if reread > 0 {
            self.count_reread(reread);
        }
        if let Some(permit) = &self.permit {
            permit.progress().advance(tokens);
        }
        if !tracked.plan.client_streams || out.is_empty() {
            return None;
        }
        if self.ttft.is_none() {
            self.first_byte();
        }
        let relay = self.relay.as_ref()?;
        let stall = self.timeouts.client_stall;
        match relay.feed.try_send(Frame::data(Bytes::from(out))) {
            Ok(()) => None,
            Err(Offer::Gone) => Some(Ending::quiet(Outcome::Reaped(Stage::Running))),
            Err(Offer::Full(frame)) => {
                match tokio::time::timeout(stall, relay.feed.send(frame)).await {
                    Ok(Ok(())) => None,
                    Ok(Err(_)) => Some(Ending::quiet(Outcome::Reaped(Stage::Running))),
                    Err(_) => Some(self.timed_out_ending(Timeout::ClientStall)),
                }
            }
        }
    }

    /// When an exact run stops, its state is put where the urgent request will not take it
    /// (`Exact::pad`); before it goes on, the slot's state goes into the server's prompt cache
    /// so that the continuation finds its own there (`Exact::flush`). A server that cannot
    /// take either cannot take the continuation: that request fails as its own.
    async fn pad(&mut self, tracked: &mut Tracked) {
        let Engine::Exact(run) = &tracked.engine else {
            return;
        };
        match run.exact.pad(&self.proxy.upstream, run.ids.exact()).await {
            Ok(work) => {
                tracked.read.side(work);
                let class = self.class.as_deref().unwrap_or_default();
                let pad = &self.proxy.metrics.preempt_pad_tokens_total;
                pad.with_label_values(&[class]).inc_by(work.read);
            }
            Err(err) => kept_nothing(&err),
        }
    }

    /// `going_on`: before a continuation, where the token read counts as read again.
    async fn flush(&mut self, tracked: &mut Tracked, going_on: bool) {
        let Engine::Exact(run) = &tracked.engine else {
            return;
        };
        match run.exact.flush(&self.proxy.upstream).await {
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

    fn count_reread(&self, tokens: u64) {
        let class = self.class.as_deref().unwrap_or_default();
        self.proxy
            .metrics
            .preempt_reread_tokens_total
            .with_label_values(&[class])
            .inc_by(tokens);
    }

    /// The answer cannot go on: the client gets a clean error in its API's shape, never a
    /// different answer passed off as whole.
    fn broke(&mut self, tracked: &Tracked, broke: Broke) -> Ending {
        self.usage = Some(Usage {
            ended: false,
            ..tracked.usage()
        });
        let error = match broke {
            Broke::Diverged(diverged) => {
                tracing::warn!(class = ?self.class, %diverged, "a preempted answer could not go on exactly");
                ProxyError::Diverged(diverged)
            }
            Broke::UpstreamSaid(message) => ProxyError::UpstreamSaid(message),
        };
        // Not the upstream's own error answer: a streaming client is told in its stream.
        Ending::new(Outcome::Failed(FailKind::UpstreamReset), error)
    }

    /// The upstream ended its stream: the whole answer goes to a client that asked for one.
    fn end_tracked(&mut self, tracked: &mut Tracked) -> Ending {
        if !tracked.lines.rest().is_empty() {
            let read = tracked.read(b"\n");
            if let (Ok((out, _, _)), Some(relay)) = (
                read,
                self.relay.as_ref().filter(|_| tracked.plan.client_streams),
            ) {
                // The last line had no newline: it goes as it came.
                let last = out.strip_suffix(b"\n").unwrap_or(&out).to_vec();
                let _ = relay.feed.try_send(Frame::data(Bytes::from(last)));
            }
        }
        if self.expects_json() {
            self.answer_is_json = Some(resume::is_json(tracked.text()));
        }
        self.usage = Some(tracked.usage());
        if !tracked.ended() {
            // Cut short: never a whole answer passed off as complete.
            return Ending::new(
                Outcome::Failed(FailKind::UpstreamReset),
                ProxyError::Truncated,
            );
        }
        if tracked.plan.client_streams {
            return Ending::quiet(Outcome::Completed);
        }
        let body = match &tracked.engine {
            Engine::Exact(run) => run.framer.whole(&run.last, &run.ids),
            Engine::Text(transcript) => {
                let model = self.model.clone().unwrap_or_default();
                resume::whole_answer(tracked.plan.endpoint, &model, transcript)
            }
        };
        let mut response = Response::new(full(body));
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/json"),
        );
        self.first_byte();
        let response = self.tag(response);
        let sent = self
            .respond
            .take()
            .is_some_and(|respond| respond.send(response).is_ok());
        match sent {
            true => Ending::quiet(Outcome::Completed),
            false => Ending::quiet(Outcome::Reaped(Stage::Running)),
        }
    }

    /// Stops for a more urgent request: the exchange ends, the slot goes back once the
    /// upstream has let go of it, and when this request's turn comes again it goes on: the
    /// continuation's exchange and answer head.
    async fn pause(
        &mut self,
        tracked: &mut Tracked,
        head: &request::Parts,
    ) -> Result<(Exchange, response::Parts), Ending> {
        self.exchange = None;
        let proxy = Arc::clone(&self.proxy);
        if self.settings.api == Api::Openai {
            let watch = self.watch();
            tokio::select! {
                biased;
                interrupt = watch.interrupted() => return Err(self.interrupted(interrupt)),
                _ = tokio::time::timeout(SLOT_FREE_BOUND, wait_for_free_slot(&proxy.upstream)) => {}
            }
        }
        self.pad(tracked).await;
        let paused = Instant::now();
        let class = self.class.clone().unwrap_or_default();
        proxy
            .metrics
            .preempted_total
            .with_label_values(&[&class])
            .inc();
        let Some(permit) = self.permit.take() else {
            return Err(Ending::new(
                Outcome::Failed(FailKind::Internal),
                ProxyError::Internal,
            ));
        };
        tracing::debug!(class, tokens = tracked.generated(), "preempted");
        self.stage = Stage::Queued;
        let ticket = permit.requeue(self.arrived);
        let watch = self.watch();
        let granted = tokio::select! {
            biased;
            interrupt = watch.interrupted() => return Err(self.interrupted(interrupt)),
            granted = ticket.wait() => granted,
        };
        let permit = granted.map_err(|rejection| {
            Ending::new(
                Outcome::Rejected {
                    reason: rejection.reason,
                    stage: Stage::Queued,
                },
                ProxyError::Rejected {
                    class: class.clone(),
                    reason: rejection.reason,
                    retry_after: rejection.retry_after,
                },
            )
        })?;
        self.permit = Some(permit);
        proxy
            .metrics
            .preempt_pause_seconds
            .with_label_values(&[&class])
            .observe(paused.elapsed().as_secs_f64());
        Box::pin(self.go_on(tracked, head)).await
    }

    /// Sends the continuation. Preempted again before its answer begins, it pauses again.
    async fn go_on(
        &mut self,
        tracked: &mut Tracked,
        head: &request::Parts,
    ) -> Result<(Exchange, response::Parts), Ending> {
        let class = self.class.clone().unwrap_or_default();
        let metrics = &self.proxy.metrics;
        metrics
            .preempt_resumes_total
            .with_label_values(&[&class, tracked.kind()])
            .inc();
        tracked.lines = Lines::default();
        tracked.read.next_segment();
        let regenerated = metrics
            .preempt_regenerated_tokens_total
            .with_label_values(&[&class]);
        self.flush(tracked, true).await;
        let (segment_head, body) = match &mut tracked.engine {
            Engine::Exact(run) => {
                let before = run.ids.regenerated;
                let generated = run.ids.resume();
                let body = run.exact.segment(generated);
                regenerated.inc_by(run.ids.regenerated - before);
                (Some(run.exact.head(head)), body)
            }
            Engine::Text(transcript) => {
                if tracked.plan.continuation == Continuation::Restart {
                    regenerated.inc_by(transcript.generated);
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
            Engine::Exact(_) => Some(self.forward(upstream_head, body).await?),
            Engine::Text(_) => self.forward_preemptible(upstream_head, body).await?,
        };
        match started {
            Some(started) => Ok(started),
            None => Box::pin(self.pause(tracked, head)).await,
        }
    }
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
