//! The phases of a queued request, top to bottom: read its body, look inside, classify it,
//! admit it, wait for its turn, forward it, relay the answer. Each returns the ending that
//! stops the request, if it does.

use std::{hash::BuildHasher as _, sync::Arc};

use bytes::Bytes;
use guard_net::park::Inbound;
use http::{Request, request};
use http_body_util::BodyExt as _;

use super::{
    Ending, Place, QueuedRequest, Running, Shared,
    tracked::{Engine, ExactRun, Tracked},
};
use crate::{
    classify::RequestFacts,
    config::{Api, FairBy, Preemptible},
    metrics::labels::Class,
    proxy::{
        budget::Held,
        error::ProxyError,
        outcome::{Outcome, Stage},
    },
    queue::{Job, RejectReason, Ticket},
    quote::quote,
    reap::{
        peer::{Peer, peer_of},
        registry::Connection,
    },
    upstream::{
        asks::Asks,
        exact::{Exact, Framer},
        exchange::Exchange,
        resume::{Continuation, Endpoint, Plan, ResumeKind, Transcript},
    },
};

type Phase<T> = Result<T, Ending>;

/// Why a body could not be read whole.
enum BodyError {
    TooLarge,
    BudgetFull,
    Read(hyper::Error),
}

/// The body's bytes, in one buffer of its declared length where it has one; every byte past
/// the declared length (a chunked body) is held against the budget as it comes.
async fn collect(
    mut body: Inbound,
    limit: u64,
    declared: Option<u64>,
    held: &mut Held,
) -> Result<Vec<u8>, BodyError> {
    let capacity = declared.and_then(|d| usize::try_from(d).ok()).unwrap_or(0);
    let mut bytes = Vec::with_capacity(capacity);
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame.map_err(BodyError::Read)?.into_data() else {
            continue;
        };
        if (bytes.len() + data.len()) as u64 > limit {
            return Err(BodyError::TooLarge);
        }
        if bytes.len() + data.len() > capacity && !held.grow(data.len() as u64) {
            return Err(BodyError::BudgetFull);
        }
        bytes.extend_from_slice(&data);
    }
    Ok(bytes)
}

/// The head with bytes of its own. hyper's header values and path are slices of the
/// connection's read buffer (8 KiB): a request that waits in line would keep that buffer
/// from being reused, and hyper would take another for the next read, for as long as it
/// waits. A value that does not copy (none should: hyper checked it) stays as it was. The
/// copy keeps the room the client's map had: hyper reads the upstream's answer into the map
/// its request went out in, and the client's connection sized its map to the last answer
/// guard sent (guard's headers included), so that the answer is tagged without regrowing it.
fn detach(mut head: request::Parts) -> request::Parts {
    let mut headers = http::HeaderMap::with_capacity(head.headers.capacity());
    for (name, value) in &head.headers {
        let copy = http::HeaderValue::from_bytes(value.as_bytes()).map(|mut copy| {
            copy.set_sensitive(value.is_sensitive());
            copy
        });
        headers.append(name.clone(), copy.unwrap_or_else(|_| value.clone()));
    }
    head.headers = headers;
    if let Ok(uri) = head.uri.to_string().parse() {
        head.uri = uri;
    }
    head
}

/// The client's process, looked up once per connection (the eBPF record, else /proc).
pub(in crate::proxy) fn client_process<'c>(
    shared: &Shared,
    connection: &'c Connection,
) -> Option<&'c Arc<Peer>> {
    let tracker = shared.tracker.as_deref();
    connection.process(|| peer_of(tracker, connection.peer, connection.local))
}

fn too_large(limit: u64) -> Ending {
    Ending::Told(ProxyError::BodyTooLarge { limit })
}

