//! Every metric tongs exports, defined once: name, Prometheus type and help text. The table in
//! `docs/metrics.md` is checked against [`CATALOG`].

/// One metric: name, Prometheus type, help text.
pub struct MetricSpec {
    pub name: &'static str,
    pub kind: &'static str,
    pub help: &'static str,
}

const fn spec(name: &'static str, kind: &'static str, help: &'static str) -> MetricSpec {
    MetricSpec { name, kind, help }
}

pub const REQUESTS: MetricSpec = spec(
    "tongs_requests_total",
    "counter",
    "Requests answered, by outcome (proxied, failed, refused, invalid) and status class.",
);
pub const REQUEST_DURATION: MetricSpec = spec(
    "tongs_request_duration_seconds",
    "histogram",
    "Time from a request's arrival to the end of its answer (streams included), by outcome.",
);
pub const FIRST_BYTE: MetricSpec = spec(
    "tongs_time_to_first_byte_seconds",
    "histogram",
    "Time from a request's arrival to the commit of an endpoint's answer (headers and first bytes).",
);
pub const QUEUE_WAIT: MetricSpec = spec(
    "tongs_queue_wait_seconds",
    "histogram",
    "Time requests that got an endpoint spent in the queue.",
);
pub const QUEUE_DEPTH: MetricSpec = spec(
    "tongs_queue_depth",
    "gauge",
    "Requests waiting in the queue for an endpoint.",
);
pub const DEMAND: MetricSpec = spec(
    "tongs_demand",
    "gauge",
    "Requests queued plus outstanding on endpoints: the signal to scale GPU nodes on.",
);
pub const CAPACITY: MetricSpec = spec(
    "tongs_capacity",
    "gauge",
    "Sum of the endpoints' concurrency limits (absent while any endpoint is unlimited).",
);
pub const REJECTIONS: MetricSpec = spec(
    "tongs_rejections_total",
    "counter",
    "Requests tongs refused itself, by reason.",
);
pub const RETRIES: MetricSpec = spec(
    "tongs_retries_total",
    "counter",
    "Retries on another endpoint, by the failure that caused them.",
);
pub const RETRY_BUDGET_EXHAUSTED: MetricSpec = spec(
    "tongs_retry_budget_exhausted_total",
    "counter",
    "Retries the retry budget refused.",
);
pub const ATTEMPTS: MetricSpec = spec(
    "tongs_attempts_total",
    "counter",
    "Attempts sent to endpoints (requests plus retries).",
);
pub const ENDPOINTS: MetricSpec = spec(
    "tongs_endpoints",
    "gauge",
    "Endpoints in the set, by discovery source and state.",
);
pub const ENDPOINT_STATE: MetricSpec = spec(
    "tongs_endpoint_state",
    "gauge",
    "1 for the state each endpoint is in, 0 for the others.",
);
pub const ENDPOINT_OUTSTANDING: MetricSpec = spec(
    "tongs_endpoint_outstanding",
    "gauge",
    "Requests on the endpoint whose answer has not ended.",
);
pub const ENDPOINT_LIMIT: MetricSpec = spec(
    "tongs_endpoint_limit",
    "gauge",
    "The endpoint's concurrency limit (absent when unlimited).",
);
pub const ENDPOINT_REQUESTS: MetricSpec = spec(
    "tongs_endpoint_requests_total",
    "counter",
    "Attempts sent to the endpoint.",
);
pub const ENDPOINT_FAILURES: MetricSpec = spec(
    "tongs_endpoint_failures_total",
    "counter",
    "Attempts that failed at the endpoint (connect, reset, timeout, gateway error).",
);
pub const HEDGES: MetricSpec = spec(
    "tongs_hedges_total",
    "counter",
    "Hedged attempts sent: a second attempt on another endpoint for an attempt with no answer in time.",
);
pub const HEDGES_WON: MetricSpec = spec(
    "tongs_hedges_won_total",
    "counter",
    "Hedged attempts that answered first (the attempt they hedged was cancelled).",
);
pub const STREAMS_CUT: MetricSpec = spec(
    "tongs_streams_cut_total",
    "counter",
    "Committed streams tongs cut because they and their node went silent, because they paused past stream.pause_max, or because their endpoint was declared gone (a streamed OpenAI completion is then continued elsewhere where it can be: tongs_continuations_total).",
);
pub const STREAMS_MOVED: MetricSpec = spec(
    "tongs_streams_moved_total",
    "counter",
    "Streamed OpenAI completions moved off a node that said it is going (x-tongs-drain), before it went, and continued elsewhere (not counted in tongs_streams_cut_total).",
);
pub const STREAM_PAUSES: MetricSpec = spec(
    "tongs_stream_pauses_total",
    "counter",
    "Silences of committed streams past their idle limit while their node went on sending tokens on its other streams: a pause (a preemption, a slow prefill under load), not a stall, so left alone and not counted against the node (cut only past stream.pause_max).",
);
pub const CONTINUED_BY_TEXT: MetricSpec = spec(
    "tongs_continuations_by_text_total",
    "counter",
    "Streamed OpenAI completions continued from the text so far, not by token ids (their node gave none: an engine other than vLLM, or continuation.token_ids never): the rest of the answer may differ from the uninterrupted one. Counted in tongs_continuations_total{outcome=\"continued\"} too.",
);
pub const POOL_FALLBACKS: MetricSpec = spec(
    "tongs_pool_fallbacks_total",
    "counter",
    "Requests a pool could serve nobody for (no endpoint up, or its queue refused) and handed to its fallback pool, by from and to pool.",
);
pub const CONTINUATIONS: MetricSpec = spec(
    "tongs_continuations_total",
    "counter",
    "Streamed OpenAI completions whose node broke after they started, by what became of them: continued on another endpoint, completed by tongs (broken after the last token), failed, limit (max_continuations), budget (retry budget spent), unsupported (not safe to continue).",
);
pub const REPLAY_BYTES: MetricSpec = spec(
    "tongs_replay_bytes",
    "gauge",
    "Bytes of request bodies kept in memory for replay now (at most retry.replay_budget_bytes).",
);
pub const REPLAY_OVER_BUDGET: MetricSpec = spec(
    "tongs_replay_over_budget_total",
    "counter",
    "Request bodies streamed without replay because the replay budget was spent.",
);
pub const ENDPOINT_STALLS: MetricSpec = spec(
    "tongs_endpoint_stalls_total",
    "counter",
    "Attempts that stalled at the endpoint while its heartbeats passed (lost to a hedge, or waited far past its expected latency).",
);
pub const ENDPOINT_EJECTIONS: MetricSpec = spec(
    "tongs_endpoint_ejections_total",
    "counter",
    "Times the endpoint's circuit breaker opened.",
);
pub const ENDPOINT_COOLDOWNS: MetricSpec = spec(
    "tongs_endpoint_cooldowns_total",
    "counter",
    "Times the endpoint asked for back-off (429, or 503 with Retry-After).",
);
pub const ENDPOINT_LATENCY: MetricSpec = spec(
    "tongs_endpoint_latency_seconds",
    "gauge",
    "The balancer's latency estimate for the endpoint (time to first byte, peak EWMA).",
);
pub const ENDPOINT_HEARTBEAT: MetricSpec = spec(
    "tongs_endpoint_heartbeat_seconds",
    "gauge",
    "Duration of the endpoint's last heartbeat.",
);
pub const ENDPOINT_HEARTBEAT_OK: MetricSpec = spec(
    "tongs_endpoint_heartbeat_ok",
    "gauge",
    "1 if the endpoint's last heartbeat passed, 0 if it failed.",
);
pub const ENDPOINT_ENGINE_WAITING: MetricSpec = spec(
    "tongs_endpoint_engine_waiting",
    "gauge",
    "Requests waiting in the endpoint's own queue, by its own metrics and tongs' estimate since (absent without a reading).",
);
pub const ENDPOINT_ENGINE_IN_NODE: MetricSpec = spec(
    "tongs_endpoint_engine_requests",
    "gauge",
    "Requests in the endpoint, running or waiting, by its own metrics and tongs' estimate since (absent without a reading).",
);
pub const ENDPOINT_ENGINE_KV_CACHE: MetricSpec = spec(
    "tongs_endpoint_engine_kv_cache_usage",
    "gauge",
    "Share of the endpoint's KV cache in use by its own metrics, 0 to 1 (absent when its engine does not say).",
);
pub const ENDPOINT_SIGNALS_AGE: MetricSpec = spec(
    "tongs_endpoint_signals_age_seconds",
    "gauge",
    "Age of the last reading of the endpoint's own metrics; the pick uses it while at most signals.max_age.",
);
pub const CONFIG_RELOADS: MetricSpec = spec(
    "tongs_config_reloads_total",
    "counter",
    "Configuration reloads, by result (applied, invalid).",
);
pub const REPLICAS: MetricSpec = spec(
    "tongs_replicas",
    "gauge",
    "tongs replicas this one shares the fleets' fixed limits with, itself included (the ready endpoints of replicas.service; 1 when it is unset).",
);
pub const TENANT_REQUESTS: MetricSpec = spec(
    "tongs_tenant_requests_total",
    "counter",
    "Answers to a tenant's requests (its API key named it), by status class, counted when the answer ends.",
);
pub const TENANT_IN_FLIGHT: MetricSpec = spec(
    "tongs_tenant_in_flight",
    "gauge",
    "A tenant's requests in tongs now, waiting or at an endpoint (capped by its max_in_flight).",
);
pub const TENANT_QUEUED: MetricSpec = spec(
    "tongs_tenant_queued",
    "gauge",
    "A tenant's requests waiting in queues now (capped by its max_queued).",
);
pub const TENANT_REFUSALS: MetricSpec = spec(
    "tongs_tenant_refusals_total",
    "counter",
    "A tenant's requests refused with 429 for its own caps, by reason (tenant-queue-full, tenant-in-flight).",
);
pub const AUTH_FAILURES: MetricSpec = spec(
    "tongs_auth_failures_total",
    "counter",
    "Requests refused with 401 while inbound API keys are on, by reason: missing (no bearer key), unknown (no tenant's key).",
);
pub const BUILD_INFO: MetricSpec = spec(
    "tongs_build_info",
    "gauge",
    "Always 1; the version in a label.",
);

