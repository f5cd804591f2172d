//! The phases of a queued request, top to bottom: read its body, look inside, classify it,
//! admit it, wait for its turn, forward it, relay the answer. Each returns the ending that
//! stops the request, if it does.

use std::sync::OnceLock;

use bytes::Bytes;
use http::{Request, request};
use http_body_util::{BodyExt as _, LengthLimitError, Limited};
use hyper::body::Incoming;
use serde::{Deserialize, Deserializer};

use super::{Ending, QueuedRequest};
use crate::{
    classify::RequestFacts,
    proxy::{
        error::ProxyError,
        exchange::Exchange,
        outcome::{FailKind, Invalid, Outcome, Stage, Timeout},
    },
    queue::{Job, Ticket},
    reap::owner::client_cgroup,
};

type Phase<T> = Result<T, Ending>;

/// The fields guard reads from a request body; any of them may be missing or of another type
/// (the upstream judges the body, not guard).
#[derive(Debug, Default, Deserialize)]
struct Asks {
    #[serde(default, deserialize_with = "lenient")]
    model: Option<String>,
    /// OpenAI.
    #[serde(default, deserialize_with = "lenient")]
    max_tokens: Option<u64>,
    #[serde(default, deserialize_with = "lenient")]
    max_completion_tokens: Option<u64>,
    /// OpenAI responses API.
    #[serde(default, deserialize_with = "lenient")]
    max_output_tokens: Option<u64>,
    /// llama.cpp (-1 means no limit, which reads as none).
    #[serde(default, deserialize_with = "lenient")]
    n_predict: Option<u64>,
    /// Ollama.
    #[serde(default, deserialize_with = "lenient")]
    options: Option<OllamaOptions>,
}

#[derive(Debug, Default, Deserialize)]
struct OllamaOptions {
    #[serde(default, deserialize_with = "lenient")]
    num_predict: Option<u64>,
}

/// A field of an unexpected type reads as absent.
fn lenient<'de, D: Deserializer<'de>, T: serde::de::DeserializeOwned>(
    deserializer: D,
) -> Result<Option<T>, D::Error> {
    let value = serde_json::Value::deserialize(deserializer)?;
    Ok(serde_json::from_value(value).ok())
}

impl Asks {
    /// The output tokens the request asks for, where it says.
    fn tokens(&self) -> Option<u64> {
        self.max_tokens
            .or(self.max_completion_tokens)
            .or(self.max_output_tokens)
            .or(self.n_predict)
            .or(self.options.as_ref().and_then(|o| o.num_predict))
    }
}

impl QueuedRequest {
    pub(super) async fn phases(&mut self, request: Request<Incoming>) -> Phase<Ending> {
        let (head, body) = request.into_parts();
        let cgroup = OnceLock::new();
        // The body-read limit is the class's the head alone points to: rules on the model
        // cannot be read before the body.
        if let Ok(decision) = self.decide(&head, None, &cgroup) {
            self.timeouts = self.settings.timeouts(&decision);
        }
        let bytes = Box::pin(self.read_body(body)).await?;
        let asks = self.inspect(&bytes)?;
        let class = self
            .decide(&head, asks.model.as_deref(), &cgroup)
            .map_err(|err| Ending::new(Outcome::Invalid(Invalid::UnknownClass), err))?;
        self.timeouts = self.settings.timeouts(&class);
        self.class = Some(class.clone());
        self.model.clone_from(&asks.model);
        let ticket = self.admit(Job {
            class,
            tokens: asks.tokens(),
            model: asks.model,
        })?;
        self.wait(ticket).await?;
        // Boxed: a request waiting in the queue (there may be thousands) then holds only the
        // state of the phases it has reached, not that of forwarding and relaying.
        let (exchange, response) = Box::pin(self.forward(&head, bytes)).await?;
        Ok(Box::pin(self.relay(exchange, response)).await)
    }

    async fn read_body(&mut self, body: Incoming) -> Phase<Bytes> {
        let limit = self.settings.body_limit;
        let reading = Limited::new(body, usize::try_from(limit).unwrap_or(usize::MAX)).collect();
        match tokio::time::timeout(self.timeouts.body_read, reading).await {
            Ok(Ok(collected)) => Ok(collected.to_bytes()),
            Ok(Err(err)) if err.is::<LengthLimitError>() => Err(Ending::new(
                Outcome::Invalid(Invalid::BodyTooLarge),
                ProxyError::BodyTooLarge { limit },
            )),
            Ok(Err(err)) => Err(Ending::new(
                Outcome::Invalid(Invalid::BodyRead),
                ProxyError::BadRequest(format!("reading the request body: {err}")),
            )),
            Err(_) => Err(Ending::new(
                Outcome::TimedOut {
                    which: Timeout::BodyRead,
                    stage: Stage::Arrival,
                },
                ProxyError::BodyReadTimeout {
                    limit: self.timeouts.body_read,
                },
            )),
        }
    }

    /// Reads what guard needs from the body, and refuses a remote model where configured.
    fn inspect(&self, bytes: &[u8]) -> Phase<Asks> {
        let json: serde_json::Value = serde_json::from_slice(bytes).map_err(|err| {
            Ending::new(
                Outcome::Invalid(Invalid::MalformedJson),
                ProxyError::MalformedJson(err.to_string()),
            )
        })?;
        let asks = Asks::deserialize(&json).unwrap_or_default();
        if let Some(model) = &asks.model
            && self.settings.refuse_remote_models
            && self.proxy.remote_models.remote_models.is_remote(model)
        {
            return Err(Ending::new(
                Outcome::Refused {
                    model: model.clone(),
                },
                ProxyError::RemoteModel {
                    model: model.clone(),
                },
            ));
        }
        Ok(asks)
    }

