//! The response body handed to clients.
//!
//! An endpoint's body is streamed frame by frame as it arrives (Server-Sent Events reach the client as
//! the endpoint emits them). The body carries the request's guards (the endpoint's in-flight count, the
//! request's metrics), so the endpoint counts the request as in flight until the body has ended, failed,
//! hit the overall deadline, or was dropped because the client went away — and dropping it drops the
//! endpoint's body too, which closes that upstream stream and so frees the GPU.
//!
//! A stream that stalls after commit — silent past what its guard allows, or its endpoint declared
//! gone — is ended by tongs as an error the client can see, and the request path is told why
//! ([`StreamGuard`]). The body only times silences; whether one is a stall is the guard's call.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use tokio::time::{Instant, Sleep};

use super::pool::ResponseBody;
use super::relay::Relay;

/// Any error a body or a connection can carry.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Whatever the request path keeps alive while a streamed answer runs; dropped when the stream ends,
/// fails or hits its deadline, or when the client goes away. Opaque here, so the HTTP layer depends on
/// nothing above it.
pub type Guard = Box<dyn Send>;

/// What the request path holds while an endpoint's answer streams (dropped when it ends), and is told
/// as the stream goes.
pub trait StreamGuard: Send {
    /// A data chunk arrived (any after the first, which came with the answer; SSE keep-alive comments
    /// are no progress and are not reported), after tongs had waited `waited` for it (`None`: it was already there when asked for, which says nothing of the node's
    /// pace; time the client was not reading never counts). Returns how long the stream may now stay
    /// silent before the guard is asked what the silence means (`None`: no limit).
    fn chunk(&mut self, waited: Option<Duration>) -> Option<Duration>;
    /// The stream has been silent since `since` (tongs waiting for the endpoint all along) past the
    /// limit the guard last gave: cut it, or wait on.
    fn silent(&mut self, since: Instant) -> Silence {
        Silence::Cut(Cut::Idle(since.elapsed()))
    }
    /// tongs is ending the stream with an error: the guard called its silence a stall or too long a
    /// pause, or its endpoint was declared gone.
    fn cut(&mut self, why: Cut);
    /// The endpoint's body ended by itself: whole (`complete`), or broken by an error.
    fn end(&mut self, complete: bool) {
        let _ = complete;
    }
    /// The signal that the endpoint is gone, asked for once, when the stream first has to wait for
    /// its endpoint: most answers arrive whole, and never need it (`None`: no such signal).
    fn gone(&mut self) -> Option<GoneSignal> {
        None
    }
}

/// What a stream's silence past its limit means.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Silence {
    /// Wait on, and ask again at this moment (if the stream is still silent then).
    Until(Instant),
    /// End the stream.
    Cut(Cut),
}

/// Why tongs ended a committed stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cut {
    /// Nothing arrived for this long, the stream's idle limit, while its node was silent too.
    Idle(Duration),
    /// Nothing arrived for this long while its node went on sending on its other streams: a pause
    /// past `stream.pause_max`.
    Paused(Duration),
    /// The endpoint was declared gone (heartbeats) or stalled while the stream ran.
    Gone,
    /// The endpoint's node said it is going, and the stream, which can be continued elsewhere, moves
    /// before the node does.
    Moved,
}

/// Resolves when the stream must leave its endpoint: declared gone ([`Cut::Gone`]), or about to go
/// by its node's own word ([`Cut::Moved`]).
pub type GoneSignal = Pin<Box<dyn Future<Output = Cut> + Send>>;

/// How a committed stream is watched: its guard, and its idle limit so far.
pub struct Watch {
    pub guard: Box<dyn StreamGuard>,
    pub idle: Option<Duration>,
}

/// The error a client's stream ends with when tongs cuts it.
#[derive(Debug, thiserror::Error)]
pub enum StreamCut {
    #[error("the endpoint sent nothing for {} and is taken for failed", humantime::format_duration(*.0))]
    Idle(Duration),
    #[error("the stream sent nothing for {} while its endpoint went on with others; given up on", humantime::format_duration(*.0))]
    Paused(Duration),
    #[error("the endpoint was declared gone while the response streamed")]
    Gone,
    #[error("the endpoint's node said it is going; the stream moves before it does")]
    Moved,
}

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
            body: ResponseBody,
            // Fires at the request's overall deadline.
            #[pin]
            deadline: Sleep,
            total: Duration,
            // Fires when the stream has been silent past its idle limit (or the moment its guard
            // asked to be asked again).
            #[pin]
            idle: Sleep,
            idle_limit: Option<Duration>,
            // Since when tongs has waited for the endpoint's next frame (`None`: it has not since the
            // last one). Only tongs' own wait counts: while a slow client is not reading, hyper does not
            // poll the body, and that time is not the endpoint's silence.
            waiting: Option<Instant>,
            // Resolves when the endpoint is declared gone; asked of the guard the first time the
            // stream waits (`armed`).
            gone: Option<GoneSignal>,
            armed: bool,
            // `None` once the stream has ended: what it holds (the endpoint's in-flight count) goes right there.
            held: Option<Box<dyn StreamGuard>>,
            // Counts the request in the metrics when the body goes.
            finish: Option<Guard>,
        },
        Full {
            data: Option<Bytes>,
        },
        // A continuable OpenAI stream, relayed piece by piece.
        Relay {
            relay: Box<Relay>,
        },
    }
}

