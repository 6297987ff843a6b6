//! What the proxy answers when it cannot deliver an endpoint's response.
//!
//! Each error knows its status and renders the same small JSON body, `{"error": "...", "request_id":
//! "..."}`, so clients and logs can be matched up by request id.
//!
//! Two texts per error: the full one (`Display`, for the logs) names the endpoint, and what the client
//! is told ([`ProxyError::client_message`]) says what kind of failure it was but never which endpoint:
//! an endpoint's URL or address is the fleet's inside, not the client's business.

use std::time::Duration;

use http::{HeaderValue, Method, Response, StatusCode, header};

use super::body::ProxyBody;
use super::headers::{X_REQUEST_ID, X_TONGS_REJECT_REASON};
use crate::admission::Refusal;

/// A request the proxy could not complete.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("{detail}")]
    Refused {
        reason: Refusal,
        detail: String,
        /// Seconds until trying again is likely to succeed.
        retry_after: u64,
    },
    #[error("header {header} must be a whole number of milliseconds above zero, got {value:?}")]
    BadDeadline { header: String, value: String },
    #[error("request body is larger than the limit of {limit} bytes")]
    BodyTooLarge { limit: u64 },
    /// A method tongs does not forward (`CONNECT`: it is a reverse proxy, not a tunnel).
    #[error(
        "{method} is not supported: tongs forwards requests to its endpoints, it opens no tunnels"
    )]
    MethodNotAllowed { method: Method },
    #[error("could not connect to endpoint {endpoint}: {detail}")]
    Connect {
        endpoint: String,
        detail: String,
        /// The kind of failure in words for the client, naming no endpoint.
        cause: &'static str,
    },
    #[error("endpoint {endpoint} failed: {detail}")]
    Upstream {
        endpoint: String,
        detail: String,
        /// What went wrong in words for the client, naming no endpoint.
        summary: &'static str,
    },
    /// `after` is the time the attempt was given: `timeouts.response_headers`, or what was left of
    /// the request's deadline if that was less.
    #[error("endpoint {endpoint} sent no response within {}", format_millis(*.after))]
    ResponseTimeout { endpoint: String, after: Duration },
    #[error("endpoint {endpoint} answered {status}")]
    Status { endpoint: String, status: u16 },
    #[error("the request body could not be read: {detail}")]
    ClientBody { detail: String },
    #[error("the request body did not arrive within the total timeout")]
    ClientTooSlow,
}

impl ProxyError {
    pub fn status(&self) -> StatusCode {
        match self {
            ProxyError::Refused { .. } => StatusCode::SERVICE_UNAVAILABLE,
            ProxyError::BadDeadline { .. } => StatusCode::BAD_REQUEST,
            ProxyError::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ProxyError::MethodNotAllowed { .. } => StatusCode::METHOD_NOT_ALLOWED,
            ProxyError::Connect { .. } | ProxyError::Upstream { .. } => StatusCode::BAD_GATEWAY,
            ProxyError::ResponseTimeout { .. } => StatusCode::GATEWAY_TIMEOUT,
            ProxyError::Status { status, .. } => {
                StatusCode::from_u16(*status).unwrap_or(StatusCode::BAD_GATEWAY)
            }
            ProxyError::ClientBody { .. } => StatusCode::BAD_REQUEST,
            ProxyError::ClientTooSlow => StatusCode::REQUEST_TIMEOUT,
        }
    }

    /// What the client is told: the kind of failure, never an endpoint's URL or address (the logs have
    /// those, from `Display`).
    pub fn client_message(&self) -> String {
        match self {
            ProxyError::Connect { cause, .. } => {
                format!("could not connect to an endpoint: {cause}")
            }
            ProxyError::Upstream { summary, .. } => (*summary).to_owned(),
            ProxyError::ResponseTimeout { after, .. } => format!(
                "the endpoint sent no response within {}",
                format_millis(*after)
            ),
            ProxyError::Status { status, .. } => format!("the endpoint answered {status}"),
            // These name no endpoint.
            ProxyError::Refused { .. }
            | ProxyError::BadDeadline { .. }
            | ProxyError::BodyTooLarge { .. }
            | ProxyError::MethodNotAllowed { .. }
            | ProxyError::ClientBody { .. }
            | ProxyError::ClientTooSlow => self.to_string(),
        }
    }

    /// The response a client sees.
    pub fn into_response(self, request_id: &HeaderValue) -> Response<ProxyBody> {
        let mut body = serde_json::json!({
            "error": self.client_message(),
            "request_id": request_id.to_str().unwrap_or_default(),
        });
        if let ProxyError::Refused {
            reason,
            retry_after,
            ..
        } = &self
        {
            body["reason"] = reason.as_str().into();
            body["retry_after_seconds"] = (*retry_after).into();
        }
        let mut response = Response::new(ProxyBody::full(body.to_string()));
        *response.status_mut() = self.status();
        let headers = response.headers_mut();
        if let ProxyError::Refused {
            reason,
            retry_after,
            ..
        } = &self
        {
            headers.insert(
                &X_TONGS_REJECT_REASON,
                HeaderValue::from_static(reason.as_str()),
            );
            headers.insert(header::RETRY_AFTER, HeaderValue::from(*retry_after));
        }
        if let ProxyError::MethodNotAllowed { .. } = &self {
            headers.insert(header::ALLOW, HeaderValue::from_static(FORWARDED_METHODS));
        }
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        headers.insert(&X_REQUEST_ID, request_id.clone());
        response
    }
}

