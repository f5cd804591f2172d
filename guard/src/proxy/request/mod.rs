//! A request to a generation endpoint, owned by one value from arrival to its one outcome.
//!
//! `handle` spawns the owner's task and waits for the response head it sends back. hyper may
//! drop that wait (its connection ended) without touching the owner, which notices through
//! its connection (`Connection::gone`) and concludes. The owner holds the class, the permit,
//! the upstream exchange and the way back to the client; `conclude` is the only place that
//! ends the exchange, returns the permit and records the outcome, in that order.

mod account;
mod phases;
mod preempt;
mod reading;
mod relay;
mod tracked;

use std::{hash::RandomState, sync::Arc, time::Duration};

use guard_net::park::Inbound;
use http::{HeaderValue, Request, Response};
use tokio::{sync::oneshot, time::Instant};

use super::{
    Settings,
    budget::BodyBudget,
    error::{ErrorShape, ProxyError},
    error_shape,
    outcome::{Facts, Job, Outcome, Preemptions, Stage, Timeout},
    resumes::ResumeKinds,
    throughput::Throughput,
};
use account::Account;
pub(super) use account::{logged, who};
pub(super) use phases::client_process;

use crate::{
    access::AccessLog,
    classify::Tally,
    config::ClassTimeouts,
    metrics::Metrics,
    proxy::budget::Held,
    queue::{Permit, Scheduler},
    reap::{EbpfTracker, event::monotonic_now, registry::Connection},
    throttle::ttft::TtftWindow,
    upstream::{
        Body, Client,
        asks::Asks,
        exchange::{Connector, Exchange},
        resume::Endpoint,
        usage::Usage,
    },
    watch::Watched,
};

/// What every queued request shares with the others: the way upstream, the line it waits in,
/// and the places what happens to it is counted. The proxy builds it; a request reads it.
pub(in crate::proxy) struct Shared {
    /// guard's own small requests (exact resumes, `/slots`).
    pub upstream: Client,
    /// Each queued request's exchange has a connection of its own.
    pub connector: Arc<Connector>,
    pub response_timeout: Duration,
    pub metrics: Metrics,
    pub scheduler: Arc<Scheduler>,
    pub tracker: Option<Arc<EbpfTracker>>,
    pub budget: Arc<BodyBudget>,
    /// What the watchers know: remote models, model labels, the energy index.
    pub watched: Arc<Watched>,
    /// Where first-byte times go for the risk detector.
    pub ttft: Arc<TtftWindow>,
    pub tally: Arc<Tally>,
    pub throughput: Arc<Throughput>,
    pub resume_kinds: Arc<ResumeKinds>,
    /// Hashes flow keys (`fair_by`) with a key of this process's own.
    pub flow_keys: RandomState,
    /// Where each request's line goes when it concludes (off unless `log.access` is set).
    pub access: AccessLog,
}

/// What guard reads from a body: its model and the output tokens it asks for.
pub(super) fn read_asks(body: &[u8]) -> (Option<String>, Option<u64>) {
    let asks = Asks::read(body);
    let tokens = asks.tokens();
    (asks.model, tokens)
}

/// Serves one request to a queued endpoint: its owner runs on a task of its own.
pub(super) async fn handle(
    shared: Arc<Shared>,
    settings: Arc<Settings>,
    request: Request<Inbound>,
    connection: &Arc<Connection>,
) -> Response<Body> {
    let shape = error_shape(request.uri().path(), settings.api);
    let (respond, response) = oneshot::channel();
    let owner = QueuedRequest::new(shared, settings, Arc::clone(connection), shape, respond);
    tokio::spawn(owner.run(request));
    response
        .await
        .unwrap_or_else(|_| ProxyError::Internal.into_response(shape))
}

/// How a request ends. Its outcome follows from what the client is told, so the two cannot
/// disagree.
pub(super) enum Ending {
    /// Nobody is told: the client has left, or its answer has begun and ends as
    /// `Relay::finish` says for the outcome, or went whole.
    Quiet(Outcome),
    /// The client is told this error: as its answer if none has begun, else in its stream
    /// where the format has a way to say it.
    Told(ProxyError),
}

