//! Continuing a broken OpenAI stream on another endpoint: the request path's side of
//! [`Relay`](crate::http::relay::Relay).
//!
//! When a relayed stream's node breaks, the relay hands over the continuation request (see
//! [`crate::openai`]); [`Continuer`] sends it like a retry — to an endpoint not yet tried for this
//! request, through the pick, the queue and hedging, within the request's deadline, drawing on the
//! retry budget — and gives back the new node's stream as the next piece. Only a `200` event stream
//! can be spliced: any other answer ends the client's stream with an error, as before continuation.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Response, StatusCode};
use tokio::time::Instant;

use super::acquire::Tried;
use super::attempt::{Attempt, Sending};
use super::hedge::{Hedging, Race};
use super::request::Template;
use super::respond::Piece;
use super::retrying::{self, Attempts, Next, Retrying};
use super::{Proxy, ProxySettings, WorkerPath};
use crate::admission::Place;
use crate::http::relay::{Broke, Relay, Resume, Resuming};
use crate::http::{BoxError, ProxyBody};
use crate::metrics::Continuation;
use crate::openai::{Continuable, Resumption, Splicer};
use crate::retry::ReplayBody;
use crate::trace::AttemptKind;

/// Why a broken stream was not continued; the client's stream ends with this error.
#[derive(Debug, thiserror::Error)]
pub enum ContinuationError {
    #[error("the stream broke ({why}) and was not continued: {reason}")]
    Refused { why: String, reason: &'static str },
    #[error("the stream broke ({why}) and no endpoint continued it: {detail}")]
    Failed { why: String, detail: String },
}

/// What a request keeps, once its stream is committed, to continue that stream elsewhere.
pub(super) struct Continuer {
    proxy: Arc<Proxy>,
    worker: Arc<WorkerPath>,
    settings: Arc<ProxySettings>,
    /// The client's request, for a body of another length (and a continuation by token ids, for
    /// another path).
    template: Template,
    tried: Tried,
    request_id: HeaderValue,
    place: Place,
    deadline: Instant,
    /// The endpoint streaming now.
    streaming: Arc<str>,
    /// Continuations taken so far.
    taken: u32,
    /// The client's body (which the continuation request is made from) keeps its place in the replay
    /// budget while the stream runs: memory a stream holds is counted like a retry's.
    _kept: ReplayBody,
}

/// The request as it stood when its stream was committed.
pub(super) struct Committing<'a> {
    pub worker: &'a Arc<WorkerPath>,
    pub settings: &'a Arc<ProxySettings>,
    pub template: &'a Template,
    pub tried: Tried,
    pub request_id: &'a HeaderValue,
    pub place: &'a Place,
    pub deadline: Instant,
    pub body: &'a ReplayBody,
    /// The node was asked for token ids.
    pub ids_asked: bool,
}

/// Whether a committed answer is a stream the relay can splice: a `200` of Server-Sent Events, not
/// compressed.
fn spliceable(status: StatusCode, headers: &http::HeaderMap) -> bool {
    let event_stream = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim_start().starts_with("text/event-stream"));
    let encoded = headers
        .get(header::CONTENT_ENCODING)
        .is_some_and(|v| v.as_bytes() != b"identity");
    status == StatusCode::OK && event_stream && !encoded
}

impl Proxy {
    /// The body a continuable request is sent with: the client's, asking its node for the token ids
    /// that make a continuation exact, when the client did not ask already and the replay budget holds
    /// the longer body (else as it came, and a cut is continued by text). With whether the node is
    /// asked for ids, and whether the body was replaced.
    pub(super) fn ask_ids(
        &self,
        settings: &ProxySettings,
        continuable: Option<&Continuable>,
        body: ReplayBody,
    ) -> (ReplayBody, bool, bool) {
        let Some(continuable) = continuable else {
            return (body, false, false);
        };
        if !settings.continuation.ask_token_ids {
            return (body, continuable.ids_asked(), false);
        }
        match continuable.asking_ids().map(Bytes::from) {
            Some(asking) => match ReplayBody::made(asking, &self.replay_budget) {
                Some(asking) => (asking, true, true),
                None => (body, false, false),
            },
            None => (body, continuable.ids_asked(), false),
        }
    }

