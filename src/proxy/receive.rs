//! A client's request taken in before any pool is chosen: read once, its body prepared for replay.
//!
//! [`Intake`] is what every pool shares: the settings requests are read with, the memory bodies kept
//! for replay share, and the tracker of upgraded connections. Routing reads what it needs from the
//! [`Received`] request (path, headers, the buffered body) and hands it to the chosen pool's
//! [`Proxy::forward`](super::Proxy::forward); a pool that can serve nobody hands it back untouched,
//! for the next.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use arc_swap::ArcSwap;
use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Response};
use hyper::body::Incoming;
use tokio::time::Instant;
use tokio_util::task::TaskTracker;

use super::request::ClientRequest;
use super::{Finish, ProxySettings, WorkerPath};
use crate::http::{ProxyBody, ProxyError, describe};
use crate::metrics::{Metrics, Outcome, ProxyStats};
use crate::retry::{BodyError, BodyRules, ReplayBody, ReplayBudget};
use crate::upstream::UpstreamClient;

/// What every pool shares on the request path.
pub struct Intake {
    /// The top-level settings: how a request is read before its pool is known.
    settings: ArcSwap<ProxySettings>,
    pub(super) replay_budget: Arc<ReplayBudget>,
    pub(super) upgrades: TaskTracker,
    /// Counts what happens before a pool is chosen (replay memory, requests refused unread).
    stats: Arc<ProxyStats>,
    metrics: Arc<Metrics>,
}

/// A request read and its body prepared, not yet sent anywhere.
pub struct Received {
    pub(super) request: ClientRequest,
    pub(super) body: ReplayBody,
    pub(super) started: Instant,
}

impl Intake {
    pub fn new(settings: ProxySettings, metrics: Arc<Metrics>) -> Intake {
        let stats = Arc::<ProxyStats>::default();
        Intake {
            replay_budget: ReplayBudget::new(settings.replay_budget_bytes, Arc::clone(&stats)),
            settings: ArcSwap::from_pointee(settings),
            upgrades: TaskTracker::new(),
            stats,
            metrics,
        }
    }

    pub fn settings(&self) -> Arc<ProxySettings> {
        self.settings.load_full()
    }

    /// Applies reloaded top-level settings.
    pub fn apply(&self, settings: ProxySettings) {
        self.replay_budget.set_max(settings.replay_budget_bytes);
        self.settings.store(Arc::new(settings));
    }

    /// What is counted before a pool is chosen.
    pub fn stats(&self) -> &ProxyStats {
        &self.stats
    }

    /// What is recorded for requests that reached no pool.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// Upgraded (WebSocket) connections of every pool, so graceful shutdown can wait for them.
    pub fn upgrades(&self) -> &TaskTracker {
        &self.upgrades
    }

    /// The request path of one of `workers` worker threads, sending through `upstream`.
    pub fn worker_path(&self, upstream: Arc<UpstreamClient>, workers: usize) -> WorkerPath {
        WorkerPath {
            upstream,
            budget: self.settings().retry.budget(workers),
            hedges: super::HedgeBudget::default(),
        }
    }

    /// Reads `request` and prepares its body: kept for replay up to the replay limit when retries are
    /// wanted or `keep_body` (routing reads it). A request tongs cannot take is answered here.
    pub async fn receive(
        &self,
        worker: &WorkerPath,
        request: Request<Incoming>,
        client: SocketAddr,
        keep_body: bool,
    ) -> Result<Received, Response<ProxyBody>> {
        let started = Instant::now();
        let settings = self.settings();
        worker.budget.deposit();
        worker.hedges.deposit(settings.hedge.max_extra_percent);
        let (request, body) = match ClientRequest::read(&settings, request, client, started) {
            Ok(read) => read,
            Err((error, request_id)) => return Err(self.invalid(error, &request_id, started)),
        };
        let replay_limit = if request.retries_wanted || keep_body {
            settings.retry.replay_limit()
        } else {
            0
        };
        let rules = BodyRules {
            replay_limit,
            max_body: settings.max_body_bytes,
            budget: &self.replay_budget,
            idle: settings.body_read_timeout,
        };
        let prepared =
            tokio::time::timeout_at(request.deadline, ReplayBody::prepare(body, &rules)).await;
        let error = match prepared {
            Ok(Ok(body)) => {
                return Ok(Received {
                    request,
                    body,
                    started,
                });
            }
            Ok(Err(BodyError::TooLarge)) => ProxyError::BodyTooLarge {
                limit: settings.max_body_bytes.unwrap_or_default(),
            },
            Ok(Err(BodyError::Broken(err))) => ProxyError::ClientBody {
                detail: describe(err.as_ref()),
            },
            Ok(Err(BodyError::Idle)) | Err(_) => ProxyError::ClientTooSlow,
        };
        Err(self.invalid(error, &request.request_id, started))
    }

