//! Request bodies kept for replay, so a failed attempt can be sent again to another endpoint.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use tokio::time::{Instant, Sleep};

use crate::http::BoxError;
use crate::metrics::ProxyStats;
use crate::upstream::UpstreamBody;

/// A request body, prepared so that failed attempts can be replayed on another endpoint.
#[derive(Clone)]
pub enum ReplayBody {
    /// Small enough to keep: every attempt sends a copy. The reservation holds its bytes in the
    /// process's replay budget until the last copy of the body goes.
    Buffered(Bytes, Arc<Reservation>),
    /// Too large to keep: streamed once. An attempt may be retried only if the endpoint got none of it.
    Streaming(StreamingSlot),
}

/// Why a request body could not be prepared.
#[derive(Debug)]
pub enum BodyError {
    TooLarge,
    /// The client sent nothing of its body for the idle limit.
    Idle,
    Broken(BoxError),
}

/// How a request body is read: what may be kept for replay, what is too large, and how long the
/// client may pause.
pub struct BodyRules<'a> {
    /// Bodies up to this size are kept for replay (0: none is).
    pub replay_limit: u64,
    /// The request body limit (413).
    pub max_body: Option<u64>,
    /// Memory all kept bodies share.
    pub budget: &'a Arc<ReplayBudget>,
    /// Longest pause between two pieces of the body (`timeouts.body_read`).
    pub idle: Duration,
}

/// The memory every request body kept for replay shares (`retry.replay_budget_bytes`). Over it, a body
/// streams and loses replay (and hedging) instead of tongs growing without bound: many clients
/// stalled just before the end of large uploads would otherwise hold `replay_limit_bytes` each.
#[derive(Debug)]
pub struct ReplayBudget {
    max: AtomicU64,
    /// Bytes held now (`replay_bytes`) and bodies streamed for want of budget (`replay_over_budget`).
    stats: Arc<ProxyStats>,
}

impl ReplayBudget {
    pub fn new(max: u64, stats: Arc<ProxyStats>) -> Arc<ReplayBudget> {
        Arc::new(ReplayBudget {
            max: AtomicU64::new(max),
            stats,
        })
    }

    /// A reload's new budget; bodies kept already stay.
    pub fn set_max(&self, max: u64) {
        self.max.store(max, Ordering::Relaxed);
    }

    /// Bytes kept for replay now.
    pub fn used(&self) -> u64 {
        self.stats.replay_bytes.load(Ordering::Relaxed)
    }
}

/// Bytes one body holds in the [`ReplayBudget`], given back when it is dropped.
#[derive(Debug)]
pub struct Reservation {
    budget: Arc<ReplayBudget>,
    bytes: u64,
}

impl Reservation {
    fn new(budget: &Arc<ReplayBudget>) -> Reservation {
        Reservation {
            budget: Arc::clone(budget),
            bytes: 0,
        }
    }

