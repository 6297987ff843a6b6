//! Request bodies kept for replay, so a failed attempt can be sent again to another endpoint.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;

use crate::http::BoxError;
use crate::upstream::UpstreamBody;

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
