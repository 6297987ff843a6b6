//! Which pool serves a request, and where it goes when that pool can serve nobody.
//!
//! Every request is taken in once ([`Intake`]): read, its body kept for replay when small enough.
//! When any pool matches on models, the body's OpenAI `model` is read from the kept bytes (the body
//! still reaches the node byte for byte, unless the pool rewrites the model). The first pool whose
//! every condition holds serves it; with none, the `default` pool (the top-level discovery), or a
//! 404 when there is none. A pool with no endpoint up, or whose queue refuses, hands the request on,
//! untouched, to its fallbacks in order; the last one tried answers whatever happens.
//!
//! Under `/v1/` tongs speaks OpenAI: its own errors take OpenAI's shape, and `GET /v1/models` lists
//! the models the pools name.
//!
//! With inbound API keys on (`auth.keys_file`), a request's key names its tenant before anything else
//! is read ([`auth`]); no key, or an unknown one, is a 401, and a tenant at its `max_in_flight` a 429.
//! The tenant goes with the request (its priority, its share of the queue) and is counted in flight
//! until the answer ends.

mod auth;
mod pool;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;
use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use hyper::body::Incoming;
use tokio_util::task::TaskTracker;

pub use self::auth::{Identified, KeysError, Tenants};
pub use self::pool::{Pool, PoolError, PoolRules};
use crate::admission::{InFlight, Refusal};
use crate::config::Config;
use crate::http::{ProxyBody, ProxyError, openai_shape};
use crate::metrics::{Metrics, Outcome};
use crate::openai::{ModelField, read_model, with_model};
use crate::proxy::{Intake, ProxySettings, Received, WorkerPath};
use crate::trace::{RequestSpan, Traces};
use crate::upstream::UpstreamClient;

/// A hand-over from one pool to another: (from, to).
type Hop = (Arc<str>, Arc<str>);

/// Starts a pool's background tasks (heartbeats, pod watch); the app installs it once it runs.
pub type Starter = Box<dyn Fn(&Arc<Pool>) + Send + Sync>;

/// The pools and the way to them.
pub struct Router {
    intake: Intake,
    /// Listed pools in order, then `default`.
    pools: ArcSwap<Vec<Arc<Pool>>>,
    /// Some pool matches on models: bodies are kept and read.
    reads_models: std::sync::atomic::AtomicBool,
    /// Requests a pool handed on, by (from, to). Every worker thread counts here on the request path,
    /// and while a pool is down every one of its requests does: a map sharded by key, whose counts are
    /// atomics, so workers counting different hops never wait on each other and the same hop costs one
    /// shared read lock and an atomic add. Pairs appear as they are first used; a scrape copies them.
    fallbacks: dashmap::DashMap<Hop, std::sync::atomic::AtomicU64>,
    starter: Mutex<Option<Starter>>,
    /// tongs replicas sharing the fleets (see [`Router::set_replicas`]).
    replicas: std::sync::atomic::AtomicU32,
    /// Inbound API keys and the tenants they name.
    tenants: Tenants,
    /// The OTLP exporter, if tracing is on.
    traces: Traces,
}

impl Router {
    /// A router with no pool yet; [`Router::apply`] gives it its configuration.
    pub fn new(metrics: Arc<Metrics>) -> Router {
        Router {
            intake: Intake::new(ProxySettings::from_config(&Config::default()), metrics),
            pools: ArcSwap::default(),
            reads_models: Default::default(),
            fallbacks: dashmap::DashMap::new(),
            starter: Mutex::new(None),
            replicas: std::sync::atomic::AtomicU32::new(1),
            tenants: Tenants::default(),
            traces: Traces::default(),
        }
    }