impl QueuedRequest {
    pub(super) async fn phases(&mut self, request: Request<Inbound>) -> Phase<Ending> {
        let (mut head, body) = request.into_parts();
        // Decoded once, for the endpoint and the log line.
        let path = crate::route::normalize(head.uri.path());
        if self.shared.access.is_on() {
            let shown = path.as_deref().unwrap_or(head.uri.path());
            self.account.head(&head.method, shown);
            // Looked up on arrival, while the client's process surely still exists; cached on
            // its connection.
            client_process(&self.shared, &self.connection);
        }
        let endpoint = path.ok().and_then(|path| Endpoint::of(&path));
        // Until the body is read, the class is the one the head alone points to (rules on the
        // model need the body): its body-read limit applies.
        if let Ok(class) = self.decide(&head, None, false) {
            self.timeouts = self.settings.timeouts(&class);
            self.class = Some(class);
        }
        let bytes = Box::pin(self.read_body(&head, body)).await?;
        self.account.bytes_in = bytes.len() as u64;
        let asks = Asks::read(&bytes);
        let class = self
            .decide(&head, asks.model.as_deref(), true)
            .map_err(Ending::Told)?;
        self.timeouts = self.settings.timeouts(&class);
        self.class = Some(class.clone());
        self.model.clone_from(&asks.model);
        self.check_remote(&class, &asks)?;
        self.endpoint = endpoint;
        let tracked = match self.plan(&head, &bytes, &class) {
            Some((plan, exact_only)) => self.track(plan, exact_only, &head).await,
            None => {
                let preemptible = self.settings.preemptible.get(&class);
                if self.endpoint.is_some() && preemptible.is_some_and(|p| *p != Preemptible::No) {
                    // A generation its preemptible class cannot stop (a constrained answer).
                    self.shared.resume_kinds.saw(&class, ResumeKind::Off);
                }
                None
            }
        };
        let flow = self.flow_key(&head, &class);
        let ticket = self.admit(Job {
            class,
            tokens: asks.tokens(),
            prompt_tokens: asks.prompt_tokens(),
            model: asks.model,
            preemptible: tracked.is_some(),
            flow,
        })?;
        if !ticket.is_granted() {
            head = detach(head);
        }
        self.wait(ticket).await?;
        // Boxed: a request waiting in the queue (there may be thousands) then holds only the
        // state of the phases it has reached, not that of forwarding and relaying.
        if let Some(tracked) = tracked {
            return Ok(Box::pin(self.run_tracked(tracked, &head)).await);
        }
        // Sent once: its headers go as they are, not copied (the map comes back with the
        // answer, which hyper reads into it, and goes on to the client's connection).
        let headers = std::mem::take(&mut head.headers);
        let (exchange, response) = Box::pin(self.forward(&head, headers, bytes)).await?;
        Ok(Box::pin(self.relay(exchange, response, None, &head)).await)
    }