    /// Wraps a committed answer to a continuable request in a relay, when it is a stream that can be
    /// spliced; any other answer goes to the client as it is.
    pub(super) fn relay(
        self: &Arc<Self>,
        response: Response<ProxyBody>,
        request: Continuable,
        streaming: &str,
        at: Committing<'_>,
    ) -> Response<ProxyBody> {
        let (mut parts, body) = response.into_parts();
        if !spliceable(parts.status, &parts.headers) {
            return Response::from_parts(parts, body);
        }
        // The relay may rewrite a continuation's chunks: the length is not the node's any more.
        parts.headers.remove(header::CONTENT_LENGTH);
        // A continuation reads its own keys from its own body: the stream keeps none meanwhile.
        let mut tried = at.tried;
        tried.keys = None;
        let continuer = Continuer {
            proxy: Arc::clone(self),
            worker: Arc::clone(at.worker),
            settings: Arc::clone(at.settings),
            template: at.template.for_new_body(),
            tried,
            request_id: at.request_id.clone(),
            place: at.place.clone(),
            deadline: at.deadline,
            streaming: streaming.into(),
            taken: 0,
            _kept: at.body.clone(),
        };
        let mut splicer = Splicer::new(request);
        if at.ids_asked {
            splicer.asked_ids();
        }
        let relay = Relay::new(body, splicer, Box::new(continuer));
        Response::from_parts(parts, ProxyBody::relay(relay))
    }
}

impl Resume for Continuer {
    fn resume(self: Box<Self>, request: Resumption, broke: Broke) -> Resuming {
        Box::pin(self.continue_elsewhere(request, broke))
    }

    fn not_continued(&mut self, refused: Option<&'static str>, why: &str) {
        let request_id = self.request_id.to_str().unwrap_or_default();
        match refused {
            None => {
                self.count(Continuation::Completed);
                tracing::info!(
                    request_id,
                    endpoint = &*self.streaming,
                    why,
                    "stream broke after its last token; tongs ended it"
                );
            }
            Some(reason) => {
                self.count(Continuation::Unsupported);
                tracing::warn!(
                    request_id,
                    endpoint = &*self.streaming,
                    why,
                    reason,
                    "stream broke and cannot be continued safely; it ends as an error"
                );
            }
        }
    }
}

impl Continuer {
    fn count(&self, outcome: Continuation) {
        self.proxy.stats.continuations.count(outcome);
    }

    /// Refuses to continue (`outcome`), with the error the client's stream ends with.
    fn refuse(&self, outcome: Continuation, why: String, reason: &'static str) -> BoxError {
        self.count(outcome);
        tracing::warn!(
            request_id = self.request_id.to_str().unwrap_or_default(),
            endpoint = &*self.streaming,
            why,
            reason,
            "stream broke and is not continued; it ends as an error"
        );
        ContinuationError::Refused { why, reason }.into()
    }

    async fn continue_elsewhere(
        mut self: Box<Self>,
        resumption: Resumption,
        broke: Broke,
    ) -> Result<(ProxyBody, Box<dyn Resume>), BoxError> {
        let Resumption { body, path, exact } = resumption;
        let request = Bytes::from(body);
        let Broke {
            why,
            silent,
            planned,
        } = broke;
        if self.taken >= self.settings.continuation.max {
            let reason = "continuation.max_continuations reached";
            return Err(self.refuse(Continuation::Limit, why, reason));
        }
        if Instant::now() >= self.deadline {
            let reason = "the request's deadline passed";
            return Err(self.refuse(Continuation::Failed, why, reason));
        }
        if !self.worker.budget.withdraw() {
            return Err(self.refuse(Continuation::Budget, why, "the retry budget is spent"));
        }
        let Some(body) = ReplayBody::made(request, &self.proxy.replay_budget) else {
            let reason = "the replay budget is spent";
            return Err(self.refuse(Continuation::Budget, why, reason));
        };
        self.taken += 1;
        let sending = Sending {
            settings: Arc::clone(&self.settings),
            upstream: self.worker.upstream.clone(),
            deadline: self.deadline,
            body,
        };
        // The continuation's prompt is the client's and the answer so far: placed by its own blocks.
        self.tried.keys = super::request::affinity_keys(
            &self.settings,
            self.template.openai_api(),
            sending.body.bytes(),
            self.template.headers(),
        );
        // Without its conversation's home, though. The node that held this prompt is the one the
        // stream leaves, and the answer so far was never sent anywhere else, so the home (the next
        // node in rendezvous order) holds none of it, yet would be preferred until it is several times
        // as loaded as the best other: a node full to its batch queues the continuation, and the client
        // sees that queue as the stream's pause. So a continuation goes by load, and by what the
        // prefix index says this replica sent where (earlier turns of the conversation, wherever they
        // went). The conversation's next turn goes home again, or follows the continuation.
        if let Some(keys) = self.tried.keys.as_mut() {
            keys.prompt.conversation = None;
        }
        let started = Instant::now();
        let hedging = if planned {
            Hedging::AtOnce
        } else {
            Hedging::WhenLate
        };
        let template = match path {
            Some(path) => self.template.for_path(path),
            None => self.template.clone(),
        };
        let outcome =
            tokio::time::timeout_at(self.deadline, self.attempts(&sending, hedging, &template))
                .await;
        let request_id = self.request_id.to_str().unwrap_or_default().to_owned();
        match outcome {
            Ok(Ok((piece, endpoint))) => {
                self.count(Continuation::Continued);
                if !exact {
                    self.by_text();
                }
                tracing::info!(
                    request_id,
                    from = &*self.streaming,
                    to = &*endpoint,
                    why,
                    continuation = self.taken,
                    // The pause the client sees: its wait before the break was noticed (a stall's idle
                    // limit, say), then the new node's time to its first chunk.
                    gap_ms = (silent + started.elapsed()).as_millis() as u64,
                    resume_ms = started.elapsed().as_millis() as u64,
                    "stream broke; continued on another endpoint"
                );
                self.streaming = endpoint;
                Ok((piece, self))
            }
            Ok(Err(detail)) => Err(self.failed(why, detail)),
            Err(_) => Err(self.failed(why, "the request's deadline passed".to_owned())),
        }
    }

