//! Retrying elsewhere: what is retryable, the retry budget, backoff, and request bodies kept for replay.
//!
//! The budget is tower's `TpsBudget` (Finagle's design): every request deposits, every retry withdraws,
//! so retries add at most `budget_percent` of the request rate plus a small per-second floor. When the
//! whole fleet fails, the budget runs dry and tongs answers at once instead of multiplying the load.
//! Each worker thread keeps its own budget (a share of the floor, the same percentage), because a
//! `TpsBudget` takes a lock on every deposit and one shared budget would be a lock every request of
//! every thread contends for.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, StatusCode, header};
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use tower::retry::budget::{Budget, TpsBudget};

use crate::config::RetryConfig;
use crate::http::BoxError;
use crate::upstream::UpstreamBody;

/// Why an attempt failed (or was turned away): the very conditions `retry.on` lists.
pub use crate::config::RetryOn as FailureKind;

impl FailureKind {
    /// Whether the endpoint is at fault (feeds the breaker); back-pressure is not a fault.
    pub fn is_endpoint_fault(self) -> bool {
        self != FailureKind::BackPressure
    }
}

/// Classifies a response by status: failure, back-pressure, or fine (`None`).
pub fn classify_status(status: StatusCode, headers: &HeaderMap) -> Option<FailureKind> {
    match status.as_u16() {
        429 => Some(FailureKind::BackPressure),
        503 if headers.contains_key(header::RETRY_AFTER) => Some(FailureKind::BackPressure),
        code @ (502 | 503 | 504 | 524) => Some(FailureKind::Status(code)),
        _ => None,
    }
}