/// The endpoint's body did not finish before the request's overall deadline.
#[derive(Debug, thiserror::Error)]
#[error("response body not finished within the total timeout of {}", humantime::format_duration(*.0))]
pub struct TotalTimeout(pub Duration);

impl ProxyBody {
    /// Streams an endpoint's body (after `first`, a frame already read), watched by `watch` until it
    /// ends.
    pub fn upstream(
        first: Option<Frame<Bytes>>,
        body: ResponseBody,
        watch: Watch,
        deadline: Sleep,
        total: Duration,
    ) -> Self {
        ProxyBody {
            kind: Kind::Upstream {
                first,
                body,
                deadline,
                total,
                idle: tokio::time::sleep_until(idle_until(Instant::now(), watch.idle)),
                idle_limit: watch.idle,
                waiting: None,
                gone: None,
                armed: false,
                held: Some(watch.guard),
                finish: None,
            },
        }
    }

    /// A complete body made by tongs (error messages, admin answers).
    /// Hands `finish` to a streamed body, to drop when the body goes (after any it holds already);
    /// gives it back for any other body.
    pub fn on_end(&mut self, finish: Guard) -> Result<(), Guard> {
        let slot = match &mut self.kind {
            Kind::Upstream { finish: slot, .. } => slot,
            Kind::Relay { relay } => &mut relay.finish,
            Kind::Full { .. } => return Err(finish),
        };
        *slot = Some(match slot.take() {
            // A pair drops its first member first.
            Some(held) => Box::new((held, finish)),
            None => finish,
        });
        Ok(())
    }

