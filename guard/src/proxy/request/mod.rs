//! A request to a generation endpoint, owned by one value from arrival to its one outcome.
//!
//! `handle` spawns the owner's task and waits for the response head it sends back. hyper may
//! drop that wait (its connection ended) without touching the owner, which notices through
//! its connection (`Connection::gone`) and concludes. The owner holds the class, the permit,
//! the upstream exchange and the way back to the client; `conclude` is the only place that
//! ends the exchange, returns the permit and records the outcome, in that order.

mod phases;
mod preempt;
mod relay;
mod tracked;

use std::{sync::Arc, time::Duration};

use http::{HeaderValue, Request, Response};
use tokio::{sync::oneshot, time::Instant};

use super::{
    Proxy, Settings,
    error::{ErrorShape, ProxyError},
    error_shape,
    outcome::{Facts, FailKind, Outcome, Stage, Timeout},
};
use crate::{
    config::ClassTimeouts,
    proxy::budget::Held,
    proxy::park::Inbound,
    queue::Permit,
    reap::{event::monotonic_now, registry::Connection},
    upstream::{Body, asks::Asks, exchange::Exchange, resume::Endpoint, usage::Usage},
};

/// What guard reads from a body: its model and the output tokens it asks for.
pub(super) fn read_asks(body: &[u8]) -> (Option<String>, Option<u64>) {
    let asks = Asks::read(body);
    let tokens = asks.tokens();
    (asks.model, tokens)
}

/// Serves one request to a queued endpoint: its owner runs on a task of its own.
pub(super) async fn handle(
    proxy: Arc<Proxy>,
    settings: Arc<Settings>,
    request: Request<Inbound>,
    connection: &Arc<Connection>,
) -> Response<Body> {
    let shape = error_shape(request.uri().path(), settings.api);
    let (respond, response) = oneshot::channel();
    let owner = QueuedRequest::new(proxy, settings, Arc::clone(connection), shape, respond);
    tokio::spawn(owner.run(request));
    response
        .await
        .unwrap_or_else(|_| ProxyError::Internal.into_response(shape))
}

/// How a request ends: its outcome, and the answer its client gets if no response has begun.
pub(super) struct Ending {
    outcome: Outcome,
    answer: Option<ProxyError>,
}

impl Ending {
    fn new(outcome: Outcome, answer: ProxyError) -> Self {
        Self {
            outcome,
            answer: Some(answer),
        }
    }

    /// An ending nobody is told of: the client has left, or its response has begun.
    fn quiet(outcome: Outcome) -> Self {
        Self {
            outcome,
            answer: None,
        }
    }
}

/// Why a request stopped waiting for whatever it waited for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Interrupt {
    ClientGone,
    MaxDuration,
}

/// What interrupts a request at any point: its client leaving, its time running out.
#[derive(Clone)]
struct Watch {
    connection: Arc<Connection>,
    deadline: Option<Instant>,
}

impl Watch {
    async fn interrupted(&self) -> Interrupt {
        let out_of_time = async {
            match self.deadline {
                Some(deadline) => tokio::time::sleep_until(deadline).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            biased;
            () = self.connection.gone() => Interrupt::ClientGone,
            () = out_of_time => Interrupt::MaxDuration,
        }
    }
}

pub(super) struct QueuedRequest {
    proxy: Arc<Proxy>,
    settings: Arc<Settings>,
    connection: Arc<Connection>,
    arrived: Instant,
    shape: ErrorShape,
    /// Set once classified.
    class: Option<String>,
    timeouts: ClassTimeouts,
    stage: Stage,
    /// Held from dispatch until the upstream exchange is over.
    permit: Option<Permit>,
    /// The body's share of `server.max_body_bytes_in_flight`, until the body has gone upstream.
    held: Option<Held>,
    /// The whole body has been read (else the connection cannot carry another request).
    body_read: bool,
    exchange: Option<Exchange>,
    /// Until the response head has gone to hyper.
    respond: Option<oneshot::Sender<Response<Body>>>,
    /// After it: the way the answer's frames and end go to the client.
    relay: Option<relay::Relay>,
    model: Option<String>,
    /// On arrival, when guard predicted the request would start.
    predicted: Duration,
    /// Its turn came (it holds or held a permit); `waited` is then arrival to dispatch.
    dispatched: bool,
    waited: Duration,
    ttft: Option<Duration>,
    /// What the answer said of its tokens and its end, once it has ended.
    usage: Option<Usage>,
    /// The endpoint, where guard can read its answers' text.
    endpoint: Option<Endpoint>,
    /// Whether the answer's text parsed as JSON (read only for classes that expect it).
    answer_is_json: Option<bool>,
    concluded: bool,
}

impl QueuedRequest {
    fn new(
        proxy: Arc<Proxy>,
        settings: Arc<Settings>,
        connection: Arc<Connection>,
        shape: ErrorShape,
        respond: oneshot::Sender<Response<Body>>,
    ) -> Self {
        let timeouts = settings.timeouts(&settings.default_class);
        Self {
            proxy,
            settings,
            connection,
            arrived: Instant::now(),
            shape,
            class: None,
            timeouts,
            stage: Stage::Arrival,
            permit: None,
            held: None,
            body_read: false,
            exchange: None,
            respond: Some(respond),
            relay: None,
            model: None,
            predicted: Duration::ZERO,
            dispatched: false,
            waited: Duration::ZERO,
            ttft: None,
            usage: None,
            endpoint: None,
            answer_is_json: None,
            concluded: false,
        }
    }