/// `Retry-After` in seconds (the HTTP-date form counts as 1 s), capped at `cap`.
pub fn retry_after(headers: &HeaderMap, cap: Duration) -> Duration {
    let seconds = headers
        .get(header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .unwrap_or(1);
    Duration::from_secs(seconds).min(cap)
}

/// The retry rules of one configuration.
pub struct RetryPolicy {
    config: RetryConfig,
}

/// One worker's retry budget.
pub struct RetryBudget(TpsBudget);

impl RetryBudget {
    /// Every request deposits into the budget.
    pub fn deposit(&self) {
        self.0.deposit();
    }

    /// Takes one retry from the budget.
    pub fn withdraw(&self) -> bool {
        self.0.withdraw()
    }
}

impl RetryPolicy {
    pub fn new(config: &RetryConfig) -> RetryPolicy {
        RetryPolicy {
            config: config.clone(),
        }
    }

    /// A budget for one of `workers` worker threads: the same percentage, a share of the floor.
    pub fn budget(&self, workers: usize) -> RetryBudget {
        let workers = u32::try_from(workers.max(1)).unwrap_or(u32::MAX);
        // Validation keeps these within TpsBudget's own bounds (percent ≤ 1000 %, floor < i32::MAX).
        RetryBudget(TpsBudget::new(
            Duration::from_secs(10),
            self.config.budget_min_per_second.div_ceil(workers),
            self.config.budget_percent as f32 / 100.0,
        ))
    }

    pub fn enabled(&self) -> bool {
        self.config.enabled && self.config.max_attempts > 1
    }

    pub fn max_attempts(&self) -> u32 {
        self.config.max_attempts
    }

    pub fn replay_limit(&self) -> u64 {
        self.config.replay_limit_bytes
    }

    /// Whether `retry.on` lists this failure.
    pub fn retries_on(&self, kind: FailureKind) -> bool {
        self.config.on.contains(&kind)
    }

    /// Backoff before retry number `retry` (1 for the first retry): full jitter up to base × 2^(retry−1).
    pub fn backoff(&self, retry: u32) -> Duration {
        let ceiling = self
            .config
            .backoff_base
            .get()
            .saturating_mul(1u32 << retry.saturating_sub(1).min(16))
            .min(self.config.backoff_max.get());
        ceiling.mul_f64(fastrand::f64())
    }
}

/// A request body, prepared so that failed attempts can be replayed on another endpoint.
pub enum ReplayBody {
    /// Small enough to keep: every attempt sends a copy.
    Buffered(Bytes),
    /// Too large to keep: streamed once. An attempt may be retried only if the endpoint got none of it.
    Streaming(StreamingSlot),
}

/// Why a request body could not be prepared.
#[derive(Debug)]
pub enum BodyError {
    TooLarge,
    Broken(BoxError),
}

impl ReplayBody {
    /// Reads the body into memory when it fits `replay_limit` (known length, or read up to the limit);
    /// a larger body stays a stream (its prefix already read goes first). `max_body` is the request
    /// body limit (413).
    pub async fn prepare(
        mut body: Incoming,
        replay_limit: u64,
        max_body: Option<u64>,
    ) -> Result<ReplayBody, BodyError> {
        let declared = body.size_hint().exact();
        if let (Some(length), Some(max)) = (declared, max_body)
            && length > max
        {
            return Err(BodyError::TooLarge);
        }
        if body.is_end_stream() {
            return Ok(ReplayBody::Buffered(Bytes::new()));
        }
        if declared.is_some_and(|length| length > replay_limit) {
            return Ok(ReplayBody::Streaming(StreamingSlot::new(
                Bytes::new(),
                body,
                max_body,
            )));
        }
        let mut kept = bytes::BytesMut::new();
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|err| BodyError::Broken(err.into()))?;
            if let Ok(data) = frame.into_data() {
                kept.extend_from_slice(&data);
            }
            if max_body.is_some_and(|max| kept.len() as u64 > max) {
                return Err(BodyError::TooLarge);
            }
            if kept.len() as u64 > replay_limit {
                return Ok(ReplayBody::Streaming(StreamingSlot::new(
                    kept.freeze(),
                    body,
                    max_body,
                )));
            }
        }
        Ok(ReplayBody::Buffered(kept.freeze()))
    }

    /// The body for the next attempt; `None` when a streamed body was already (partly) sent.
    pub fn for_attempt(&self) -> Option<UpstreamBody> {
        match self {
            ReplayBody::Buffered(bytes) => Some(
                Full::new(bytes.clone())
                    .map_err(|never| match never {})
                    .boxed_unsync(),
            ),
            ReplayBody::Streaming(slot) => slot.for_attempt(),
        }
    }

    /// Whether an attempt that failed in this way may be retried as far as the body is concerned.
    pub fn replayable(&self) -> bool {
        match self {
            ReplayBody::Buffered(_) => true,
            ReplayBody::Streaming(slot) => !slot.started.load(Ordering::Relaxed),
        }
    }

    /// Whether the streamed body crossed the request body limit.
    pub fn exceeded_limit(&self) -> bool {
        match self {
            ReplayBody::Buffered(_) => false,
            ReplayBody::Streaming(slot) => slot.exceeded.load(Ordering::Relaxed),
        }
    }
}

/// A streamed body shared between attempts: it stays in the slot until an attempt first polls it, so
/// an attempt that failed before sending any of it (a connect failure) leaves it for the next one.
pub struct StreamingSlot {
    inner: Arc<Mutex<Option<Streamed>>>,
    started: Arc<AtomicBool>,
    exceeded: Arc<AtomicBool>,
}

struct Streamed {
    prefix: Option<Bytes>,
    rest: Incoming,
    sent: u64,
    max: Option<u64>,
}

impl StreamingSlot {
    fn new(prefix: Bytes, rest: Incoming, max: Option<u64>) -> StreamingSlot {
        StreamingSlot {
            inner: Arc::new(Mutex::new(Some(Streamed {
                sent: 0,
                prefix: (!prefix.is_empty()).then_some(prefix),
                rest,
                max,
            }))),
            started: Arc::new(AtomicBool::new(false)),
            exceeded: Arc::new(AtomicBool::new(false)),
        }
    }

    fn for_attempt(&self) -> Option<UpstreamBody> {
        if self.started.load(Ordering::Relaxed) {
            return None;
        }
        Some(
            SlotBody {
                inner: Arc::clone(&self.inner),
                started: Arc::clone(&self.started),
                exceeded: Arc::clone(&self.exceeded),
            }
            .boxed_unsync(),
        )
    }
}

