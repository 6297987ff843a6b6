//! An open-loop load generator: requests leave at a fixed rate whatever the service does, like real
//! users, so a slow or failing fleet shows up as latency and errors instead of as a politely lower rate
//! (the "coordinated omission" a closed loop suffers from).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use hdrhistogram::Histogram;
use http::{Request, StatusCode, header};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// How one request ended, from the client's side.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum ClientOutcome {
    Succeeded,
    /// tongs itself answered 503 (queue full or timed out, shed, no endpoint): a rejection, not a
    /// failure of a node.
    Rejected,
    /// Any other non-2xx status (e.g. 502, 503 passed through from a gateway, 504).
    Status(u16),
    /// The connection or the streamed body broke.
    Broken,
    /// No complete answer within the client's own timeout.
    TimedOut,
    /// Still running when the run ended.
    Unfinished,
}

impl ClientOutcome {
    pub fn label(self) -> String {
        match self {
            ClientOutcome::Succeeded => "succeeded".into(),
            ClientOutcome::Rejected => "rejected".into(),
            ClientOutcome::Status(code) => code.to_string(),
            ClientOutcome::Broken => "broken".into(),
            ClientOutcome::TimedOut => "client-timeout".into(),
            ClientOutcome::Unfinished => "unfinished".into(),
        }
    }
}

/// Everything the generator observed.
pub struct Recorder {
    /// Latency of succeeded requests, microseconds.
    latency: Histogram<u64>,
    outcomes: BTreeMap<ClientOutcome, u64>,
    sent: u64,
}

impl Recorder {
    fn new() -> Recorder {
        Recorder {
            // 1 µs .. 1 hour at 3 significant digits.
            latency: Histogram::new_with_bounds(1, 3_600_000_000, 3)
                .expect("constant histogram bounds are valid"),
            outcomes: BTreeMap::new(),
            sent: 0,
        }
    }

    fn record(&mut self, outcome: ClientOutcome, latency: Duration) {
        *self.outcomes.entry(outcome).or_default() += 1;
        if outcome == ClientOutcome::Succeeded {
            let micros = u64::try_from(latency.as_micros())
                .unwrap_or(u64::MAX)
                .max(1);
            self.latency.saturating_record(micros);
        }
    }

    pub fn sent(&self) -> u64 {
        self.sent
    }

    pub fn count(&self, outcome: ClientOutcome) -> u64 {
        self.outcomes.get(&outcome).copied().unwrap_or(0)
    }

    /// Completed requests (any outcome but still running).
    pub fn completed(&self) -> u64 {
        self.outcomes
            .iter()
            .filter(|(o, _)| **o != ClientOutcome::Unfinished)
            .map(|(_, n)| n)
            .sum()
    }

    /// Failures by kind (everything but succeeded and rejected).
    pub fn failures(&self) -> BTreeMap<String, u64> {
        self.outcomes
            .iter()
            .filter(|(o, _)| !matches!(o, ClientOutcome::Succeeded | ClientOutcome::Rejected))
            .map(|(o, n)| (o.label(), *n))
            .collect()
    }

    /// A latency quantile of succeeded requests in milliseconds (0 when none succeeded).
    pub fn latency_ms(&self, quantile: f64) -> f64 {
        if self.latency.is_empty() {
            return 0.0;
        }
        self.latency.value_at_quantile(quantile) as f64 / 1000.0
    }

    pub fn max_latency_ms(&self) -> f64 {
        if self.latency.is_empty() {
            return 0.0;
        }
        self.latency.max() as f64 / 1000.0
    }
}

/// Runs the open loop against `target` until `duration` has passed or `stop` is cancelled, then waits
/// up to `settle` for requests still running. `stream_every`: every n-th request asks for an SSE stream.
pub struct LoadGenerator {
    recorder: Arc<Mutex<Recorder>>,
}

impl Default for LoadGenerator {
    fn default() -> Self {
        LoadGenerator {
            recorder: Arc::new(Mutex::new(Recorder::new())),
        }
    }
}