/// The way back to the client: the response head goes once, then the answer's frames.
enum Reply {
    /// Until the response head goes to hyper.
    Waiting(oneshot::Sender<Response<Body>>),
    /// After it, for an answer that follows frame by frame.
    Open(relay::Relay),
    /// The whole answer went, or hyper let go of the head (the client left).
    Sent,
}

impl Reply {
    /// Sends a whole response; false if nobody is listening any more (the client left).
    fn send(&mut self, response: Response<Body>) -> bool {
        match std::mem::replace(self, Self::Sent) {
            Self::Waiting(respond) => respond.send(response).is_ok(),
            other => {
                *self = other;
                false
            }
        }
    }

    /// Sends a response head whose frames follow through `relay`.
    fn open(&mut self, response: Response<Body>, relay: relay::Relay) -> bool {
        let sent = self.send(response);
        if sent {
            *self = Self::Open(relay);
        }
        sent
    }

    fn feed(&self) -> Option<&guard_net::client_body::Feed> {
        match self {
            Self::Open(relay) => Some(relay.feed()),
            Self::Waiting(_) | Self::Sent => None,
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

/// Where a request is on its way, holding only what is true there.
#[expect(
    clippy::large_enum_variant,
    reason = "one per request, in place inside its owner; boxing would allocate at each dispatch"
)]
enum Place {
    /// Not admitted to a queue yet: its body is read, it is classified.
    Arrival,
    /// In its class's queue: first, or again after a preemption.
    Queued,
    /// Its turn came: it holds a slot upstream until its exchange is over.
    Running(Running),
}

/// A request holding a slot upstream, and the exchange on it once sent (none between a
/// preemption's pause and its continuation).
struct Running {
    permit: Permit,
    exchange: Option<Exchange>,
    /// When it took the slot, and the energy index then (where the box measures energy).
    since: Instant,
    energy_at: Option<f64>,
}

impl Running {
    fn new(permit: Permit, shared: &Shared) -> Self {
        Self {
            permit,
            exchange: None,
            since: Instant::now(),
            energy_at: shared.watched.energy.now(),
        }
    }
}

/// What a slot's holder used while it held it: time, and its share of the box's energy.
struct Used {
    time: Duration,
    joules: Option<f64>,
}

impl Place {
    fn stage(&self) -> Stage {
        match self {
            Self::Arrival => Stage::Arrival,
            Self::Queued => Stage::Queued,
            Self::Running(_) => Stage::Running,
        }
    }

    /// Gives its slot back: a running request is queued again (or about to end). Its
    /// exchange ends first (the socket closes): only an exchange that is over frees its slot.
    /// Returns the permit and what holding the slot used.
    fn give_back(&mut self, shared: &Shared) -> Option<(Permit, Used)> {
        match std::mem::replace(self, Self::Queued) {
            Self::Running(Running {
                permit,
                exchange,
                since,
                energy_at,
            }) => {
                drop(exchange);
                let joules = energy_at
                    .zip(shared.watched.energy.now())
                    .map(|(at, now)| now - at);
                let held = Used {
                    time: since.elapsed(),
                    joules,
                };
                Some((permit, held))
            }
            other => {
                *self = other;
                None
            }
        }
    }

    fn permit(&self) -> Option<&Permit> {
        match self {
            Self::Running(running) => Some(&running.permit),
            Self::Arrival | Self::Queued => None,
        }
    }

    /// The exchange of a running request, once sent.
    fn exchange(&mut self) -> Option<&mut Exchange> {
        match self {
            Self::Running(running) => running.exchange.as_mut(),
            Self::Arrival | Self::Queued => None,
        }
    }

    /// A running request's permit and exchange, borrowed apart.
    fn running(&mut self) -> (Option<&Permit>, Option<&mut Exchange>) {
        match self {
            Self::Running(running) => (Some(&running.permit), running.exchange.as_mut()),
            Self::Arrival | Self::Queued => (None, None),
        }
    }