/// The body an attempt sends from a [`StreamingSlot`].
struct SlotBody {
    inner: Arc<Mutex<Option<Streamed>>>,
    started: Arc<AtomicBool>,
    exceeded: Arc<AtomicBool>,
}

/// The request body crossed `limits.max_body_bytes` while streaming.
#[derive(Debug, thiserror::Error)]
#[error("request body is larger than the limit")]
pub struct BodyTooLarge;

impl Body for SlotBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.started.store(true, Ordering::Relaxed);
        let mut guard = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let Some(streamed) = guard.as_mut() else {
            return Poll::Ready(None);
        };
        if let Some(prefix) = streamed.prefix.take() {
            streamed.sent += prefix.len() as u64;
            return Poll::Ready(Some(Ok(Frame::data(prefix))));
        }
        match Pin::new(&mut streamed.rest).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    streamed.sent += data.len() as u64;
                    if streamed.max.is_some_and(|max| streamed.sent > max) {
                        self.exceeded.store(true, Ordering::Relaxed);
                        return Poll::Ready(Some(Err(BodyTooLarge.into())));
                    }
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(err))) => Poll::Ready(Some(Err(err.into()))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_are_classified() {
        let none = HeaderMap::new();
        let mut with_retry_after = HeaderMap::new();
        with_retry_after.insert(header::RETRY_AFTER, "3".parse().unwrap());
        assert_eq!(classify_status(StatusCode::OK, &none), None);
        assert_eq!(classify_status(StatusCode::NOT_FOUND, &none), None);
        assert_eq!(
            classify_status(StatusCode::TOO_MANY_REQUESTS, &none),
            Some(FailureKind::BackPressure)
        );
        assert_eq!(
            classify_status(StatusCode::SERVICE_UNAVAILABLE, &with_retry_after),
            Some(FailureKind::BackPressure)
        );
        assert_eq!(
            classify_status(StatusCode::SERVICE_UNAVAILABLE, &none),
            Some(FailureKind::Status(503))
        );
        assert_eq!(
            classify_status(StatusCode::from_u16(524).unwrap(), &none),
            Some(FailureKind::Status(524))
        );
        assert_eq!(
            retry_after(&with_retry_after, Duration::from_secs(2)),
            Duration::from_secs(2)
        );
        assert_eq!(
            retry_after(&none, Duration::from_secs(30)),
            Duration::from_secs(1)
        );
    }

    #[test]
    fn backoff_is_jittered_and_capped() {
        let policy = RetryPolicy::new(&RetryConfig::default());
        for retry in 1..10 {
            let backoff = policy.backoff(retry);
            assert!(backoff <= Duration::from_millis(200), "{backoff:?}");
        }
        let samples: Vec<_> = (0..20).map(|_| policy.backoff(3)).collect();
        assert!(samples.iter().any(|b| *b != samples[0]), "jittered");
    }

    #[tokio::test(start_paused = true)]
    async fn budget_caps_retries_at_a_share_of_requests() {
        let config = RetryConfig {
            budget_percent: 20,
            budget_min_per_second: 0,
            ..RetryConfig::default()
        };
        let budget = RetryPolicy::new(&config).budget(1);
        for _ in 0..100 {
            budget.deposit();
        }
        let granted = (0..100).filter(|_| budget.withdraw()).count();
        assert_eq!(granted, 20);
    }

    #[test]
    fn retry_on_follows_the_config() {
        let config = RetryConfig {
            on: vec![FailureKind::ConnectFailure, FailureKind::Status(503)],
            ..RetryConfig::default()
        };
        let policy = RetryPolicy::new(&config);
        assert!(policy.retries_on(FailureKind::ConnectFailure));
        assert!(policy.retries_on(FailureKind::Status(503)));
        assert!(!policy.retries_on(FailureKind::Status(502)));
        assert!(!policy.retries_on(FailureKind::Timeout));
    }
}
