//! A streamed OpenAI answer that survives its node: relayed event by event, and when its node breaks
//! (resets, closes before `[DONE]`, stalls, or is declared gone) continued on another endpoint and
//! spliced into the same client stream.
//!
//! The relay knows the protocol through [`Splicer`] and the fleet only through [`Resume`], which the
//! request path implements: so this layer still knows nothing of endpoints or queues. Each piece is an
//! ordinary upstream [`ProxyBody`], with its own idle limit, gone signal, deadline and endpoint slot.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame};
use tokio::time::Instant;

use super::body::{BoxError, Guard, ProxyBody, StreamCut, TotalTimeout};
use crate::openai::sse::{Events, MAX_EVENT_BYTES};
use crate::openai::{AfterCut, Resumption, Splicer};

/// The next piece of a stream and the resumer for the one after it, or the error the client's stream
/// ends with.
pub type Resuming =
    Pin<Box<dyn Future<Output = Result<(ProxyBody, Box<dyn Resume>), BoxError>> + Send>>;

/// Continues a broken stream on another endpoint (implemented by the request path).
pub trait Resume: Send {
    /// Sends `request`, the continuation's body, to an endpoint not yet tried for this request.
    fn resume(self: Box<Self>, request: Resumption, broke: Broke) -> Resuming;
    /// The stream broke and was not continued: it was complete but for its end (`None`: tongs wrote
    /// the end), or it could not be continued safely (the reason).
    fn not_continued(&mut self, refused: Option<&'static str>, why: &str);
}

/// How the last piece of a stream broke.
#[derive(Debug)]
pub struct Broke {
    /// What broke it, in words.
    pub why: String,
    /// How long the client has had nothing by then.
    pub silent: Duration,
    /// tongs ended it itself, since its node said it is going ([`StreamCut::Moved`]): the node still
    /// serves, and the move has time to spare.
    pub planned: bool,
}

/// A relayed, continuable stream.
pub struct Relay {
    piece: Pin<Box<ProxyBody>>,
    events: Events,
    splicer: Splicer,
    /// Bytes for the client, whole events only.
    out: BytesMut,
    resumer: Option<Box<dyn Resume>>,
    resuming: Option<Resuming>,
    /// The node stopped speaking SSE (an event past its size limit): passed on as is, not continued.
    passthrough: bool,
    /// The stream is over; what it ends with once `out` is sent (an error, or a clean end).
    ended: Option<Option<BoxError>>,
    /// When the client was last given an event (or the relay began).
    last_event: Instant,
    /// Counts the request in the metrics when the stream goes.
    pub(super) finish: Option<Guard>,
}

impl Relay {
    /// Relays `piece`, the first node's stream, continuing it through `resumer` when it breaks.
    pub fn new(piece: ProxyBody, splicer: Splicer, resumer: Box<dyn Resume>) -> Relay {
        Relay {
            piece: Box::pin(piece),
            events: Events::new(),
            splicer,
            out: BytesMut::new(),
            resumer: Some(resumer),
            resuming: None,
            passthrough: false,
            ended: None,
            last_event: Instant::now(),
            finish: None,
        }
    }

    pub fn is_end_stream(&self) -> bool {
        self.out.is_empty() && matches!(self.ended, Some(None))
    }

    fn end(&mut self, error: Option<BoxError>) {
        self.ended = Some(error);
        self.piece = Box::pin(ProxyBody::empty());
        self.resumer = None;
    }

    /// The current piece broke (`error`, or `None` for an end before `[DONE]`).
    fn broken(&mut self, error: Option<BoxError>) {
        self.events.clear();
        let why = error.as_ref().map_or_else(
            || "the node ended the stream before [DONE]".to_owned(),
            |e| e.to_string(),
        );
        if self.passthrough || error.as_ref().is_some_and(|e| e.is::<TotalTimeout>()) {
            return self.end(error);
        }
        let after = self.splicer.cut(&mut self.out);
        let Some(mut resumer) = self.resumer.take() else {
            return self.end(error);
        };
        match after {
            AfterCut::Continue(request) => {
                self.piece = Box::pin(ProxyBody::empty());
                let planned = error
                    .as_ref()
                    .and_then(|e| e.downcast_ref::<StreamCut>())
                    .is_some_and(|cut| matches!(cut, StreamCut::Moved));
                let broke = Broke {
                    why,
                    silent: self.last_event.elapsed(),
                    planned,
                };
                self.resuming = Some(resumer.resume(request, broke));
            }
            AfterCut::Complete => {
                resumer.not_continued(None, &why);
                self.end(None);
            }
            AfterCut::Refused(reason) => {
                resumer.not_continued(Some(reason), &why);
                // A node that ended its body cleanly mid-way (before `[DONE]`) must not read to the
                // client as a finished answer: its stream ends as an error too.
                let error = error.unwrap_or_else(|| {
                    format!("the stream broke ({why}) and was not continued: {reason}").into()
                });
                self.end(Some(error));
            }
        }
    }

    pub fn poll_frame(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        loop {
            if !self.out.is_empty() {
                return Poll::Ready(Some(Ok(Frame::data(self.out.split().freeze()))));
            }
            if let Some(ended) = &mut self.ended {
                self.finish = None;
                return Poll::Ready(ended.take().map(Err));
            }
            if let Some(resuming) = &mut self.resuming {
                match resuming.as_mut().poll(cx) {
                    Poll::Ready(Ok((piece, resumer))) => {
                        self.resuming = None;
                        self.piece = Box::pin(piece);
                        self.resumer = Some(resumer);
                        self.splicer.next_piece();
                    }
                    Poll::Ready(Err(error)) => {
                        self.resuming = None;
                        self.end(Some(error));
                    }
                    Poll::Pending => return Poll::Pending,
                }
                continue;
            }
            match self.piece.as_mut().poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => {
                    let Ok(data) = frame.into_data() else {
                        continue; // trailers: an SSE stream has none worth keeping across pieces
                    };
                    if self.passthrough {
                        self.out.extend_from_slice(&data);
                        continue;
                    }
                    self.events.push(&data);
                    while let Some(event) = self.events.next_event() {
                        self.splicer.event(&event, &mut self.out);
                        self.last_event = Instant::now();
                    }
                    if self.events.pending() > MAX_EVENT_BYTES {
                        self.passthrough = true;
                        if let Some(event) = self.events.take() {
                            self.out.extend_from_slice(&event);
                        }
                    }
                }
                // Whatever befalls the connection after `[DONE]`, the client has its whole stream.
                Poll::Ready(Some(Err(_))) if self.splicer.is_done() => self.end(None),
                Poll::Ready(Some(Err(error))) => self.broken(Some(error)),
                Poll::Ready(None) if self.splicer.is_done() || self.passthrough => self.end(None),
                Poll::Ready(None) => self.broken(None),
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}