pub const DISCOVERY_SYNCED: MetricSpec = spec(
    "tongs_discovery_synced",
    "gauge",
    "1 once Kubernetes discovery applied its first complete list of pods (always 1 when it is off).",
);
pub const DISCOVERY_PODS: MetricSpec = spec(
    "tongs_discovery_pods",
    "gauge",
    "Pods watched, by state (serving, ineligible, no-address).",
);
pub const DISCOVERY_REJECTIONS: MetricSpec = spec(
    "tongs_discovery_rejections_total",
    "counter",
    "Pod annotations (or podIPs) refused, by reason; each pod's problem counted once.",
);
pub const DISCOVERY_WATCH_ERRORS: MetricSpec = spec(
    "tongs_discovery_watch_errors_total",
    "counter",
    "Errors of the pod watch (each followed by a retry with backoff).",
);
pub const DISCOVERY_LISTS: MetricSpec = spec(
    "tongs_discovery_lists_total",
    "counter",
    "Complete pod lists applied: the first sync, then one per re-list after a lost watch.",
);
pub const SALAD_LOOKUPS: MetricSpec = spec(
    "tongs_salad_api_lookups_total",
    "counter",
    "SaladCloud API container group lookups, by result (found, not-yet, error).",
);
pub const REGISTRATIONS: MetricSpec = spec(
    "tongs_node_registrations_total",
    "counter",
    "Node calls on the admin port (self-registrations, drain notices), by result.",
);
pub const RUNTIME_TASKS: MetricSpec = spec(
    "tongs_runtime_tasks",
    "gauge",
    "Tokio tasks alive, summed over tongs' runtimes (the main one and each worker's); one that only grows is a task leak.",
);

