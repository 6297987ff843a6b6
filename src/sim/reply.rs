//! The bodies a simulated node answers with: a whole body at once, or a stream of events written as
//! they are produced.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Response, StatusCode, header};
use http_body::Frame;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use tokio::sync::mpsc;

use crate::http::BoxError;

pub(super) type SimBody = BoxBody<Bytes, BoxError>;

/// A response of `status` whose whole body is `body`.
pub(super) fn full(
    status: StatusCode,
    content_type: &'static str,
    body: impl Into<Bytes>,
) -> Response<SimBody> {
    let mut response = Response::new(
        Full::new(body.into())
            .map_err(|never| match never {})
            .boxed(),
    );
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static(content_type),
    );
    response
}

/// A Server-Sent Events response around `body`, with the headers an inference server sends.
pub fn sse_response<B>(body: B) -> Response<B> {
    let mut response = Response::new(body);
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("text/event-stream"),
    );
    headers.insert(
        header::CACHE_CONTROL,
        header::HeaderValue::from_static("no-cache"),
    );
    response
}

/// A streamed body fed by a channel of one event at a time: each event is one body frame, and
/// dropping the sender ends the body cleanly.
///
/// The sender sees the client leave ([`mpsc::Sender::closed`]) even while it sends nothing, which a
/// stream held open on purpose needs, and it can wait for the last event to be taken by the server
/// ([`mpsc::Sender::reserve`]) before breaking the connection under it.
pub(super) struct EventFeed(mpsc::Receiver<Bytes>);

impl EventFeed {
    pub(super) fn new() -> (mpsc::Sender<Bytes>, EventFeed) {
        let (sender, receiver) = mpsc::channel(1);
        (sender, EventFeed(receiver))
    }
}

impl http_body::Body for EventFeed {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.0
            .poll_recv(cx)
            .map(|event| event.map(|bytes| Ok(Frame::data(bytes))))
    }
}