    /// Makes `exchange` the running request's exchange (the one before it ends first).
    fn set_exchange(&mut self, exchange: Option<Exchange>) {
        if let Self::Running(running) = self {
            running.exchange = exchange;
        }
    }
}

pub(super) struct QueuedRequest {
    shared: Arc<Shared>,
    settings: Arc<Settings>,
    connection: Arc<Connection>,
    arrived: Instant,
    shape: ErrorShape,
    /// The class the head points to until the body is read, then the class.
    class: Option<String>,
    timeouts: ClassTimeouts,
    place: Place,
    /// The body's share of `server.max_body_bytes_in_flight`, until the body has gone upstream.
    held: Option<Held>,
    /// The whole body has been read (else the connection cannot carry another request).
    body_read: bool,
    reply: Reply,
    model: Option<String>,
    /// On arrival, when guard predicted the request would start.
    predicted: Duration,
    /// Arrival to its first turn, once it came.
    waited: Option<Duration>,
    ttft: Option<Duration>,
    /// What the answer said of its tokens and its end, once it has ended.
    usage: Option<Usage>,
    /// The endpoint, where guard can read its answers' text.
    endpoint: Option<Endpoint>,
    /// Whether the answer's text parsed as JSON (read only for classes that expect it).
    answer_is_json: Option<bool>,
    /// What preemption cost it so far.
    preemptions: Preemptions,
    /// What its access log line says beside the above.
    account: Account,
    concluded: bool,
}

impl QueuedRequest {
    fn new(
        shared: Arc<Shared>,
        settings: Arc<Settings>,
        connection: Arc<Connection>,
        shape: ErrorShape,
        respond: oneshot::Sender<Response<Body>>,
    ) -> Self {
        let timeouts = settings.timeouts(&settings.default_class);
        // Nothing of the line is gathered while the access log is off.
        let account = Account::new(match shared.access.is_on() {
            true => crate::access::request_id(),
            false => crate::access::RequestId::default(),
        });
        Self {
            shared,
            settings,
            connection,
            arrived: Instant::now(),
            shape,
            class: None,
            timeouts,
            place: Place::Arrival,
            held: None,
            body_read: false,
            reply: Reply::Waiting(respond),
            model: None,
            predicted: Duration::ZERO,
            waited: None,
            ttft: None,
            usage: None,
            endpoint: None,
            answer_is_json: None,
            preemptions: Preemptions::default(),
            account,
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
        let stage = self.place.stage();
        let (outcome, answer) = match ending {
            Ending::Quiet(outcome) => (outcome, None),
            Ending::Told(error) => {
                let label = || self.model_label().to_owned();
                (Outcome::of(&error, stage, label), Some(error))
            }
        };
        // The pace guard saw, for servers that do not say their own decode rate.
        let pace = self.place.permit().and_then(|p| p.progress().pace());
        self.free_upstream(outcome == Outcome::Completed);
        let ended = Instant::now();
        let elapsed = ended.saturating_duration_since(self.arrived);
        // Recorded before the client is told: whoever reads the metrics after the answer
        // ends finds it counted.
        let per_token = pace.map(|(_, per_token)| per_token);
        self.record(&outcome, stage, per_token, elapsed);
        self.tell_client(&outcome, answer);
        if self.shared.access.is_on() {
            self.write_access_line(&outcome, stage, ended);
        }
    }

    /// The one hook at the end: the outcome, its timings and the job, written once.
    fn record(
        &self,
        outcome: &Outcome,
        stage: Stage,
        per_token: Option<Duration>,
        elapsed: Duration,
    ) {
        let queue_wait = match stage {
            Stage::Arrival => None,
            _ => Some(self.waited.unwrap_or(elapsed)),
        };
        let prediction_error = self
            .waited
            .map(|waited| waited.as_secs_f64() - self.predicted.as_secs_f64());
        let usage = self.usage.unwrap_or_default();
        outcome.record(
            &self.shared.metrics,
            &Facts {
                peer: self.connection.peer,
                class: self.class.as_deref(),
                elapsed,
                queue_wait,
                prediction_error,
                ttft: self.ttft,
                gone_at: self.connection.gone_at(),
                now_monotonic: monotonic_now(),
                job: self.job(outcome, per_token, &usage),
            },
        );
    }

    /// The request's model as the metrics name it (a bounded set).
    fn model_label(&self) -> &str {
        let model = self.model.as_deref().unwrap_or_default();
        self.shared
            .watched
            .model_label(&self.settings.named_models, model)
    }

    /// A dispatched request as a job, valid when it completed with the server's own end
    /// marker (and JSON where its class expects it); its hour's counts go to the throughput.
    fn job<'a>(
        &'a self,
        outcome: &Outcome,
        per_token: Option<Duration>,
        usage: &'a Usage,
    ) -> Option<Job<'a>> {
        let (Some(class), Some(_)) = (self.class.as_deref(), self.waited) else {
            return None;
        };
        let shaped =
            !self.settings.expect_json.contains(class) || self.answer_is_json == Some(true);
        let valid = *outcome == Outcome::Completed && usage.ended && shaped;
        self.shared.throughput.record(
            class,
            crate::proxy::Hourly {
                valid_jobs: u64::from(valid),
                invalid_jobs: u64::from(!valid),
                prompt_tokens: usage.prompt.unwrap_or(0),
                generated_tokens: usage.generated.unwrap_or(0),
            },
        );
        let measured = per_token
            .filter(|t| !t.is_zero())
            .map(|t| 1.0 / t.as_secs_f64());
        Some(Job {
            valid,
            usage,
            tokens_per_second: usage.decode_per_second.or(measured),
            preemptions: &self.preemptions,
            joules: self.account.energy,
        })
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
        match std::mem::replace(&mut self.reply, Reply::Sent) {
            Reply::Open(relay) => relay.finish(outcome, answer.as_ref()),
            Reply::Waiting(respond) => {
                let mut response = self.answer(answer.unwrap_or(ProxyError::Internal));
                self.account.status = Some(response.status().as_u16());
                let length = http_body::Body::size_hint(response.body()).exact();
                self.account.bytes_out += length.unwrap_or(0);
                if !self.body_read {
                    // The rest of the body is still coming: the connection closes after this
                    // answer, reading (and dropping) what the client sends meanwhile, so that
                    // the client sees the answer rather than a reset.
                    response.headers_mut().insert(
                        http::header::CONNECTION,
                        http::HeaderValue::from_static("close"),
                    );
                    self.connection.linger();
                }
                // Nobody may be listening any more (the client left): that is fine.
                let _ = respond.send(response);
            }
            Reply::Sent => {}
        }
    }