    /// The class of this request; `cgroup` keeps the client's cgroup once looked up.
    fn decide(
        &self,
        head: &request::Parts,
        model: Option<&str>,
        cgroup: &OnceLock<Option<String>>,
    ) -> Result<String, ProxyError> {
        let (listen, peer) = (self.proxy.listen, self.connection.peer);
        let tracker = self.proxy.tracker.as_deref();
        let lookup = || {
            cgroup
                .get_or_init(|| client_cgroup(tracker, peer, listen))
                .clone()
        };
        let decision = self.settings.classifier.classify(&RequestFacts {
            path: head.uri.path(),
            headers: &head.headers,
            model,
            source: peer.ip(),
            cgroup: &lookup,
        })?;
        tracing::trace!(class = decision.class, by = decision.by, "classified");
        Ok(decision.class)
    }

    fn admit(&mut self, job: Job) -> Phase<Ticket> {
        let class = job.class.clone();
        match self.proxy.scheduler.enqueue(job) {
            Ok(ticket) => {
                self.predicted = ticket.predicted();
                // Counted at once, so that admitted = outcomes + in flight + queued at every
                // moment; every outcome is counted by `conclude`.
                self.proxy
                    .metrics
                    .admitted_total
                    .with_label_values(&[&class])
                    .inc();
                self.stage = Stage::Queued;
                Ok(ticket)
            }
            Err(rejection) => Err(Ending::new(
                Outcome::Rejected {
                    reason: rejection.reason,
                    stage: Stage::Arrival,
                },
                ProxyError::Rejected {
                    class,
                    reason: rejection.reason,
                    retry_after: rejection.retry_after,
                },
            )),
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
                self.waited = permit.waited();
                tracing::debug!(
                    class = self.class.as_deref().unwrap_or_default(),
                    predicted_ms = self.predicted.as_millis() as u64,
                    waited_ms = self.waited.as_millis() as u64,
                    "dispatched"
                );
                self.permit = Some(permit);
                self.dispatched = true;
                Ok(())
            }
            Err(rejection) => Err(Ending::new(
                Outcome::Rejected {
                    reason: rejection.reason,
                    stage: Stage::Queued,
                },
                ProxyError::Rejected {
                    class: self.class.clone().unwrap_or_default(),
                    reason: rejection.reason,
                    retry_after: rejection.retry_after,
                },
            )),
        }
    }

    /// Sends the request on an exchange of its own; returns it with the response head.
    async fn forward(
        &mut self,
        head: &request::Parts,
        body: Bytes,
    ) -> Phase<(Exchange, http::response::Parts)> {
        // A turn that came as its client left (a burst of departures hands permits along)
        // never reached the upstream: it leaves as reaped while queued.
        if self.connection.is_gone() {
            return Err(self.interrupted(super::Interrupt::ClientGone));
        }
        self.stage = Stage::Running;
        let request = self
            .proxy
            .upstream
            .for_exchange(head, body)
            .map_err(|err| Ending::new(Outcome::Failed(FailKind::UpstreamUnreachable), err))?;
        let watch = self.watch();
        let response_timeout = self.proxy.response_timeout;
        let starting = tokio::time::timeout(
            response_timeout,
            Exchange::start(&self.proxy.connector, request),
        );
        let started = tokio::select! {
            biased;
            interrupt = watch.interrupted() => return Err(self.interrupted(interrupt)),
            started = starting => started,
        };
        match started {
            Ok(Ok(started)) => Ok(started),
            Ok(Err(err)) => {
                let cause = crate::proxy::upstream::error_chain(&err);
                tracing::warn!(class = ?self.class, error = %cause, "upstream request failed");
                Err(Ending::new(
                    Outcome::Failed(FailKind::UpstreamUnreachable),
                    ProxyError::UpstreamUnreachable(cause),
                ))
            }
            Err(_) => Err(Ending::new(
                Outcome::Failed(FailKind::UpstreamTimeout),
                ProxyError::UpstreamTimeout(response_timeout),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn asks(json: &str) -> Asks {
        let value: serde_json::Value = serde_json::from_str(json).expect("json");
        Asks::deserialize(&value).unwrap_or_default()
    }

    #[test]
    fn the_tokens_asked_for_are_read_from_each_api() {
        assert_eq!(asks(r#"{"max_tokens": 8}"#).tokens(), Some(8));
        assert_eq!(asks(r#"{"n_predict": 300}"#).tokens(), Some(300));
        assert_eq!(asks(r#"{"options": {"num_predict": 5}}"#).tokens(), Some(5));
        assert_eq!(asks(r#"{"max_completion_tokens": 9}"#).tokens(), Some(9));
        assert_eq!(asks(r#"{"n_predict": -1}"#).tokens(), None);
        assert_eq!(asks(r#"{"prompt": "x"}"#).tokens(), None);
    }

    #[test]
    fn fields_of_another_type_read_as_absent() {
        let read = asks(r#"{"model": 5, "max_tokens": "many", "options": 3}"#);
        assert_eq!((read.tokens(), read.model), (None, None));
        assert_eq!(asks("[1, 2]").model, None);
        assert_eq!(asks(r#"{"model": "m"}"#).model.as_deref(), Some("m"));
    }
}