/// Every metric tongs exports.
pub const CATALOG: [&MetricSpec; 54] = [
    &REQUESTS,
    &REQUEST_DURATION,
    &FIRST_BYTE,
    &QUEUE_WAIT,
    &QUEUE_DEPTH,
    &DEMAND,
    &CAPACITY,
    &REJECTIONS,
    &RETRIES,
    &RETRY_BUDGET_EXHAUSTED,
    &ATTEMPTS,
    &HEDGES,
    &HEDGES_WON,
    &STREAMS_CUT,
    &STREAMS_MOVED,
    &STREAM_PAUSES,
    &CONTINUED_BY_TEXT,
    &CONTINUATIONS,
    &POOL_FALLBACKS,
    &REPLAY_BYTES,
    &REPLAY_OVER_BUDGET,
    &ENDPOINTS,
    &ENDPOINT_STATE,
    &ENDPOINT_OUTSTANDING,
    &ENDPOINT_LIMIT,
    &ENDPOINT_REQUESTS,
    &ENDPOINT_FAILURES,
    &ENDPOINT_EJECTIONS,
    &ENDPOINT_STALLS,
    &ENDPOINT_COOLDOWNS,
    &ENDPOINT_LATENCY,
    &ENDPOINT_HEARTBEAT,
    &ENDPOINT_HEARTBEAT_OK,
    &ENDPOINT_ENGINE_WAITING,
    &ENDPOINT_ENGINE_IN_NODE,
    &ENDPOINT_ENGINE_KV_CACHE,
    &ENDPOINT_SIGNALS_AGE,
    &CONFIG_RELOADS,
    &BUILD_INFO,
    &REPLICAS,
    &TENANT_REQUESTS,
    &TENANT_IN_FLIGHT,
    &TENANT_QUEUED,
    &TENANT_REFUSALS,
    &AUTH_FAILURES,
    &UPTIME,
    &DISCOVERY_SYNCED,
    &DISCOVERY_PODS,
    &DISCOVERY_REJECTIONS,
    &DISCOVERY_WATCH_ERRORS,
    &DISCOVERY_LISTS,
    &SALAD_LOOKUPS,
    &REGISTRATIONS,
    &RUNTIME_TASKS,
];

pub const UPTIME: MetricSpec = spec(
    "tongs_uptime_seconds",
    "gauge",
    "Seconds since this process started serving.",
);
