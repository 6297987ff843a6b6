//! An open-loop load generator: requests leave at a fixed rate whatever the service does, like real
//! users, so a slow or failing fleet shows up as latency and errors instead of as a politely lower rate
//! (the "coordinated omission" a closed loop suffers from).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use hdrhistogram::Histogram;
use http::{Request, StatusCode, header};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;
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
    /// A 200 whose answer is not whole: a stream not ended by `data: [DONE]`, or a body that is not a
    /// JSON answer.
    Incomplete,
    /// A 200 with a whole answer that is not the one the model writes (see [`check_completion`]).
    Inexact,
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
            ClientOutcome::Incomplete => "incomplete".into(),
            ClientOutcome::Inexact => "inexact".into(),
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
            let request = build_request(&plan.target, index, stream, COMPLETION_TOKENS);
            let expected = Expected { index, stream };
            let (client, recorder, timeout) = (
                client.clone(),
                Arc::clone(&self.recorder),
                plan.client_timeout,
            );
            self.recorder.lock().unwrap_or_else(|p| p.into_inner()).sent += 1;
            tasks.spawn(async move {
                let began = Instant::now();
                let outcome =
                    match tokio::time::timeout(timeout, exchange(&client, request, expected)).await
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

/// The tokens the demo's requests ask for.
pub const COMPLETION_TOKENS: u32 = 16;

/// The inference request the load sends: a small JSON prompt to `/v1/completions` for `tokens` tokens,
/// asking for an SSE stream when `stream`.
pub fn build_request(target: &str, index: u64, stream: bool, tokens: u32) -> Request<Full<Bytes>> {
    let prompt =
        format!(r#"{{"prompt":"request {index}","max_tokens":{tokens},"stream":{stream}}}"#);
    let mut builder = Request::post(format!("{target}/v1/completions"))
        .header(header::CONTENT_TYPE, "application/json");
    if stream {
        builder = builder.header(header::ACCEPT, "text/event-stream");
    }
    builder
        .body(Full::new(Bytes::from(prompt)))
        .unwrap_or_else(|_| Request::new(Full::new(Bytes::new())))
}

/// The request a client sent, to check its answer.
#[derive(Clone, Copy)]
struct Expected {
    index: u64,
    stream: bool,
}

async fn exchange(
    client: &Client<HttpConnector, Full<Bytes>>,
    request: Request<Full<Bytes>>,
    expected: Expected,
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
    let Ok(body) = response.into_body().collect().await else {
        return ClientOutcome::Broken;
    };
    if status.is_success() {
        // A 200 is a success only with the exact answer the simulated model writes.
        return match check_completion(
            expected.index,
            expected.stream,
            COMPLETION_TOKENS,
            &body.to_bytes(),
        ) {
            Ok(()) => ClientOutcome::Succeeded,
            Err(AnswerFault::Incomplete) => ClientOutcome::Incomplete,
            Err(AnswerFault::Inexact(_)) => ClientOutcome::Inexact,
        };
    }
    if status == StatusCode::SERVICE_UNAVAILABLE && refused_by_tongs {
        return ClientOutcome::Rejected;
    }
    ClientOutcome::Status(status.as_u16())
}

/// The text the simulator's model answers [`build_request`]`(_, index, _, tokens)` with: it counts on
/// from the prompt's last integer, one number a token: `" {index+1} {index+2} ... {index+tokens}"`.
pub fn expected_text(index: u64, tokens: u32) -> String {
    (1..=u64::from(tokens)).fold(String::new(), |mut text, i| {
        let _ = write!(text, " {}", index.saturating_add(i));
        text
    })
}

/// Why an answer to [`build_request`] is not the one the simulated model writes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AnswerFault {
    /// Not whole: a stream whose last event is not `data: [DONE]` (and that has none), or a body that
    /// is not a JSON object.
    Incomplete,
    /// Whole but wrong, and how.
    Inexact(String),
}

/// Checks that `body`, the 200 answer to [`build_request`]`(_, index, stream, tokens)`, is complete and
/// exactly what the simulated model writes ([`expected_text`]), as one uninterrupted node would send it.
///
/// A stream: every event's `data:` lines parse (as JSON, but for the end marker); the concatenated
/// `choices[0].text` of the chunks equals the expected text; every chunk has the same `id`, `created`
/// and `model`; exactly one chunk has a non-null `finish_reason`; exactly one `data: [DONE]`, the last
/// event. Events without data (comments) are ignored. A whole answer: its JSON `choices[0].text` equals
/// the expected text and its `finish_reason` is set.
pub fn check_completion(
    index: u64,
    stream: bool,
    tokens: u32,
    body: &[u8],
) -> Result<(), AnswerFault> {
    let inexact = |why: String| Err(AnswerFault::Inexact(why));
    let expected = expected_text(index, tokens);
    let text = if stream {
        streamed_text(body)?
    } else {
        let Ok(answer) = serde_json::from_slice::<Value>(body) else {
            return Err(AnswerFault::Incomplete);
        };
        let choice = &answer["choices"][0];
        if choice["finish_reason"].is_null() {
            return inexact("no finish_reason".into());
        }
        match choice["text"].as_str() {
            Some(text) => text.to_owned(),
            None => return inexact("no choices[0].text".into()),
        }
    };
    if text != expected {
        return inexact(format!("text {text:?}, expected {expected:?}"));
    }
    Ok(())
}

/// The text of a streamed completion whose events are whole and consistent (see [`check_completion`]).
fn streamed_text(body: &[u8]) -> Result<String, AnswerFault> {
    let inexact = |why: String| Err(AnswerFault::Inexact(why));
    let Ok(body) = std::str::from_utf8(body) else {
        return inexact("not UTF-8".into());
    };
    let body = body.replace("\r\n", "\n");
    let mut events: Vec<&str> = body.split("\n\n").collect();
    // What follows the last blank line: nothing in a stream that ended with a whole event.
    let unterminated = events.pop().is_some_and(|tail| !tail.trim().is_empty());
    let data: Vec<String> = events
        .iter()
        .filter_map(|event| {
            let lines: Vec<&str> = event
                .lines()
                .filter_map(|line| line.strip_prefix("data:"))
                .map(|data| data.strip_prefix(' ').unwrap_or(data))
                .collect();
            (!lines.is_empty()).then(|| lines.join("\n"))
        })
        .collect();
    let done = data.iter().filter(|data| *data == "[DONE]").count();
    if done == 0 {
        return Err(AnswerFault::Incomplete);
    }
    if done > 1 {
        return inexact(format!("{done} data: [DONE]"));
    }
    if data.last().is_none_or(|last| last != "[DONE]") || unterminated {
        return inexact("data: [DONE] is not the last event".into());
    }
    let mut text = String::new();
    let mut head: Option<[Value; 3]> = None;
    let mut finishes = 0;
    for (i, data) in data[..data.len() - 1].iter().enumerate() {
        let Ok(chunk) = serde_json::from_str::<Value>(data) else {
            return inexact(format!("event {i} is not JSON: {data:?}"));
        };
        let this = ["id", "created", "model"].map(|field| chunk[field].clone());
        if this[0].as_str().is_none() {
            return inexact(format!("chunk {i} has no id: {data}"));
        }
        match &head {
            None => head = Some(this),
            Some(first) if *first != this => {
                return inexact(format!(
                    "chunk {i} has id, created, model {this:?}; the first had {first:?}"
                ));
            }
            Some(_) => {}
        }
        // A usage chunk has no choices.
        let choice = &chunk["choices"][0];
        if let Some(piece) = choice["text"].as_str() {
            text.push_str(piece);
        }
        finishes += usize::from(!choice["finish_reason"].is_null());
    }
    if head.is_none() {
        return inexact("no chunk before data: [DONE]".into());
    }
    if finishes != 1 {
        return inexact(format!("{finishes} chunks with a finish_reason"));
    }
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stream as a node writes it: one chunk per token under `id`, the last one finishing.
    fn chunks(id: &str, tokens: &[u64]) -> Vec<String> {
        tokens
            .iter()
            .enumerate()
            .map(|(i, token)| {
                let finish = if i + 1 == tokens.len() {
                    r#""length""#
                } else {
                    "null"
                };
                format!(
                    r#"data: {{"id":"{id}","object":"text_completion","created":1700000000,"model":"sim","choices":[{{"index":0,"text":" {token}","logprobs":null,"finish_reason":{finish}}}]}}"#
                ) + "\n\n"
            })
            .collect()
    }

    const DONE: &str = "data: [DONE]\n\n";

    /// The answer to request 7: tokens 8 to 23.
    fn tokens() -> Vec<u64> {
        (8..=23).collect()
    }

    fn check(body: &str) -> Result<(), AnswerFault> {
        check_completion(7, true, 16, body.as_bytes())
    }

    fn is_inexact(result: Result<(), AnswerFault>) -> bool {
        matches!(result, Err(AnswerFault::Inexact(_)))
    }

    #[test]
    fn the_expected_text_counts_sixteen_on_from_the_index() {
        assert_eq!(
            expected_text(7, 16),
            " 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23"
        );
    }

    #[test]
    fn an_exact_stream_passes() {
        let body = chunks("cmpl-a-1", &tokens()).concat() + DONE;
        assert_eq!(check(&body), Ok(()));
        // Comments, a usage chunk without choices and CRLF line ends change nothing.
        let usage = r#"data: {"id":"cmpl-a-1","object":"text_completion","created":1700000000,"model":"sim","choices":[],"usage":{"prompt_tokens":2,"completion_tokens":16,"total_tokens":18}}"#;
        let body = format!(
            ": keep-alive\n\n{}{usage}\n\n{DONE}",
            chunks("cmpl-a-1", &tokens()).concat()
        );
        assert_eq!(check(&body), Ok(()));
        assert_eq!(check(&body.replace('\n', "\r\n")), Ok(()));
    }

    #[test]
    fn a_lost_token_is_inexact() {
        let mut lost = tokens();
        lost.remove(5);
        let body = chunks("cmpl-a-1", &lost).concat() + DONE;
        assert!(is_inexact(check(&body)), "{:?}", check(&body));
    }

    #[test]
    fn a_repeated_token_is_inexact() {
        let mut repeated = tokens();
        repeated.insert(5, repeated[4]);
        let body = chunks("cmpl-a-1", &repeated).concat() + DONE;
        assert!(is_inexact(check(&body)), "{:?}", check(&body));
    }

    #[test]
    fn reordered_tokens_are_inexact() {
        let mut reordered = chunks("cmpl-a-1", &tokens());
        reordered.swap(3, 4);
        let body = reordered.concat() + DONE;
        assert!(is_inexact(check(&body)), "{:?}", check(&body));
    }

    #[test]
    fn two_ends_or_an_end_not_last_are_inexact() {
        let body = chunks("cmpl-a-1", &tokens()).concat() + DONE + DONE;
        assert!(is_inexact(check(&body)), "{:?}", check(&body));
        let mut early = chunks("cmpl-a-1", &tokens());
        early.insert(8, DONE.to_owned());
        assert!(is_inexact(check(&early.concat())));
        let trailing = chunks("cmpl-a-1", &tokens()).concat() + DONE + "data: {}";
        assert!(is_inexact(check(&trailing)));
    }

    #[test]
    fn a_changed_id_is_inexact() {
        let mut changed = chunks("cmpl-a-1", &tokens());
        for chunk in &mut changed[6..] {
            *chunk = chunk.replace("cmpl-a-1", "cmpl-b-1");
        }
        let body = changed.concat() + DONE;
        assert!(is_inexact(check(&body)), "{:?}", check(&body));
    }

    #[test]
    fn two_finishes_or_none_are_inexact() {
        let all = tokens();
        let (first, rest) = all.split_at(6);
        let twice = chunks("cmpl-a-1", first).concat() + &chunks("cmpl-a-1", rest).concat() + DONE;
        assert!(is_inexact(check(&twice)));
        let never = chunks("cmpl-a-1", &tokens())
            .concat()
            .replace(r#""finish_reason":"length""#, r#""finish_reason":null"#)
            + DONE;
        assert!(is_inexact(check(&never)));
    }

    #[test]
    fn a_stream_without_its_end_is_incomplete() {
        let cut = chunks("cmpl-a-1", &tokens()[..9]).concat();
        assert_eq!(check(&cut), Err(AnswerFault::Incomplete));
        let whole_but_unended = chunks("cmpl-a-1", &tokens()).concat();
        assert_eq!(check(&whole_but_unended), Err(AnswerFault::Incomplete));
        let half_an_end = chunks("cmpl-a-1", &tokens()).concat() + "data: [DO";
        assert_eq!(check(&half_an_end), Err(AnswerFault::Incomplete));
        assert!(is_inexact(check("data: not json\n\ndata: [DONE]\n\n")));
    }

    #[test]
    fn a_whole_answer_is_checked_by_its_text() {
        let answer = |text: &str| {
            format!(
                r#"{{"id":"cmpl-a-1","object":"text_completion","created":1700000000,"model":"sim","choices":[{{"index":0,"text":"{text}","logprobs":null,"finish_reason":"length"}}]}}"#
            )
        };
        let exact = answer(&expected_text(7, 16));
        assert_eq!(check_completion(7, false, 16, exact.as_bytes()), Ok(()));
        assert!(is_inexact(check_completion(8, false, 16, exact.as_bytes())));
        assert!(is_inexact(check_completion(7, false, 17, exact.as_bytes())));
        let cut = &exact[..exact.len() - 3];
        assert_eq!(
            check_completion(7, false, 16, cut.as_bytes()),
            Err(AnswerFault::Incomplete)
        );
    }
}