    /// The key of the request's flow in its class (`fair_by`); 0 (the shared flow) where the
    /// class does not tell flows apart or the request has no such key.
    fn flow_key(&self, head: &request::Parts, class: &str) -> u64 {
        let Some(by) = self.settings.fair_by.get(class) else {
            return 0;
        };
        let peer = || client_process(&self.shared, &self.connection);
        let client = self.connection.peer;
        let key = match by {
            FairBy::Uid => peer().and_then(|p| p.uid).map(|uid| uid.to_string()),
            FairBy::Unit => peer().and_then(|p| p.unit.as_deref().map(str::to_owned)),
            FairBy::Cgroup => peer().and_then(|p| p.cgroup.as_deref().map(str::to_owned)),
            FairBy::Token => crate::secret::bearer(&head.headers).map(str::to_owned),
            FairBy::Source => Some(client.ip().to_canonical().to_string()),
            FairBy::Header(name) => head
                .headers
                .get(name)
                .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned()),
        };
        // Keys are hashed with a per-process key: nothing a client sends is kept.
        key.map_or(0, |key| self.shared.flow_keys.hash_one(key).max(1))
    }

    /// How a request of a preemptible class would go on after a preemption, where it can; and
    /// whether its class takes only an exact resume.
    fn plan(&self, head: &request::Parts, body: &Bytes, class: &str) -> Option<(Plan, bool)> {
        let (resume_only, exact_only) = match self.settings.preemptible.get(class)? {
            Preemptible::No => return None,
            Preemptible::Yes => (false, false),
            Preemptible::ResumeOnly => (true, false),
            Preemptible::ExactOnly => (true, true),
        };
        let path = crate::route::normalize(head.uri.path()).ok()?;
        Some((Plan::of(&path, body, resume_only)?, exact_only))
    }

    /// How a preemptible request goes on: from the exact token ids on llama-server, where the
    /// server gives its prompt's ids; else from its text, unless its class takes exact only
    /// (then it is not preemptible). What each class gets is kept for /status.
    async fn track(
        &mut self,
        plan: Plan,
        exact_only: bool,
        head: &request::Parts,
    ) -> Option<Tracked> {
        let exact = match self.settings.api == Api::Openai && plan.may_run_exactly() {
            true => {
                let body = plan.body();
                let upstream = &self.shared.upstream;
                match Exact::prepare(upstream, &head.headers, plan.endpoint, &body).await {
                    Ok(exact) => Some((exact, body)),
                    Err(err) => {
                        tracing::debug!(error = %crate::upstream::error_chain(&err), "no exact resume: from the text");
                        None
                    }
                }
            }
            false => None,
        };
        if let Some(class) = &self.class {
            let kind = match (&exact, exact_only, plan.continuation) {
                (Some(_), _, _) => ResumeKind::Exact,
                (None, true, _) => ResumeKind::Off,
                (None, false, Continuation::Resume) => ResumeKind::Text,
                (None, false, Continuation::Restart) => ResumeKind::Restart,
            };
            self.shared.resume_kinds.saw(class, kind);
        }
        match exact {
            Some((mut exact, body)) => {
                let names = std::mem::take(&mut exact.names);
                let framer = Framer::new(plan.endpoint, names, &body, exact.prompt_tokens());
                let run = ExactRun::new(exact, framer);
                Some(Tracked::new(plan, Engine::Exact(Box::new(run))))
            }
            None if exact_only => None,
            None => Some(Tracked::new(plan, Engine::Text(Transcript::default()))),
        }
    }

    /// Reads the whole body within the class's time, `server.body_limit_bytes` and the body
    /// budget. A declared length over the limit is refused before any of the body is asked
    /// for (so `Expect: 100-continue` gets the 413, never `100 Continue`).
    async fn read_body(&mut self, head: &request::Parts, body: Inbound) -> Phase<Bytes> {
        let limit = self.settings.body_limit;
        let declared = head
            .headers
            .get(http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
        if declared.is_some_and(|length| length > limit) {
            return Err(too_large(limit));
        }
        let mut held = self
            .shared
            .budget
            .reserve(declared.unwrap_or(0))
            .ok_or_else(|| self.body_bytes_full())?;
        let reading = collect(body, limit, declared, &mut held);
        let read = tokio::time::timeout(self.timeouts.body_read, reading).await;
        self.held = Some(held);
        match read {
            Ok(Ok(bytes)) => {
                self.body_read = true;
                Ok(Bytes::from(bytes))
            }
            Ok(Err(BodyError::TooLarge)) => Err(too_large(limit)),
            Ok(Err(BodyError::BudgetFull)) => Err(self.body_bytes_full()),
            Ok(Err(BodyError::Read(err))) => Err(Ending::Told(ProxyError::BodyRead(err))),
            Err(_) => Err(Ending::Told(ProxyError::BodyReadTimeout {
                limit: self.timeouts.body_read,
            })),
        }
    }

    fn body_bytes_full(&self) -> Ending {
        let reason = RejectReason::BodyBytesFull;
        Ending::Told(ProxyError::Rejected {
            class: self.class.clone().unwrap_or_default(),
            reason,
            retry_after: std::time::Duration::from_secs(1),
        })
    }

    /// Refuses a model served elsewhere where the class may not ask for one: the private
    /// chat never leaves the box.
    fn check_remote(&self, class: &str, asks: &Asks) -> Phase<()> {
        let Some(model) = &asks.model else {
            return Ok(());
        };
        if self.settings.remote_allowed.contains(class)
            || !self.shared.watched.remote_models.is_remote(model)
        {
            return Ok(());
        }
        Err(Ending::Told(ProxyError::RemoteModel {
            class: class.to_owned(),
            model: quote(model),
        }))
    }

    /// The class of this request; `last` is the final decision, which the tally counts.
    fn decide(
        &mut self,
        head: &request::Parts,
        model: Option<&str>,
        last: bool,
    ) -> Result<String, ProxyError> {
        let settings = Arc::clone(&self.settings);
        let (proxy, connection) = (&*self.shared, &*self.connection);
        let peer = || client_process(proxy, connection).cloned();
        let classifier = &settings.classifier;
        let decision = classifier.classify(&RequestFacts {
            path: head.uri.path(),
            headers: &head.headers,
            model,
            source: connection.peer.ip(),
            peer: &peer,
        })?;
        tracing::trace!(class = decision.class, by = %decision.by, "classified");
        if last && self.shared.access.is_on() {
            let account = &mut self.account;
            account.decided_by = Some(decision.by);
            account.token = classifier.token_rule(&head.headers).map(str::to_owned);
        }
        if last {
            self.shared.tally.record(classifier, &decision);
        }
        Ok(decision.class)
    }

    fn admit(&mut self, job: Job) -> Phase<Ticket> {
        let class = job.class.clone();
        match self.shared.scheduler.enqueue(job) {
            Ok(ticket) => {
                self.predicted = ticket.predicted();
                // Counted at once, so that admitted = outcomes + in flight + queued at every
                // moment; every outcome is counted by `conclude`.
                let admitted = self
                    .shared
                    .metrics
                    .admitted_total
                    .of(&Class { class: &class });
                admitted.inc();
                self.place = Place::Queued;
                Ok(ticket)
            }
            Err(rejection) => Err(Ending::Told(ProxyError::Rejected {
                class,
                reason: rejection.reason,
                retry_after: rejection.retry_after,
            })),
        }
    }

    async fn wait(&mut self, ticket: Ticket) -> Phase<()> {
        let watch = self.watch();
        let granted = tokio::select! {
            biased;
            // A turn that comes as the client leaves is handed on (the ticket's drop).
            interrupt = watch.interrupted() => return Err(self.interrupted(interrupt)),
            granted = ticket.wait() => granted,
        };
        match granted {
            Ok(permit) => {
                let waited = permit.waited();
                self.waited = Some(waited);
                tracing::debug!(
                    class = self.class.as_deref().unwrap_or_default(),
                    predicted_ms = self.predicted.as_millis() as u64,
                    waited_ms = waited.as_millis() as u64,
                    "dispatched"
                );
                self.place = Place::Running(Running::new(permit, &self.shared));
                Ok(())
            }
            Err(rejection) => Err(Ending::Told(ProxyError::Rejected {
                class: self.class.clone().unwrap_or_default(),
                reason: rejection.reason,
                retry_after: rejection.retry_after,
            })),
        }
    }

    /// Sends the request on an exchange of its own, with `headers` (its head's, or a copy);
    /// returns it with the response head.
    pub(super) async fn forward(
        &mut self,
        head: &request::Parts,
        headers: http::HeaderMap,
        body: Bytes,
    ) -> Phase<(Exchange, http::response::Parts)> {
        // A turn that came as its client left (a burst of departures hands permits along)
        // never reached the upstream: it leaves as reaped while queued.
        if self.connection.is_gone() {
            return Err(Ending::Quiet(Outcome::Reaped(Stage::Queued)));
        }
        let request = self
            .shared
            .upstream
            .for_exchange(head, headers, body)
            .map_err(|err| Ending::Told(err.into()))?;
        let watch = self.watch();
        let response_timeout = self.shared.response_timeout;
        let starting = tokio::time::timeout(
            response_timeout,
            Exchange::start(&self.shared.connector, request),
        );
        let started = tokio::select! {
            biased;
            interrupt = watch.interrupted() => return Err(self.interrupted(interrupt)),
            started = starting => started,
        };
        match started {
            Ok(Ok(started)) => {
                // The body has gone to the upstream: its bytes are no longer guard's to hold.
                self.held = None;
                Ok(started)
            }
            Ok(Err(err)) => {
                let cause = crate::upstream::error_chain(&err);
                tracing::warn!(class = ?self.class, error = %cause, "upstream request failed");
                Err(Ending::Told(err.into()))
            }
            Err(_) => Err(Ending::Told(ProxyError::UpstreamTimeout(response_timeout))),
        }
    }
}
