//! Relaying a preemptible request: the upstream always streams (guard keeps the text), and
//! when the scheduler asks, the exchange stops, the slot goes back, and when this request's
//! turn comes again it goes on where it stopped. A client that streams sees its stream pause
//! and go on; one that asked for one answer gets it whole at the end, in its API's shape.

use std::time::Duration;

use bytes::Bytes;
use http::{Response, header, request, response};
use http_body::Frame;
use http_body_util::BodyExt as _;
use tokio::time::Instant;

use super::{Ending, Interrupt, QueuedRequest, relay::Relay};
use crate::{
    config::Api,
    proxy::{
        client_body::ClientBody,
        error::ProxyError,
        outcome::{FailKind, Outcome, Stage, Timeout},
    },
    upstream::{
        api::{self, llama},
        exchange::Exchange,
        frames::{Lines, StreamFormat},
        full,
        resume::{self, Continuation, Endpoint, Plan, Transcript},
        strip_hop_by_hop,
        usage::Usage,
    },
};

/// How long guard waits for llama-server to let go of a stopped generation's slot.
const SLOT_FREE_BOUND: Duration = Duration::from_millis(500);

/// A preemptible request's plan and what its answer has said so far.
pub(super) struct Tracked {
    pub plan: Plan,
    transcript: Transcript,
    lines: Lines,
    format: StreamFormat,
}

impl Tracked {
    pub fn new(plan: Plan) -> Self {
        Self {
            plan,
            transcript: Transcript::default(),
            lines: Lines::default(),
            format: StreamFormat::Whole,
        }
    }

