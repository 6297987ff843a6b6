//! Answering the client: an endpoint's committed response (streamed, or an upgraded connection), the
//! last failure, or tongs' own refusal.

use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Response, StatusCode};
use http_body::Frame;
use hyper_util::rt::TokioIo;
use std::sync::atomic::Ordering;
use tokio::time::Instant;

use super::attempt::{Committed, Failure, Probe};
use super::{Proxy, ProxySettings};
use crate::admission::Refusal;
use crate::endpoint::Outstanding;
use crate::http::headers::{self, X_REQUEST_ID};
use crate::http::{ProxyBody, ProxyError};
use crate::upstream::ResponseBody;

/// An endpoint's body and what came with it: the first frame (read before commit), the endpoint's slot,
/// and how long the answer took to start.
pub(super) struct Piece {
    pub first: Option<Frame<Bytes>>,
    pub body: ResponseBody,
    pub outstanding: Outstanding,
    pub first_byte: Option<Duration>,
    /// A cut would be continued elsewhere (its idle floor is `continuation.idle_min`).
    pub continuable: bool,
    /// The breaker's half-open probe, judged by this body.
    pub probe: Option<Probe>,
    /// The request's body, bytes (its prompt: a longer one prefills longer).
    pub prompt_bytes: u64,
}

impl Proxy {
    /// Hands a committed response to the client: its first frame, then the rest as it streams.
    pub(super) fn commit(
        &self,
        settings: &ProxySettings,
        committed: Committed,
        client_upgrade: Option<hyper::upgrade::OnUpgrade>,
        (request_id, deadline, continuable, prompt_bytes): (&HeaderValue, Instant, bool, u64),
    ) -> Response<ProxyBody> {
        let Committed {
            mut response,
            first,
            outstanding,
            first_byte,
            span,
            probe,
        } = committed;
        if response.status() == StatusCode::SWITCHING_PROTOCOLS
            && let Some(client_upgrade) = client_upgrade
        {
            let upstream_upgrade = hyper::upgrade::on(&mut response);
            self.bridge_upgrade(client_upgrade, upstream_upgrade, outstanding, request_id);
            let (mut parts, _) = response.into_parts();
            headers::strip_hop_by_hop(&mut parts.headers, true);
            parts.headers.insert(&X_REQUEST_ID, request_id.clone());
            return Response::from_parts(parts, ProxyBody::empty());
        }
        let (mut parts, body) = response.into_parts();
        headers::strip_hop_by_hop(&mut parts.headers, false);
        parts.headers.insert(&X_REQUEST_ID, request_id.clone());
        let piece = Piece {
            first,
            body,
            outstanding,
            first_byte,
            continuable,
            probe,
            prompt_bytes,
        };
        let mut body = self.streamed(settings, piece, deadline, request_id);
        if let Some(span) = span {
            // The attempt's span ends with its answer's body.
            let _ = body.on_end(Box::new(span));
        }
        Response::from_parts(parts, body)
    }

    /// An endpoint's body as the client gets it: watched for stalls and a gone endpoint, ended at the
    /// request's deadline, holding the endpoint's slot until it ends.
    pub(super) fn streamed(
        &self,
        settings: &ProxySettings,
        piece: Piece,
        deadline: Instant,
        request_id: &HeaderValue,
    ) -> ProxyBody {
        let Piece {
            first,
            body,
            outstanding,
            first_byte,
            continuable,
            probe,
            prompt_bytes,
        } = piece;
        ProxyBody::upstream(
            first,
            body,
            super::stream::watch(
                settings,
                outstanding,
                (first_byte, continuable, probe, prompt_bytes),
                &self.registry,
                &self.stats,
                request_id,
            ),
            tokio::time::sleep_until(deadline),
            settings.total_timeout,
        )
    }

    /// Answers with the last failure: the endpoint's own response when it gave one, else tongs' error.
    /// A node's or gateway's 502, 503, 504 or 524 passes on only as JSON: any other body (the
    /// SaladCloud gateway's is an HTML page) is dropped for tongs' own JSON error with its status, and
    /// the node's `Retry-After` if it sent one.
    pub(super) fn fail(
        &self,
        settings: &ProxySettings,
        failure: Failure,
        request_id: &HeaderValue,
        deadline: Instant,
    ) -> Response<ProxyBody> {
        self.stats.failed.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(
            request_id = request_id.to_str().unwrap_or_default(),
            endpoint = failure.endpoint.url(),
            reason = failure.kind.as_str(),
            error = %failure.error,
            "request failed"
        );
        match failure.response {
            Some((response, outstanding)) if !passes_on(&response) => {
                let retry_after = response.headers().get(header::RETRY_AFTER).cloned();
                // Its connection is closed with the unread body, and its slot freed.
                drop((response, outstanding));
                let mut answer = failure.error.into_response(request_id);
                if let Some(retry_after) = retry_after {
                    answer
                        .headers_mut()
                        .insert(header::RETRY_AFTER, retry_after);
                }
                answer
            }
            Some((response, outstanding)) => {
                let committed = Committed {
                    response,
                    first: None,
                    outstanding,
                    first_byte: None,
                    span: None,
                    probe: None,
                };
                self.commit(settings, committed, None, (request_id, deadline, false, 0))
            }
            None => failure.error.into_response(request_id),
        }
    }