    async fn run(mut self, request: Request<Inbound>) {
        let ending = match self.phases(request).await {
            Ok(ending) | Err(ending) => ending,
        };
        self.conclude(ending);
    }

    /// The one end of the request: consumes it, so it happens once.
    fn conclude(mut self, ending: Ending) {
        self.finish(ending);
        self.concluded = true;
    }

    fn finish(&mut self, ending: Ending) {
        let Ending { outcome, answer } = ending;
        // The pace guard saw, for servers that do not say their own decode rate.
        let pace = self.permit.as_ref().and_then(|p| p.progress().pace());
        self.free_upstream(outcome == Outcome::Completed);
        self.record_job(&outcome, pace.map(|(_, per_token)| per_token));
        self.tell_client(&outcome, answer);
        let elapsed = self.arrived.elapsed();
        let queue_wait = match (self.stage, self.dispatched) {
            (Stage::Arrival, _) => None,
            (_, true) => Some(self.waited),
            (_, false) => Some(elapsed),
        };
        let prediction_error = self
            .dispatched
            .then_some(self.waited.as_secs_f64() - self.predicted.as_secs_f64());
        outcome.record(
            &self.proxy.metrics,
            &Facts {
                peer: self.connection.peer,
                class: self.class.as_deref(),
                elapsed,
                queue_wait,
                prediction_error,
                ttft: self.ttft,
                gone_at: self.connection.gone_at(),
                now_monotonic: monotonic_now(),
            },
        );
    }

    /// Counts a dispatched request as a job, valid when it completed with the server's own end
    /// marker, with the tokens the server said it took and its decode rate.
    fn record_job(&self, outcome: &Outcome, per_token: Option<Duration>) {
        let (Some(class), true) = (self.class.as_deref(), self.dispatched) else {
            return;
        };
        let metrics = &self.proxy.metrics;
        let usage = self.usage.unwrap_or_default();
        // A class that expects JSON counts only answers whose text parses as JSON.
        let shaped =
            !self.settings.expect_json.contains(class) || self.answer_is_json == Some(true);
        let valid = *outcome == Outcome::Completed && usage.ended && shaped;
        let result = if valid { "valid" } else { "invalid" };
        metrics.jobs_total.with_label_values(&[class, result]).inc();
        self.proxy.throughput.record(
            class,
            crate::proxy::Hourly {
                valid_jobs: u64::from(valid),
                invalid_jobs: u64::from(!valid),
                prompt_tokens: usage.prompt.unwrap_or(0),
                generated_tokens: usage.generated.unwrap_or(0),
            },
        );
        for (kind, count) in [("prompt", usage.prompt), ("generated", usage.generated)] {
            if let Some(count) = count {
                metrics
                    .tokens_total
                    .with_label_values(&[class, kind])
                    .inc_by(count);
            }
        }
        let read = [
            ("computed", usage.prompt_computed),
            ("cached", usage.prompt_cached),
        ];
        for (source, count) in read {
            if let Some(count) = count {
                metrics
                    .prompt_tokens_total
                    .with_label_values(&[class, source])
                    .inc_by(count);
            }
        }
        let measured = per_token
            .filter(|t| !t.is_zero())
            .map(|t| 1.0 / t.as_secs_f64());
        if let Some(rate) = usage.decode_per_second.or(measured) {
            metrics
                .generation_tokens_per_second
                .with_label_values(&[class])
                .observe(rate);
        }
    }