    /// Reads a chunk of the stream; returns what goes to a streaming client (an echoed
    /// prefill taken out) and how many events carried text.
    fn read(&mut self, chunk: &[u8]) -> (Vec<u8>, u64) {
        let (endpoint, format) = (self.plan.endpoint, self.format);
        let transcript = &mut self.transcript;
        let mut out = Vec::with_capacity(chunk.len());
        let mut texts = 0;
        self.lines.push(chunk, |line| {
            let Some(payload) = format.payload(line) else {
                out.extend_from_slice(line);
                out.push(b'\n');
                return;
            };
            let event = transcript.read(payload);
            texts += u64::from(event.as_ref().is_some_and(|e| !e.text.is_empty()));
            match event.filter(|e| e.echoed) {
                Some(event) => {
                    let rewritten = resume::rewrite_text(endpoint, payload, &event.text);
                    let prefix: &[u8] = if format == StreamFormat::Sse {
                        b"data: "
                    } else {
                        b""
                    };
                    out.extend_from_slice(prefix);
                    out.extend_from_slice(rewritten.as_deref().unwrap_or(payload));
                }
                None => out.extend_from_slice(line),
            }
            out.push(b'\n');
        });
        (out, texts)
    }
}

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
    /// Relays a preemptible request's answer, pausing and going on as the scheduler asks.
    pub(super) async fn relay_tracked(
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
        loop {
            let next = self.next_tracked(interrupted.as_mut()).await;
            let ending = match next {
                Next::Data(data) => self.pass_tracked(&mut tracked, &data).await,
                Next::Other => None,
                Next::End => Some(self.end_tracked(&mut tracked)),
                Next::Idle => Some(self.timed_out_ending(Timeout::UpstreamIdle)),
                Next::Broken(err) => Some(Ending::new(
                    Outcome::Failed(FailKind::UpstreamReset),
                    ProxyError::UpstreamReset(err),
                )),
                // A client that leaves once the server has said its last word had its answer.
                Next::Interrupted(Interrupt::ClientGone) if tracked.transcript.ended => {
                    Some(Ending::quiet(Outcome::Completed))
                }
                Next::Interrupted(interrupt) => Some(self.interrupted(interrupt)),
                Next::Preempted => self.pause(&mut tracked, head).await.err(),
            };
            if let Some(ending) = ending {
                return ending;
            }
        }
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
    ) -> Next {
        let idle = self.timeouts.upstream_idle;
        let (Some(exchange), Some(permit)) = (self.exchange.as_mut(), self.permit.as_ref()) else {
            return Next::End;
        };
        let progress = permit.progress();
        tokio::select! {
            biased;
            interrupt = interrupted => Next::Interrupted(interrupt),
            () = progress.preempted() => Next::Preempted,
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
        let (out, texts) = tracked.read(data);
        if let Some(permit) = &self.permit {
            permit.progress().advance(texts);
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
            Err(crate::proxy::client_body::Offer::Gone) => {
                Some(Ending::quiet(Outcome::Reaped(Stage::Running)))
            }
            Err(crate::proxy::client_body::Offer::Full(frame)) => {
                match tokio::time::timeout(stall, relay.feed.send(frame)).await {
                    Ok(Ok(())) => None,
                    Ok(Err(_)) => Some(Ending::quiet(Outcome::Reaped(Stage::Running))),
                    Err(_) => Some(self.timed_out_ending(Timeout::ClientStall)),
                }
            }
        }
    }

    /// The upstream ended its stream: the whole answer goes to a client that asked for one.
    fn end_tracked(&mut self, tracked: &mut Tracked) -> Ending {
        if !tracked.lines.rest().is_empty() {
            let (out, _) = tracked.read(b"\n");
            if let Some(relay) = self.relay.as_ref().filter(|_| tracked.plan.client_streams) {
                // The last line had no newline: it goes as it came.
                let last = out.strip_suffix(b"\n").unwrap_or(&out).to_vec();
                let _ = relay.feed.try_send(Frame::data(Bytes::from(last)));
            }
        }
        let transcript = &tracked.transcript;
        if self.expects_json() {
            self.answer_is_json = Some(resume::is_json(&transcript.text));
        }
        self.usage = Some(Usage {
            prompt: transcript.prompt_tokens,
            generated: Some(transcript.generated),
            decode_per_second: None,
            ended: transcript.ended,
            load: None,
        });
        if tracked.plan.client_streams {
            return Ending::quiet(Outcome::Completed);
        }
        let model = self.model.clone().unwrap_or_default();
        let body = resume::whole_answer(tracked.plan.endpoint, &model, &tracked.transcript);
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
    /// upstream has let go of it, and when this request's turn comes again it goes on.
    async fn pause(&mut self, tracked: &mut Tracked, head: &request::Parts) -> Result<(), Ending> {
        self.exchange = None;
        let proxy = std::sync::Arc::clone(&self.proxy);
        if self.settings.api == Api::Openai {
            let watch = self.watch();
            tokio::select! {
                biased;
                interrupt = watch.interrupted() => return Err(self.interrupted(interrupt)),
                _ = tokio::time::timeout(SLOT_FREE_BOUND, wait_for_free_slot(&proxy.upstream)) => {}
            }
        }
        let paused = Instant::now();
        let class = self.class.clone().unwrap_or_default();
        let metrics = &self.proxy.metrics;
        metrics.preempted_total.with_label_values(&[&class]).inc();
        let Some(permit) = self.permit.take() else {
            return Err(Ending::new(
                Outcome::Failed(FailKind::Internal),
                ProxyError::Internal,
            ));
        };
        tracing::debug!(class, tokens = tracked.transcript.generated, "preempted");
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
        metrics
            .preempt_pause_seconds
            .with_label_values(&[&class])
            .observe(paused.elapsed().as_secs_f64());
        self.go_on(tracked, head).await
    }

    /// Sends the continuation and takes its stream as the one to relay.
    async fn go_on(&mut self, tracked: &mut Tracked, head: &request::Parts) -> Result<(), Ending> {
        let transcript = &mut tracked.transcript;
        match tracked.plan.continuation {
            Continuation::Restart => {
                self.proxy
                    .metrics
                    .preempt_regenerated_tokens_total
                    .with_label_values(&[self.class.as_deref().unwrap_or_default()])
                    .inc_by(transcript.generated);
                *transcript = Transcript::default();
            }
            Continuation::Resume => {
                // llama-server repeats an assistant prefill at the start of its answer.
                let echoes = tracked.plan.endpoint == Endpoint::OpenAiChat
                    && self.settings.api == Api::Openai;
                transcript.continue_after(echoes);
            }
        }
        tracked.lines = Lines::default();
        let body = tracked
            .plan
            .continued_body(&transcript.text, transcript.generated);
        let (exchange, answer) = self.forward(head, body).await?;
        if !answer.status.is_success() {
            // Not an upstream answer relayed as it is: the client's answer is cut short, so
            // it must not end as if whole.
            return Err(Ending::new(
                Outcome::Failed(FailKind::UpstreamReset),
                ProxyError::Continuation(answer.status),
            ));
        }
        self.exchange = Some(exchange);
        Ok(())
    }
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