    /// Answers a request before it is read (no valid API key, or its tenant at its cap), counted as
    /// `outcome`.
    pub fn answer_unread(
        &self,
        headers: &HeaderMap,
        error: ProxyError,
        outcome: Outcome,
    ) -> Response<ProxyBody> {
        let started = Instant::now();
        let request_id = crate::http::headers::request_id(headers);
        tracing::warn!(
            request_id = request_id.to_str().unwrap_or_default(),
            status = error.status().as_u16(),
            error = %error,
            "request refused before it was read"
        );
        self.stats.rejected.fetch_add(1, Ordering::Relaxed);
        finish(
            error.into_response(&request_id),
            &self.metrics,
            outcome,
            started,
        )
    }

    /// Answers a request that reached no pool, counted as `outcome`.
    pub fn answer_unrouted(
        &self,
        received: &Received,
        error: ProxyError,
        outcome: Outcome,
    ) -> Response<ProxyBody> {
        let request_id = &received.request.request_id;
        tracing::warn!(
            request_id = request_id.to_str().unwrap_or_default(),
            status = error.status().as_u16(),
            error = %error,
            "request not routed"
        );
        self.stats.rejected.fetch_add(1, Ordering::Relaxed);
        let response = error.into_response(request_id);
        finish(response, &self.metrics, outcome, received.started)
    }

    fn invalid(
        &self,
        error: ProxyError,
        request_id: &HeaderValue,
        started: Instant,
    ) -> Response<ProxyBody> {
        let response = super::respond::reject(error, request_id);
        finish(response, &self.metrics, Outcome::Invalid, started)
    }
}

/// Counts `response` in `metrics` when its body ends (a stream when it ends; anything else at once).
pub(super) fn finish(
    mut response: Response<ProxyBody>,
    metrics: &Arc<Metrics>,
    outcome: Outcome,
    started: Instant,
) -> Response<ProxyBody> {
    let status = response.status().as_u16();
    if let Err(finish) = response.body_mut().on_end(Box::new(Finish {
        metrics: Arc::clone(metrics),
        outcome,
        status,
        started,
    })) {
        drop(finish);
    }
    response
}

impl Received {
    pub fn method(&self) -> &Method {
        self.request.template.method()
    }

    pub fn path(&self) -> &str {
        self.request.template.path()
    }

    pub fn headers(&self) -> &HeaderMap {
        self.request.template.headers()
    }

    pub fn request_id(&self) -> &HeaderValue {
        &self.request.request_id
    }

    /// The whole body, when it was kept (small enough for replay, fully read).
    pub fn body(&self) -> Option<&Bytes> {
        self.body.bytes()
    }

    /// Replaces the kept body (a pool's rewritten `model`); false, and nothing changed, when the
    /// replay budget cannot hold it.
    pub fn replace_body(&mut self, bytes: Bytes, budget: &Intake) -> bool {
        let Some(body) = ReplayBody::made(bytes, &budget.replay_budget) else {
            return false;
        };
        self.body = body;
        self.request.template = self.request.template.for_new_body();
        true
    }

    /// Removes a header from what the endpoints are sent.
    pub fn remove_header(&mut self, name: &HeaderName) {
        self.request.template.headers_mut().remove(name);
    }

    /// Sets a header on what the endpoints are sent (a pool's own credentials).
    pub fn set_header(&mut self, name: HeaderName, value: HeaderValue) {
        self.request.template.headers_mut().insert(name, value);
    }
}