    /// Answers the client, or ends the answer it is getting, as the outcome calls for.
    fn tell_client(&mut self, outcome: &Outcome, answer: Option<ProxyError>) {
        if let Outcome::TimedOut {
            which: Timeout::ClientStall,
            ..
        } = outcome
        {
            // It does not read: nothing more can reach it. Close its connection.
            self.connection.end();
        }
        if let Some(relay) = self.relay.take() {
            relay.finish(outcome, answer.as_ref());
        } else if let Some(respond) = self.respond.take() {
            let mut response = self.answer(answer.unwrap_or(ProxyError::Internal));
            if !self.body_read {
                // The rest of the body is still coming: the connection closes after this
                // answer, reading (and dropping) what the client sends meanwhile, so that the
                // client sees the answer rather than a reset.
                response.headers_mut().insert(
                    http::header::CONNECTION,
                    http::HeaderValue::from_static("close"),
                );
                self.connection.linger();
            }
            // Nobody may be listening any more (the client left): that is fine.
            let _ = respond.send(response);
        }
    }

    /// Ends the upstream exchange (its socket closes now), then returns the permit: only an
    /// exchange that is over frees its slot. A completed one teaches the estimator.
    fn free_upstream(&mut self, completed: bool) {
        self.held = None;
        self.exchange = None;
        if let Some(permit) = self.permit.take() {
            if completed {
                let usage = self.usage.unwrap_or_default();
                permit.complete(usage.generated, usage.decode_per_second);
            } else {
                permit.release();
            }
        }
    }

    fn watch(&self) -> Watch {
        let deadline = self
            .timeouts
            .max_duration
            .and_then(|limit| self.arrived.checked_add(limit));
        Watch {
            connection: Arc::clone(&self.connection),
            deadline,
        }
    }

    /// The ending for an interrupt at the current stage.
    fn interrupted(&self, interrupt: Interrupt) -> Ending {
        match interrupt {
            Interrupt::ClientGone => Ending::quiet(Outcome::Reaped(self.stage)),
            Interrupt::MaxDuration => Ending::new(
                Outcome::TimedOut {
                    which: Timeout::MaxDuration,
                    stage: self.stage,
                },
                self.timed_out(Timeout::MaxDuration),
            ),
        }
    }

    fn timed_out(&self, which: Timeout) -> ProxyError {
        let limit = match which {
            Timeout::BodyRead => self.timeouts.body_read,
            Timeout::UpstreamIdle => self.timeouts.upstream_idle,
            Timeout::ClientStall => self.timeouts.client_stall,
            Timeout::MaxDuration => self.timeouts.max_duration.unwrap_or_default(),
        };
        ProxyError::TimedOut {
            class: self.class.clone().unwrap_or_default(),
            which,
            limit,
        }
    }

    /// An error answer, tagged with the class once there is one.
    fn answer(&self, error: ProxyError) -> Response<Body> {
        let response = error.into_response(self.shape);
        if self.class.is_some() {
            self.tag(response)
        } else {
            response
        }
    }

    /// Adds `X-Guard-Class` and `X-Guard-Queue-Ms` (the time the request waited in guard).
    fn tag<B>(&self, mut response: Response<B>) -> Response<B> {
        let waited = match self.dispatched {
            true => self.waited,
            false => self.arrived.elapsed(),
        };
        let headers = response.headers_mut();
        if let Some(value) = self
            .class
            .as_deref()
            .and_then(|class| HeaderValue::from_str(class).ok())
        {
            headers.insert(CLASS_HEADER, value);
        }
        headers.insert(
            QUEUE_MS_HEADER,
            HeaderValue::from(waited.as_millis() as u64),
        );
        response
    }
}

/// guard's own answer headers, named once (a `&str` name is parsed on every insert).
const CLASS_HEADER: http::HeaderName = http::HeaderName::from_static("x-guard-class");
const QUEUE_MS_HEADER: http::HeaderName = http::HeaderName::from_static("x-guard-queue-ms");

impl Drop for QueuedRequest {
    /// The last resort: the owner's task was dropped before it concluded (the runtime is
    /// shutting down, or a bug). The request still ends once, as failed.
    fn drop(&mut self) {
        if !self.concluded {
            self.finish(Ending::new(
                Outcome::Failed(FailKind::Internal),
                ProxyError::Internal,
            ));
        }
    }
}