    /// Refuses a request tongs could not place: 503 with the reason and a `Retry-After` from how fast
    /// the queue drains.
    pub(super) fn refuse(&self, reason: Refusal, request_id: &HeaderValue) -> Response<ProxyBody> {
        let queue = &self.queue;
        queue.count_rejection(reason);
        self.stats.rejected.fetch_add(1, Ordering::Relaxed);
        let settings = queue.settings();
        let detail = match reason {
            Refusal::QueueFull => format!(
                "every endpoint is busy and the queue is full ({} waiting), or would not reach this \
                 request within the wait allowed at the rate it drains",
                queue.len()
            ),
            Refusal::QueueTimeout => format!(
                "no endpoint freed up within the wait allowed (queue.max_wait {}, or the request's deadline)",
                humantime::format_duration(settings.max_wait)
            ),
            Refusal::Overloaded => format!(
                "the fleet is overloaded: the queue has stood above queue.target_wait ({}) and would \
                 have kept this request longer",
                humantime::format_duration(settings.target.wait)
            ),
            Refusal::NoEndpoints => "no endpoint is available".to_owned(),
            Refusal::ShedLowPriority => {
                "low-priority request shed while the queue is congested".to_owned()
            }
            Refusal::TenantQueueFull => {
                "this API key's tenant has as many requests waiting as it may (max_queued)"
                    .to_owned()
            }
            Refusal::TenantInFlight => {
                "this API key's tenant has as many requests in progress as it may (max_in_flight)"
                    .to_owned()
            }
        };
        let error = ProxyError::Refused {
            reason,
            detail,
            retry_after: queue.retry_after(),
        };
        self.reject(error, request_id)
    }

    /// Answers a request tongs could not send anywhere.
    pub(super) fn reject(
        &self,
        error: ProxyError,
        request_id: &HeaderValue,
    ) -> Response<ProxyBody> {
        reject(error, request_id)
    }

    /// Copies bytes both ways between the client and the endpoint once both sides switched protocols.
    fn bridge_upgrade(
        &self,
        client: hyper::upgrade::OnUpgrade,
        upstream: hyper::upgrade::OnUpgrade,
        outstanding: Outstanding,
        request_id: &HeaderValue,
    ) {
        let request_id = request_id.to_str().unwrap_or_default().to_owned();
        self.upgrades.spawn(async move {
            let (client, upstream) = match tokio::try_join!(client, upstream) {
                Ok(both) => both,
                Err(err) => {
                    tracing::warn!(request_id, error = %err, "protocol upgrade failed");
                    return;
                }
            };
            let mut client = TokioIo::new(client);
            let mut upstream = TokioIo::new(upstream);
            match tokio::io::copy_bidirectional(&mut client, &mut upstream).await {
                Ok((sent, received)) => {
                    tracing::debug!(request_id, sent, received, "upgraded connection closed");
                }
                Err(err) => tracing::debug!(request_id, error = %err, "upgraded connection ended"),
            }
            drop(outstanding);
        });
    }
}

/// Whether a failed attempt's answer reaches the client as the node gave it: any but a 502, 503, 504
/// or 524, and those when JSON (`application/json`, or any `+json` type such as
/// `application/problem+json`), which an OpenAI client can read as an error.
fn passes_on<B>(response: &Response<B>) -> bool {
    if !matches!(response.status().as_u16(), 502 | 503 | 504 | 524) {
        return true;
    }
    let Some(content_type) = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
    else {
        return false;
    };
    let essence = content_type
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    essence == "application/json"
        || essence
            .split_once('/')
            .is_some_and(|(_, subtype)| subtype.ends_with("+json"))
}

/// Answers a request tongs could not send anywhere, and logs why.
pub(super) fn reject(error: ProxyError, request_id: &HeaderValue) -> Response<ProxyBody> {
    tracing::warn!(
        request_id = request_id.to_str().unwrap_or_default(),
        status = error.status().as_u16(),
        error = %error,
        "request refused"
    );
    error.into_response(request_id)
}
