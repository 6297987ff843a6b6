//! The response body handed to clients.
//!
//! An endpoint's body is streamed frame by frame as it arrives (Server-Sent Events reach the client as
//! the endpoint emits them). The body carries the request's guards (the endpoint's in-flight count, the
//! request's metrics), so the endpoint counts the request as in flight until the body has ended, failed,
//! hit the overall deadline, or was dropped because the client went away — and dropping it drops the
//! endpoint's body too, which closes that upstream stream and so frees the GPU.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use pin_project_lite::pin_project;
use tokio::time::Sleep;

/// Any error a body or a connection can carry.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Whatever the request path keeps alive while a streamed answer runs; dropped when the stream ends,
/// fails or hits its deadline, or when the client goes away. Opaque here, so the HTTP layer depends on
/// nothing above it.
pub type Guard = Box<dyn Send>;

pin_project! {
    /// A body sent to a client: an endpoint's streamed body, or a small one tongs made itself.
    pub struct ProxyBody {
        #[pin]
        kind: Kind,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind {
        Upstream {
            // The first frame, read before the response was committed to the client.
            first: Option<Frame<Bytes>>,
            #[pin]
            body: Incoming,
            // Fires at the request's overall deadline.
            #[pin]
            deadline: Sleep,
            total: Duration,
            // `None` once the stream has ended: what it holds (the endpoint's in-flight count) goes right there.
            held: Option<Guard>,
            // Counts the request in the metrics when the body goes.
            finish: Option<Guard>,
        },
        Full {
            data: Option<Bytes>,
        },
    }
}

/// The endpoint's body did not finish before the request's overall deadline.
#[derive(Debug, thiserror::Error)]
#[error("response body not finished within the total timeout of {}", humantime::format_duration(*.0))]
pub struct TotalTimeout(pub Duration);

impl ProxyBody {
    /// Streams an endpoint's body (after `first`, a frame already read), holding `held` until it ends.
    pub fn upstream(
        first: Option<Frame<Bytes>>,
        body: Incoming,
        held: Guard,
        deadline: Sleep,
        total: Duration,
    ) -> Self {
        ProxyBody {
            kind: Kind::Upstream {
                first,
                body,
                deadline,
                total,
                held: Some(held),
                finish: None,
            },
        }
    }

    /// A complete body made by tongs (error messages, admin answers).
    /// Hands `finish` to a streamed body, to drop when the body goes; gives it back for any other body.
    pub fn on_end(&mut self, finish: Guard) -> Result<(), Guard> {
        match &mut self.kind {
            Kind::Upstream { finish: slot, .. } => {
                *slot = Some(finish);
                Ok(())
            }
            Kind::Full { .. } => Err(finish),
        }
    }

    pub fn full(data: impl Into<Bytes>) -> Self {
        ProxyBody {
            kind: Kind::Full {
                data: Some(data.into()),
            },
        }
    }

    pub fn empty() -> Self {
        ProxyBody {
            kind: Kind::Full { data: None },
        }
    }
}

impl Body for ProxyBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.project().kind.project() {
            KindProj::Upstream {
                first,
                body,
                deadline,
                total,
                held,
                finish,
            } => {
                if let Some(frame) = first.take() {
                    return Poll::Ready(Some(Ok(frame)));
                }
                if held.is_none() {
                    return Poll::Ready(None);
                }
                match body.poll_frame(cx) {
                    Poll::Ready(Some(Ok(frame))) => Poll::Ready(Some(Ok(frame))),
                    Poll::Ready(Some(Err(err))) => {
                        *held = None;
                        *finish = None;
                        Poll::Ready(Some(Err(err.into())))
                    }
                    Poll::Ready(None) => {
                        *held = None;
                        *finish = None;
                        Poll::Ready(None)
                    }
                    Poll::Pending => match deadline.poll(cx) {
                        Poll::Ready(()) => {
                            *held = None;
                            *finish = None;
                            Poll::Ready(Some(Err(TotalTimeout(*total).into())))
                        }
                        Poll::Pending => Poll::Pending,
                    },
                }
            }
            KindProj::Full { data } => Poll::Ready(data.take().map(|d| Ok(Frame::data(d)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Upstream {
                first, body, held, ..
            } => first.is_none() && (held.is_none() || body.is_end_stream()),
            Kind::Full { data } => data.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Upstream { first, body, .. } => {
                let rest = body.size_hint();
                let already = first
                    .as_ref()
                    .and_then(Frame::data_ref)
                    .map_or(0, |d| d.len() as u64);
                // Upper before lower: SizeHint refuses a lower bound above its current upper bound.
                let mut hint = SizeHint::new();
                if let Some(upper) = rest.upper() {
                    hint.set_upper(upper.saturating_add(already));
                }
                hint.set_lower(rest.lower().saturating_add(already));
                hint
            }
            Kind::Full { data } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
        }
    }
}