    /// Applies `config`: top-level settings, then each pool (created, updated or removed by name; a
    /// pool that stays keeps its endpoints' state). Secrets that cannot be read keep the value in
    /// force and are returned.
    pub fn apply(&self, config: &Config) -> Vec<PoolError> {
        self.intake.apply(ProxySettings::from_config(config));
        let before = self.pools.load_full();
        let mut errors = Vec::new();
        if let Err(error) = self.tenants.apply(&config.auth) {
            errors.push(PoolError::Keys(error));
        }
        // The first configuration only: a change of `tracing` needs a restart.
        if let Err(error) = self.traces.configure(&config.tracing.otlp) {
            errors.push(PoolError::Traces(error));
        }
        let mut pools = Vec::new();
        for spec in config.pool_specs() {
            let pool = before
                .iter()
                .find(|p| **p.name() == *spec.name)
                .cloned()
                .unwrap_or_else(|| {
                    let pool = Pool::new(&spec.name, &self.intake);
                    pool.registry().set_replicas(self.replicas());
                    pool
                });
            errors.extend(pool.apply(&spec));
            pools.push(pool);
        }
        let reads_models = pools
            .iter()
            .any(|pool| !pool.rules().matches.models.is_empty());
        self.reads_models
            .store(reads_models, std::sync::atomic::Ordering::Relaxed);
        self.pools.store(Arc::new(pools.clone()));
        // After the store, so a count set meanwhile reaches the new pools one way or the other.
        let replicas = self.replicas();
        for pool in &pools {
            pool.registry().set_replicas(replicas);
        }
        for gone in before
            .iter()
            .filter(|old| !pools.iter().any(|p| Arc::ptr_eq(p, old)))
        {
            tracing::info!(pool = %gone.name(), "pool removed");
            gone.stop();
        }
        if let Some(start) = &*self.starter.lock().unwrap_or_else(|p| p.into_inner()) {
            for pool in pools.iter().filter(|p| !p.has_tasks()) {
                start(pool);
            }
        }
        errors
    }

    /// How many tongs replicas share every pool's fleet: each pool's fixed limits are divided by it
    /// (see [`crate::limit::LimitSettings::share`]).
    pub fn set_replicas(&self, replicas: u32) {
        self.replicas
            .store(replicas.max(1), std::sync::atomic::Ordering::Relaxed);
        for pool in self.pools.load().iter() {
            pool.registry().set_replicas(replicas);
        }
    }