    /// The stream was continued from its text: its node gave no token ids.
    fn by_text(&self) {
        self.proxy
            .stats
            .continued_by_text
            .fetch_add(1, Ordering::Relaxed);
        let snapshot = self.proxy.registry.snapshot();
        if let Some(endpoint) = snapshot.iter().find(|e| e.url() == &*self.streaming) {
            endpoint.tally().count_continued_by_text();
        }
        tracing::info!(
            request_id = self.request_id.to_str().unwrap_or_default(),
            endpoint = &*self.streaming,
            "stream continued from its text, not by token ids: its node gave none"
        );
    }

    fn failed(&self, why: String, detail: String) -> BoxError {
        self.count(Continuation::Failed);
        tracing::warn!(
            request_id = self.request_id.to_str().unwrap_or_default(),
            endpoint = &*self.streaming,
            why,
            detail,
            "stream broke and no endpoint continued it; it ends as an error"
        );
        ContinuationError::Failed { why, detail }.into()
    }

    /// Attempts of the continuation, like a request's: the first spliceable stream is the next piece.
    async fn attempts(
        &mut self,
        sending: &Sending,
        hedging: Hedging,
        template: &Template,
    ) -> Result<(ProxyBody, Arc<str>), String> {
        let settings = Arc::clone(&self.settings);
        let mut attempts = Attempts::for_continuation(&settings.retry);
        let mut detail = "no endpoint left to try".to_owned();
        while attempts.next().is_some() {
            let acquired = self
                .proxy
                .acquire(
                    &settings,
                    &mut self.tried,
                    &self.place,
                    self.deadline,
                    &mut attempts,
                )
                .await;
            let Ok(slot) = acquired else {
                break;
            };
            let Some(attempt_body) = sending.body.for_attempt() else {
                break;
            };
            self.tried.push(slot.outstanding.endpoint().id());
            attempts.under_way();
            self.proxy.stats.attempts.fetch_add(1, Ordering::Relaxed);
            let mut slot = slot;
            let race = Race {
                request: template.build(&mut slot, attempt_body, AttemptKind::Continuation),
                slot,
                template,
                hedging,
            };
            let proxy = Arc::clone(&self.proxy);
            match proxy
                .race(sending, &self.worker, &mut self.tried, race)
                .await
            {
                Attempt::Committed(committed) => {
                    let status = committed.response.status();
                    if !spliceable(status, committed.response.headers()) {
                        return Err(format!(
                            "{} answered the continuation with {status}, not an event stream",
                            committed.outstanding.endpoint().url()
                        ));
                    }
                    let url: Arc<str> = committed.outstanding.endpoint().url().into();
                    let piece = Piece {
                        first: committed.first,
                        body: committed.response.into_body(),
                        outstanding: committed.outstanding,
                        first_byte: committed.first_byte,
                        // Continued again if it breaks, unless this was the last continuation allowed.
                        continuable: self.taken < self.settings.continuation.max,
                        probe: committed.probe,
                        // The prompt and the text so far: its prefill is the longer for it.
                        prompt_bytes: sending.body.kept_len(),
                    };
                    let mut piece =
                        self.proxy
                            .streamed(&settings, piece, self.deadline, &self.request_id);
                    if let Some(span) = committed.span {
                        // The continuation's span ends with its piece of the stream.
                        let _ = piece.on_end(Box::new(span));
                    }
                    return Ok((piece, url));
                }
                Attempt::Failed(failure) => {
                    detail = format!("{}: {}", failure.endpoint.url(), failure.error);
                    let retrying = Retrying {
                        policy: &settings.retry,
                        body: &sending.body,
                        deadline: self.deadline,
                        queue: self.proxy.queue(),
                        budget: &self.worker.budget,
                        stats: &self.proxy.stats.retries,
                    };
                    match attempts.failed(failure, &retrying, &mut self.tried) {
                        Next::Retry(backoff) => retrying::back_off(backoff, self.deadline).await,
                        Next::Stop => break,
                    }
                }
            }
        }
        Err(detail)
    }
}