    /// Takes `more` bytes from the budget, if it has them.
    fn grow(&mut self, more: u64) -> bool {
        let max = self.budget.max.load(Ordering::Relaxed);
        let taken = self.budget.stats.replay_bytes.fetch_update(
            Ordering::Relaxed,
            Ordering::Relaxed,
            |used| used.checked_add(more).filter(|&total| total <= max),
        );
        if taken.is_ok() {
            self.bytes += more;
        }
        taken.is_ok()
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.budget
            .stats
            .replay_bytes
            .fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

impl ReplayBody {
    /// Reads the body into memory when it fits the replay limit (known length, or read up to the
    /// limit) and the replay budget; otherwise it stays a stream (its prefix already read goes first).
    pub async fn prepare(
        mut body: Incoming,
        rules: &BodyRules<'_>,
    ) -> Result<ReplayBody, BodyError> {
        let max_body = rules.max_body;
        let declared = body.size_hint().exact();
        if let (Some(length), Some(max)) = (declared, max_body)
            && length > max
        {
            return Err(BodyError::TooLarge);
        }
        let mut reservation = Reservation::new(rules.budget);
        if body.is_end_stream() {
            return Ok(ReplayBody::Buffered(Bytes::new(), Arc::new(reservation)));
        }
        let stream = |prefix: Bytes, body: Incoming, reservation: Reservation| {
            ReplayBody::Streaming(StreamingSlot::new(
                prefix,
                body,
                max_body,
                rules.idle,
                reservation,
            ))
        };
        if declared.is_some_and(|length| length > rules.replay_limit) {
            return Ok(stream(Bytes::new(), body, reservation));
        }
        // A declared length is reserved whole up front, so a body that will not fit streams from its
        // first byte instead of after tongs has read most of it.
        if let Some(length) = declared
            && !reservation.grow(length)
        {
            rules
                .budget
                .stats
                .replay_over_budget
                .fetch_add(1, Ordering::Relaxed);
            return Ok(stream(Bytes::new(), body, reservation));
        }
        let mut kept = bytes::BytesMut::new();
        loop {
            let frame = match tokio::time::timeout(rules.idle, body.frame()).await {
                Err(_idle) => return Err(BodyError::Idle),
                Ok(None) => break,
                Ok(Some(frame)) => frame.map_err(|err| BodyError::Broken(err.into()))?,
            };
            if let Ok(data) = frame.into_data() {
                let length = kept.len() as u64 + data.len() as u64;
                if max_body.is_some_and(|max| length > max) {
                    return Err(BodyError::TooLarge);
                }
                let beyond = length.saturating_sub(reservation.bytes);
                if length > rules.replay_limit {
                    kept.extend_from_slice(&data);
                    return Ok(stream(kept.freeze(), body, reservation));
                }
                if beyond > 0 && !reservation.grow(beyond) {
                    rules
                        .budget
                        .stats
                        .replay_over_budget
                        .fetch_add(1, Ordering::Relaxed);
                    kept.extend_from_slice(&data);
                    return Ok(stream(kept.freeze(), body, reservation));
                }
                kept.extend_from_slice(&data);
            }
        }
        Ok(ReplayBody::Buffered(kept.freeze(), Arc::new(reservation)))
    }

    /// A body tongs made itself (a continuation's request), kept for replay within the budget like a
    /// client's; `None` when the budget has no room for it.
    pub fn made(bytes: Bytes, budget: &Arc<ReplayBudget>) -> Option<ReplayBody> {
        let mut reservation = Reservation::new(budget);
        if !reservation.grow(bytes.len() as u64) {
            budget
                .stats
                .replay_over_budget
                .fetch_add(1, Ordering::Relaxed);
            return None;
        }
        Some(ReplayBody::Buffered(bytes, Arc::new(reservation)))
    }

    /// The whole body, when it is kept in memory.
    /// The body's size when it is kept (0 for one streamed once: its size is not known up front).
    pub fn kept_len(&self) -> u64 {
        self.bytes().map_or(0, |bytes| bytes.len() as u64)
    }

    pub fn bytes(&self) -> Option<&Bytes> {
        match self {
            ReplayBody::Buffered(bytes, _) => Some(bytes),
            ReplayBody::Streaming(_) => None,
        }
    }

    /// The body for the next attempt; `None` when a streamed body was already (partly) sent.
    pub fn for_attempt(&self) -> Option<UpstreamBody> {
        match self {
            ReplayBody::Buffered(bytes, _) => Some(
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
            ReplayBody::Buffered(..) => true,
            ReplayBody::Streaming(slot) => !slot.started.load(Ordering::Relaxed),
        }
    }

    /// Whether the body is kept whole in memory, so any number of attempts can send it at once.
    pub fn is_buffered(&self) -> bool {
        matches!(self, ReplayBody::Buffered(..))
    }

    /// Whether the streamed body failed through the client's fault: it crossed the request body limit,
    /// or the client paused it past its idle limit. Such a failure is the client's, not the endpoint's.
    pub fn client_fault(&self) -> Option<BodyError> {
        match self {
            ReplayBody::Buffered(..) => None,
            ReplayBody::Streaming(slot) => {
                if slot.exceeded.load(Ordering::Relaxed) {
                    Some(BodyError::TooLarge)
                } else if slot.idle_out.load(Ordering::Relaxed) {
                    Some(BodyError::Idle)
                } else {
                    None
                }
            }
        }
    }
}

/// A streamed body shared between attempts: it stays in the slot until an attempt first polls it, so
/// an attempt that failed before sending any of it (a connect failure) leaves it for the next one.
#[derive(Clone)]
pub struct StreamingSlot {
    inner: Arc<Mutex<Option<Streamed>>>,
    started: Arc<AtomicBool>,
    exceeded: Arc<AtomicBool>,
    idle_out: Arc<AtomicBool>,
}

struct Streamed {
    prefix: Option<Bytes>,
    rest: Incoming,
    sent: u64,
    max: Option<u64>,
    idle: Duration,
    /// The prefix read before the body was found too large for replay holds its bytes here.
    _reservation: Reservation,
}

impl StreamingSlot {
    fn new(
        prefix: Bytes,
        rest: Incoming,
        max: Option<u64>,
        idle: Duration,
        reservation: Reservation,
    ) -> StreamingSlot {
        StreamingSlot {
            inner: Arc::new(Mutex::new(Some(Streamed {
                sent: 0,
                prefix: (!prefix.is_empty()).then_some(prefix),
                rest,
                max,
                idle,
                _reservation: reservation,
            }))),
            started: Arc::new(AtomicBool::new(false)),
            exceeded: Arc::new(AtomicBool::new(false)),
            idle_out: Arc::new(AtomicBool::new(false)),
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
                idle_out: Arc::clone(&self.idle_out),
                pause: None,
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
    idle_out: Arc<AtomicBool>,
    /// Fires when the client has paused its body past the idle limit (set while it pauses).
    pause: Option<Pin<Box<Sleep>>>,
}

/// The request body crossed `limits.max_body_bytes` while streaming.
#[derive(Debug, thiserror::Error)]
#[error("request body is larger than the limit")]
pub struct BodyTooLarge;

/// The client paused its streamed body past `timeouts.body_read`.
#[derive(Debug, thiserror::Error)]
#[error("the client sent nothing of its request body for {}", humantime::format_duration(*.0))]
pub struct BodyIdle(pub Duration);

impl Body for SlotBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        this.started.store(true, Ordering::Relaxed);
        let mut guard = this.inner.lock().unwrap_or_else(|p| p.into_inner());
        let Some(streamed) = guard.as_mut() else {
            return Poll::Ready(None);
        };
        if let Some(prefix) = streamed.prefix.take() {
            streamed.sent += prefix.len() as u64;
            return Poll::Ready(Some(Ok(Frame::data(prefix))));
        }
        match Pin::new(&mut streamed.rest).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                this.pause = None;
                if let Some(data) = frame.data_ref() {
                    streamed.sent += data.len() as u64;
                    if streamed.max.is_some_and(|max| streamed.sent > max) {
                        this.exceeded.store(true, Ordering::Relaxed);
                        return Poll::Ready(Some(Err(BodyTooLarge.into())));
                    }
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(err))) => Poll::Ready(Some(Err(err.into()))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => {
                // Large uploads are rare, so a timer per pause is cheap enough.
                let idle = streamed.idle;
                let pause = this.pause.get_or_insert_with(|| {
                    Box::pin(tokio::time::sleep_until(Instant::now() + idle))
                });
                if pause.as_mut().poll(cx).is_ready() {
                    this.idle_out.store(true, Ordering::Relaxed);
                    return Poll::Ready(Some(Err(BodyIdle(idle).into())));
                }
                Poll::Pending
            }
        }
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}