    /// A stream relayed by [`Relay`], continued on another endpoint when its node breaks.
    pub fn relay(relay: Relay) -> Self {
        ProxyBody {
            kind: Kind::Relay {
                relay: Box::new(relay),
            },
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

/// When a stream last heard from at `from` becomes idle (far in the future without a limit).
fn idle_until(from: Instant, limit: Option<Duration>) -> Instant {
    from + limit.unwrap_or(Duration::from_secs(86_400 * 365))
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
                mut body,
                deadline,
                total,
                mut idle,
                idle_limit,
                waiting,
                gone,
                armed,
                held,
                finish,
            } => {
                if let Some(frame) = first.take() {
                    return Poll::Ready(Some(Ok(frame)));
                }
                let Some(guard) = held.as_mut() else {
                    return Poll::Ready(None);
                };
                let ended = |held: &mut Option<Box<dyn StreamGuard>>,
                             finish: &mut Option<Guard>| {
                    *held = None;
                    *finish = None;
                };
                match body.as_mut().poll_frame(cx) {
                    Poll::Ready(Some(Ok(frame))) => {
                        // A keep-alive comment is no progress: the silence goes on. A frame that was
                        // there when asked for says nothing of the endpoint's pace.
                        if let Some(data) = frame.data_ref()
                            && !crate::openai::sse::is_keep_alive(data)
                        {
                            let waited = waiting.take().map(|since| since.elapsed());
                            *idle_limit = guard.chunk(waited);
                        }
                        // hyper stops polling a body that says it has ended, so its end is told here.
                        if body.is_end_stream() {
                            guard.end(true);
                        }
                        return Poll::Ready(Some(Ok(frame)));
                    }
                    Poll::Ready(Some(Err(err))) => {
                        guard.end(false);
                        ended(held, finish);
                        return Poll::Ready(Some(Err(err.into())));
                    }
                    Poll::Ready(None) => {
                        guard.end(true);
                        ended(held, finish);
                        return Poll::Ready(None);
                    }
                    Poll::Pending => {
                        if waiting.is_none() {
                            let now = Instant::now();
                            *waiting = Some(now);
                            idle.as_mut().reset(idle_until(now, *idle_limit));
                        }
                        if !*armed {
                            *armed = true;
                            *gone = guard.gone();
                        }
                    }
                }
                if deadline.poll(cx).is_ready() {
                    ended(held, finish);
                    return Poll::Ready(Some(Err(TotalTimeout(*total).into())));
                }
                let mut cut = None;
                if idle_limit.is_some() {
                    while idle.as_mut().poll(cx).is_ready() {
                        let since = waiting.unwrap_or_else(Instant::now);
                        match guard.silent(since) {
                            // Never in the past, or this would spin.
                            Silence::Until(at) => idle
                                .as_mut()
                                .reset(at.max(Instant::now() + Duration::from_millis(1))),
                            Silence::Cut(why) => {
                                cut = Some(why);
                                break;
                            }
                        }
                    }
                }
                if cut.is_none()
                    && let Some(signal) = gone.as_mut()
                    && let Poll::Ready(why) = signal.as_mut().poll(cx)
                {
                    cut = Some(why);
                }
                match cut {
                    Some(why) => {
                        guard.cut(why);
                        ended(held, finish);
                        let error = match why {
                            Cut::Idle(silent) => StreamCut::Idle(silent),
                            Cut::Paused(silent) => StreamCut::Paused(silent),
                            Cut::Gone => StreamCut::Gone,
                            Cut::Moved => StreamCut::Moved,
                        };
                        Poll::Ready(Some(Err(error.into())))
                    }
                    None => Poll::Pending,
                }
            }
            KindProj::Full { data } => Poll::Ready(data.take().map(|d| Ok(Frame::data(d)))),
            KindProj::Relay { relay } => relay.poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Upstream {
                first, body, held, ..
            } => first.is_none() && (held.is_none() || body.is_end_stream()),
            Kind::Full { data } => data.is_none(),
            Kind::Relay { relay } => relay.is_end_stream(),
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
            Kind::Relay { .. } => SizeHint::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use http_body_util::channel::{Channel, Sender};
    use hyper::body::Incoming;
    use hyper::service::service_fn;
    use hyper_util::rt::TokioIo;

    use super::*;

    /// The body's next frame (the body is not `Unpin`, so `BodyExt::frame` does not apply).
    async fn next_frame(mut body: Pin<&mut ProxyBody>) -> Option<Result<Frame<Bytes>, BoxError>> {
        std::future::poll_fn(|cx| body.as_mut().poll_frame(cx)).await
    }

    /// Records the gaps it is told of; the idle limit is always 2 s.
    struct Gaps(Arc<Mutex<Vec<Duration>>>);

    impl StreamGuard for Gaps {
        fn chunk(&mut self, waited: Option<Duration>) -> Option<Duration> {
            if let Some(gap) = waited {
                self.0.lock().unwrap().push(gap);
            }
            Some(Duration::from_secs(2))
        }

        fn cut(&mut self, _why: Cut) {}
    }

    /// An endpoint's streamed body over a real HTTP/1.1 connection (in memory), and the sender that
    /// feeds it.
    async fn upstream() -> (ResponseBody, Sender<Bytes, BoxError>) {
        let (client, server) = tokio::io::duplex(64 * 1024);
        let (sender, body) = Channel::<Bytes, BoxError>::new(1);
        let body = Mutex::new(Some(body));
        tokio::spawn(async move {
            let service = service_fn(move |_request: http::Request<Incoming>| {
                let body = body.lock().unwrap().take().expect("one request");
                async move { Ok::<_, std::convert::Infallible>(http::Response::new(body)) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(server), service)
                .await;
        });
        let (mut request, connection) = hyper::client::conn::http1::handshake::<
            _,
            http_body_util::Empty<Bytes>,
        >(TokioIo::new(client))
        .await
        .unwrap();
        tokio::spawn(connection);
        let response = request
            .send_request(http::Request::new(http_body_util::Empty::new()))
            .await
            .unwrap();
        (response.into_body().into(), sender)
    }

    #[tokio::test(start_paused = true)]
    async fn time_the_client_spends_not_reading_is_not_the_endpoints_silence() {
        let (incoming, mut sender) = upstream().await;
        let gaps = Arc::new(Mutex::new(Vec::new()));
        let watch = Watch {
            guard: Box::new(Gaps(Arc::clone(&gaps))),
            idle: Some(Duration::from_secs(2)),
        };
        let deadline = tokio::time::sleep(Duration::from_secs(3600));
        let mut body = std::pin::pin!(ProxyBody::upstream(
            None,
            incoming,
            watch,
            deadline,
            Duration::from_secs(3600),
        ));

        sender.send_data(Bytes::from_static(b"a")).await.unwrap();
        let frame = next_frame(body.as_mut()).await.unwrap().unwrap();
        assert_eq!(frame.into_data().unwrap(), "a");
        // The client reads nothing for 5 s, well past the 2 s idle limit; the endpoint is quiet too.
        tokio::time::advance(Duration::from_secs(5)).await;
        // Asked again, the endpoint has nothing yet: tongs' wait starts now, so this is not a stall.
        let next =
            tokio::time::timeout(Duration::from_millis(500), next_frame(body.as_mut())).await;
        assert!(next.is_err(), "still waiting, not cut: {next:?}");
        sender.send_data(Bytes::from_static(b"b")).await.unwrap();
        let frame = next_frame(body.as_mut()).await.unwrap().unwrap();
        assert_eq!(frame.into_data().unwrap(), "b");
        // ("a" may have been there when first asked for, which reports no gap.)
        let gaps = gaps.lock().unwrap().clone();
        let last = gaps.last().expect("tongs waited for \"b\"");
        assert!(
            *last < Duration::from_secs(1),
            "the gap is tongs' own wait, not the client's 5 s: {gaps:?}"
        );

        // Silent past its limit while tongs waits: cut.
        let cut = next_frame(body.as_mut()).await.unwrap();
        let error = cut.expect_err("cut after 2 s of silence");
        assert!(error.is::<StreamCut>(), "{error}");
    }
}