/// The standard methods tongs forwards (any but `CONNECT`), for `Allow` on a 405.
const FORWARDED_METHODS: &str = "GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS, TRACE";

/// A duration to the millisecond (a deadline's remainder would otherwise print to the nanosecond).
fn format_millis(duration: Duration) -> humantime::FormattedDuration {
    let millis = duration.as_micros().saturating_add(500) / 1000;
    humantime::format_duration(Duration::from_millis(
        u64::try_from(millis).unwrap_or(u64::MAX),
    ))
}

/// Full description of an error and its causes, for logs (a client is told less: see
/// [`ProxyError::client_message`]).
pub fn describe(err: &(dyn std::error::Error + 'static)) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_match_the_failure() {
        assert_eq!(refused().status(), 503);
        assert_eq!(ProxyError::BodyTooLarge { limit: 1 }.status(), 413);
        let connect = ProxyError::Connect {
            endpoint: "http://a".into(),
            detail: "refused".into(),
            cause: "connection refused",
        };
        assert_eq!(connect.status(), 502);
        let timeout = ProxyError::ResponseTimeout {
            endpoint: "http://a".into(),
            after: Duration::from_secs(2),
        };
        assert_eq!(timeout.status(), 504);
        assert!(timeout.to_string().contains("2s"));
        let odd = ProxyError::ResponseTimeout {
            endpoint: "http://a".into(),
            // A deadline's remainder, not a round number.
            after: Duration::from_nanos(1_499_999_999),
        };
        assert!(odd.to_string().ends_with("within 1s 500ms"), "{odd}");
        let connect = ProxyError::MethodNotAllowed {
            method: Method::CONNECT,
        };
        assert_eq!(connect.status(), 405);
    }

    #[tokio::test]
    async fn clients_are_told_the_failure_but_not_the_endpoint() {
        let endpoint = "http://10.0.0.7:8000";
        let errors = [
            ProxyError::Connect {
                endpoint: endpoint.into(),
                detail: "tcp connect error: Connection refused".into(),
                cause: "connection refused",
            },
            ProxyError::Upstream {
                endpoint: endpoint.into(),
                detail: "through tailscaled's proxy to 10.0.0.7:8000".into(),
                summary: "the endpoint broke the connection before its response",
            },
            ProxyError::ResponseTimeout {
                endpoint: endpoint.into(),
                after: Duration::from_millis(1500),
            },
            ProxyError::Status {
                endpoint: endpoint.into(),
                status: 502,
            },
        ];
        for error in errors {
            assert!(
                error.to_string().contains(endpoint),
                "logs name it: {error}"
            );
            let message = error.client_message();
            assert!(!message.contains("10.0.0.7"), "{message}");
            let response = error.into_response(&HeaderValue::from_static("rid-2"));
            let body = http_body_util::BodyExt::collect(response.into_body())
                .await
                .unwrap()
                .to_bytes();
            let body = String::from_utf8_lossy(&body);
            assert!(body.contains(&message), "{body}");
            assert!(!body.contains("10.0.0.7"), "{body}");
        }
        let timeout = ProxyError::ResponseTimeout {
            endpoint: endpoint.into(),
            // A deadline's remainder, not a round number.
            after: Duration::from_nanos(1_499_999_999),
        };
        assert_eq!(
            timeout.client_message(),
            "the endpoint sent no response within 1s 500ms"
        );
    }

    #[test]
    fn connect_gets_405_with_allow() {
        let response = ProxyError::MethodNotAllowed {
            method: Method::CONNECT,
        }
        .into_response(&HeaderValue::from_static("rid-3"));
        assert_eq!(response.status(), 405);
        let allow = response.headers()["allow"].to_str().unwrap();
        assert!(allow.starts_with("GET, HEAD, POST"), "{allow}");
        assert!(!allow.contains("CONNECT"), "{allow}");
    }

    #[test]
    fn renders_json_with_the_request_id() {
        let response = refused().into_response(&HeaderValue::from_static("rid-1"));
        assert_eq!(response.status(), 503);
        assert_eq!(response.headers()["x-request-id"], "rid-1");
        assert_eq!(response.headers()["content-type"], "application/json");
        assert_eq!(response.headers()["x-tongs-reject-reason"], "queue-full");
        assert_eq!(response.headers()["retry-after"], "7");
    }

    fn refused() -> ProxyError {
        ProxyError::Refused {
            reason: Refusal::QueueFull,
            detail: "the queue is full".into(),
            retry_after: 7,
        }
    }
}