    /// Ends the upstream exchange (its socket closes now), then returns the permit: only an
    /// exchange that is over frees its slot. A completed one teaches the estimator.
    fn free_upstream(&mut self, completed: bool) {
        self.held = None;
        if let Some((permit, held)) = self.place.give_back(&self.shared) {
            self.account.held(&held);
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
            Interrupt::ClientGone => Ending::Quiet(Outcome::Reaped(self.place.stage())),
            Interrupt::MaxDuration => Ending::Told(self.timed_out(Timeout::MaxDuration)),
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
        let mut response = error.into_response(self.shape);
        if self.class.is_some() {
            self.tag(response)
        } else {
            self.tag_id(&mut response);
            response
        }
    }

    /// Adds `X-Guard-Request-Id`, the id its access log line has (where the log is on).
    fn tag_id<B>(&self, response: &mut Response<B>) {
        if !self.shared.access.is_on() {
            return;
        }
        crate::access::tag(response, self.account.id);
    }

    /// Adds `X-Guard-Class` and `X-Guard-Queue-Ms` (the time the request waited in guard).
    fn tag<B>(&self, mut response: Response<B>) -> Response<B> {
        self.tag_id(&mut response);
        let waited = self.waited.unwrap_or_else(|| self.arrived.elapsed());
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
            self.finish(Ending::Told(ProxyError::Internal));
        }
    }
}