    /// The replica count fixed limits are divided by.
    pub fn replicas(&self) -> u32 {
        self.replicas.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Starts every pool's background tasks now, and those of pools added later by `start`.
    pub fn start_pools(&self, start: Starter) {
        for pool in self.pools.load().iter() {
            start(pool);
        }
        *self.starter.lock().unwrap_or_else(|p| p.into_inner()) = Some(start);
    }

    /// Stops every pool's background tasks.
    pub fn stop_pools(&self) {
        self.starter
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        for pool in self.pools.load().iter() {
            pool.stop();
        }
    }

    /// The pools now, listed ones first, `default` last.
    pub fn pools(&self) -> Arc<Vec<Arc<Pool>>> {
        self.pools.load_full()
    }

    /// The pool named `name`.
    pub fn pool(&self, name: &str) -> Option<Arc<Pool>> {
        self.pools
            .load()
            .iter()
            .find(|p| &**p.name() == name)
            .cloned()
    }

    pub fn intake(&self) -> &Intake {
        &self.intake
    }

    pub fn upgrades(&self) -> &TaskTracker {
        self.intake.upgrades()
    }

    pub fn worker_path(&self, upstream: Arc<UpstreamClient>, workers: usize) -> WorkerPath {
        self.intake.worker_path(upstream, workers)
    }

    /// Requests handed on, by (from, to) pool: every fallback configured now (0 until used), and any
    /// used before.
    pub fn fallbacks(&self) -> Vec<(Arc<str>, Arc<str>, u64)> {
        let mut counts: BTreeMap<Hop, u64> = self
            .fallbacks
            .iter()
            .map(|entry| {
                let count = entry.value().load(std::sync::atomic::Ordering::Relaxed);
                (entry.key().clone(), count)
            })
            .collect();
        for pool in self.pools.load().iter() {
            for to in &pool.rules().fallback {
                counts
                    .entry((Arc::clone(pool.name()), Arc::from(to.as_str())))
                    .or_default();
            }
        }
        counts
            .into_iter()
            .map(|((from, to), n)| (from, to, n))
            .collect()
    }

    /// Exports the spans not sent yet (when tongs stops).
    pub async fn flush_traces(&self) {
        self.traces.shutdown().await;
    }

    /// Handles one client request; always produces a response.
    pub async fn handle(
        self: &Arc<Self>,
        worker: &Arc<WorkerPath>,
        request: Request<Incoming>,
        client: SocketAddr,
    ) -> Response<ProxyBody> {
        let openai = request.uri().path().starts_with("/v1/");
        // `None`, at the cost of one branch, unless tracing is on.
        let mut span =
            self.traces
                .request(request.method(), request.uri().path(), request.headers());
        let response = match self.admit(request) {
            Ok((mut request, None)) => {
                if let Some(span) = &span {
                    request.extensions_mut().insert(span.trace());
                }
                self.route(worker, request, client, &mut span).await
            }
            Ok((mut request, Some(mut in_flight))) => {
                if let Some(span) = &mut span {
                    span.set_tenant(in_flight.tenant().name());
                    request.extensions_mut().insert(span.trace());
                }
                let log_span = tracing::info_span!("request", tenant = %in_flight.tenant().name());
                let mut response = tracing::Instrument::instrument(
                    self.route(worker, request, client, &mut span),
                    log_span,
                )
                .await;
                in_flight.answered(response.status().as_u16());
                // Counted in flight until the answer ends: a stream until its last byte.
                if let Err(done) = response.body_mut().on_end(Box::new(in_flight)) {
                    drop(done);
                }
                response
            }
            Err(refused) => refused,
        };
        let mut response = if openai {
            openai_shape(response)
        } else {
            response
        };
        if let Some(span) = span {
            let status = response.status().as_u16();
            let request_id = response.headers().get(&crate::http::headers::X_REQUEST_ID);
            // Ended with the answer's body (a stream at its last byte), after its other guards.
            let end = span.end(status, request_id);
            if let Err(end) = response.body_mut().on_end(end) {
                drop(end);
            }
        }
        response
    }

    /// Lets the request in as its key's tenant (its key taken off), or answers it: 401 without a
    /// valid key, 429 when the tenant is at its `max_in_flight`.
    #[allow(clippy::result_large_err)] // The refusal is the response itself, built once.
    fn admit(
        &self,
        mut request: Request<Incoming>,
    ) -> Result<(Request<Incoming>, Option<InFlight>), Response<ProxyBody>> {
        let detail = match self.tenants.identify(request.headers()) {
            Identified::Open => return Ok((request, None)),
            Identified::Tenant(tenant) => {
                request.headers_mut().remove(header::AUTHORIZATION);
                return match tenant.enter() {
                    Ok(in_flight) => {
                        request.extensions_mut().insert(tenant);
                        Ok((request, Some(in_flight)))
                    }
                    Err(retry_after) => {
                        tracing::info!(tenant = %tenant.name(), "tenant at its max_in_flight");
                        let error = ProxyError::Refused {
                            reason: Refusal::TenantInFlight,
                            detail: format!(
                                "this API key's tenant has as many requests in progress as it may \
                                 (max_in_flight {})",
                                tenant.settings().max_in_flight
                            ),
                            retry_after,
                        };
                        Err(self
                            .intake
                            .answer_unread(request.headers(), error, Outcome::Refused))
                    }
                };
            }
            Identified::Missing => "an API key is required: Authorization: Bearer <key>",
            Identified::Unknown => "the API key is not valid",
        };
        let error = ProxyError::Unauthorized { detail };
        Err(self
            .intake
            .answer_unread(request.headers(), error, Outcome::Invalid))
    }

    /// The tenants and their keys.
    pub fn tenants(&self) -> &Tenants {
        &self.tenants
    }

    async fn route(
        self: &Arc<Self>,
        worker: &Arc<WorkerPath>,
        request: Request<Incoming>,
        client: SocketAddr,
        span: &mut Option<RequestSpan>,
    ) -> Response<ProxyBody> {
        let pools = self.pools.load_full();
        if request.method() == Method::GET
            && request.uri().path() == "/v1/models"
            && let Some(list) = models_list(&pools)
        {
            return list;
        }
        let reads_models = self.reads_models.load(std::sync::atomic::Ordering::Relaxed);
        let mut received = match self
            .intake
            .receive(worker, request, client, reads_models)
            .await
        {
            Ok(received) => received,
            Err(response) => return response,
        };
        let field = match received
            .body()
            .filter(|_| reads_models)
            .map(|b| read_model(b))
        {
            None | Some(Ok(None)) => None,
            Some(Ok(Some(field))) => Some(field),
            // Parsers disagree on which of two counts: routed on one, a node could read the other.
            Some(Err(duplicate)) => {
                let error = ProxyError::ClientBody {
                    detail: duplicate.to_string(),
                };
                return self
                    .intake
                    .answer_unrouted(&received, error, Outcome::Invalid);
            }
        };
        let model = field.as_ref().map(|f| f.name.as_str());
        let Some(first) = pools
            .iter()
            .position(|p| p.matches(received.path(), received.headers(), model))
        else {
            let error = match model {
                Some(model) => ProxyError::ModelNotFound {
                    model: model.to_owned(),
                },
                None => ProxyError::NoRoute,
            };
            return self
                .intake
                .answer_unrouted(&received, error, Outcome::Invalid);
        };
        let chain = chain(&pools, first);
        let original = Original {
            body: received.body().cloned(),
            authorization: received.headers().get(header::AUTHORIZATION).cloned(),
        };
        let mut changed = false;
        for (i, pool) in chain.iter().enumerate() {
            if changed {
                original.restore(&mut received, &self.intake);
            }
            let last = i + 1 == chain.len();
            changed = match self.prepare(&mut received, pool, field.as_ref(), &original) {
                Ok(changed) => changed,
                // The rewritten body does not fit in the replay memory now: this pool cannot take it.
                Err(()) if !last => continue,
                Err(()) => {
                    let error = ProxyError::Refused {
                        reason: Refusal::QueueFull,
                        detail: "the memory tongs keeps request bodies in is spent \
                                 (retry.replay_budget_bytes); try again shortly"
                            .into(),
                        retry_after: 1,
                    };
                    return self
                        .intake
                        .answer_unrouted(&received, error, Outcome::Refused);
                }
            };
            match pool.proxy().forward(worker, received, !last).await {
                Ok(response) => {
                    if let Some(span) = span {
                        span.set_pool(pool.name());
                    }
                    return response;
                }
                Err(back) => {
                    received = back;
                    if let Some(next) = chain.get(i + 1) {
                        self.count_fallback(pool.name(), next.name());
                        tracing::info!(
                            request_id = received.request_id().to_str().unwrap_or_default(),
                            from = %pool.name(),
                            to = %next.name(),
                            "pool can serve nobody; falling back"
                        );
                    }
                }
            }
        }
        // Unreachable in practice: the last pool always answers. Say so rather than panic.
        self.intake
            .answer_unrouted(&received, ProxyError::NoRoute, Outcome::Invalid)
    }

    /// Gives `received` what `pool` sends its endpoints: its model name and its own key. Returns
    /// whether anything changed, or an error when the rewritten body cannot be kept.
    fn prepare(
        &self,
        received: &mut Received,
        pool: &Pool,
        field: Option<&ModelField>,
        original: &Original,
    ) -> Result<bool, ()> {
        let rules = pool.rules();
        let mut changed = false;
        if let (Some(model), Some(field), Some(body)) =
            (&rules.rewrite_model, field, original.body.as_ref())
            && *model != field.name
        {
            if !received.replace_body(with_model(body, field, model), &self.intake) {
                tracing::warn!(
                    request_id = received.request_id().to_str().unwrap_or_default(),
                    pool = %pool.name(),
                    "the replay budget cannot hold the body with the pool's model; skipping the pool"
                );
                return Err(());
            }
            changed = true;
        }
        if let Some(authorization) = &rules.authorization {
            received.set_header(header::AUTHORIZATION, authorization.clone());
            changed = true;
        }
        Ok(changed)
    }

    fn count_fallback(&self, from: &Arc<str>, to: &Arc<str>) {
        let hop = (Arc::clone(from), Arc::clone(to));
        let add = |count: &std::sync::atomic::AtomicU64| {
            count.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        };
        match self.fallbacks.get(&hop) {
            Some(count) => add(&count),
            None => add(&self.fallbacks.entry(hop).or_default()),
        }
    }
}

/// What a pool may change of a request, as the client sent it, for the next pool.
struct Original {
    body: Option<Bytes>,
    authorization: Option<http::HeaderValue>,
}

impl Original {
    fn restore(&self, received: &mut Received, intake: &Intake) {
        if let Some(body) = &self.body
            && received.body() != Some(body)
        {
            received.replace_body(body.clone(), intake);
        }
        match &self.authorization {
            Some(value) => received.set_header(header::AUTHORIZATION, value.clone()),
            None => received.remove_header(&header::AUTHORIZATION),
        }
    }
}

/// `pools[first]`, then its fallbacks in order, each followed by its own (depth first, each pool
/// once).
fn chain(pools: &[Arc<Pool>], first: usize) -> Vec<Arc<Pool>> {
    let mut chain: Vec<Arc<Pool>> = Vec::new();
    let mut stack = vec![Arc::clone(&pools[first])];
    while let Some(pool) = stack.pop() {
        if chain.iter().any(|p| Arc::ptr_eq(p, &pool)) {
            continue;
        }
        let rules = pool.rules();
        for name in rules.fallback.iter().rev() {
            if let Some(next) = pools.iter().find(|p| **p.name() == **name) {
                stack.push(Arc::clone(next));
            }
        }
        chain.push(pool);
    }
    chain
}

/// `GET /v1/models` in OpenAI's list shape: the exact model names the pools match, then what the
/// nodes of pools matched by a pattern say they serve (their own `/v1/models`, read alongside
/// heartbeats) where a request naming it would be routed to that node's pool (a pool matched by
/// `beta-*` lists its nodes' `beta-1`); each model once, owned by its pool. None when no pool names a model (the request then
/// goes to an endpoint, which knows its own).
fn models_list(pools: &[Arc<Pool>]) -> Option<Response<ProxyBody>> {
    if pools
        .iter()
        .all(|pool| pool.rules().matches.models.is_empty())
    {
        return None;
    }
    let mut data: Vec<(String, Arc<str>)> = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for pool in pools {
        let rules = pool.rules();
        for model in rules.matches.models.iter().filter(|m| !m.ends_with('*')) {
            if seen.insert(model.clone()) {
                data.push((model.clone(), Arc::clone(pool.name())));
            }
        }
    }
    let no_headers = http::HeaderMap::new();
    for pool in pools {
        for endpoint in pool.registry().snapshot().iter() {
            for id in endpoint.served_models().get().iter() {
                if seen.contains(id) {
                    continue;
                }
                let routed = pools
                    .iter()
                    .find(|p| p.matches("/v1/chat/completions", &no_headers, Some(id)));
                if routed.is_some_and(|routed| Arc::ptr_eq(routed, pool)) {
                    seen.insert(id.clone());
                    data.push((id.clone(), Arc::clone(pool.name())));
                }
            }
        }
    }
    let data: Vec<_> = data
        .into_iter()
        .map(|(id, pool)| {
            serde_json::json!({"id": id, "object": "model", "created": 0, "owned_by": &*pool})
        })
        .collect();
    let body = serde_json::json!({"object": "list", "data": data}).to_string();
    let mut response = Response::new(ProxyBody::full(body));
    *response.status_mut() = StatusCode::OK;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    Some(response)
}