pub struct LoadPlan {
    pub target: String,
    pub rps: f64,
    pub duration: Duration,
    pub stream_every: u64,
    pub client_timeout: Duration,
    pub settle: Duration,
}

impl LoadGenerator {
    /// Read access to what was recorded so far.
    pub fn with<T>(&self, read: impl FnOnce(&Recorder) -> T) -> T {
        read(&self.recorder.lock().unwrap_or_else(|p| p.into_inner()))
    }

    pub async fn run(&self, plan: &LoadPlan, stop: CancellationToken) {
        let client: Client<HttpConnector, Full<Bytes>> = Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(1024)
            .build_http();
        let tasks = TaskTracker::new();
        let start = Instant::now();
        let interval = Duration::from_secs_f64(1.0 / plan.rps.max(0.001));
        let mut index: u64 = 0;
        loop {
            // Departure times are fixed in advance: a slow response never delays the next request.
            let due = start + interval.mul_f64(index as f64);
            if due.duration_since(start) >= plan.duration {
                break;
            }
            tokio::select! {
                () = stop.cancelled() => break,
                () = tokio::time::sleep_until(due) => {}
            }
            let stream = plan.stream_every > 0 && index.is_multiple_of(plan.stream_every);
            let request = build_request(&plan.target, index, stream);
            let (client, recorder, timeout) = (
                client.clone(),
                Arc::clone(&self.recorder),
                plan.client_timeout,
            );
            self.recorder.lock().unwrap_or_else(|p| p.into_inner()).sent += 1;
            tasks.spawn(async move {
                let began = Instant::now();
                let outcome = match tokio::time::timeout(timeout, exchange(&client, request)).await
                {
                    Ok(outcome) => outcome,
                    Err(_) => ClientOutcome::TimedOut,
                };
                recorder
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .record(outcome, began.elapsed());
            });
            index += 1;
        }
        tasks.close();
        // Interrupted by the user: leave soon rather than wait out every hanging request.
        let settle = if stop.is_cancelled() {
            plan.settle.min(Duration::from_secs(2))
        } else {
            plan.settle
        };
        let settled = tokio::time::timeout(settle, tasks.wait()).await.is_ok();
        if !settled {
            let mut recorder = self.recorder.lock().unwrap_or_else(|p| p.into_inner());
            let unfinished = recorder.sent - recorder.completed();
            *recorder
                .outcomes
                .entry(ClientOutcome::Unfinished)
                .or_default() += unfinished;
        }
    }
}

/// The inference request the load sends: a small JSON prompt to `/v1/completions`, asking for an SSE
/// stream when `stream`.
pub fn build_request(target: &str, index: u64, stream: bool) -> Request<Full<Bytes>> {
    let prompt = format!(r#"{{"prompt":"request {index}","max_tokens":16,"stream":{stream}}}"#);
    let mut builder = Request::post(format!("{target}/v1/completions"))
        .header(header::CONTENT_TYPE, "application/json");
    if stream {
        builder = builder.header(header::ACCEPT, "text/event-stream");
    }
    builder
        .body(Full::new(Bytes::from(prompt)))
        .unwrap_or_else(|_| Request::new(Full::new(Bytes::new())))
}

async fn exchange(
    client: &Client<HttpConnector, Full<Bytes>>,
    request: Request<Full<Bytes>>,
) -> ClientOutcome {
    let response = match client.request(request).await {
        Ok(response) => response,
        Err(_) => return ClientOutcome::Broken,
    };
    let status = response.status();
    // tongs names the reason of its own refusals; a node's or a gateway's 503 carries no such header.
    let refused_by_tongs = response
        .headers()
        .contains_key(&crate::http::headers::X_TONGS_REJECT_REASON);
    // The whole body must arrive: a stream cut short is a failure whatever its status said.
    if response.into_body().collect().await.is_err() {
        return ClientOutcome::Broken;
    }
    if status.is_success() {
        return ClientOutcome::Succeeded;
    }
    if status == StatusCode::SERVICE_UNAVAILABLE && refused_by_tongs {
        return ClientOutcome::Rejected;
    }
    ClientOutcome::Status(status.as_u16())
}
