//! What the proxy answers when it cannot deliver an endpoint's response.
//!
//! Each error knows its status and renders the same small JSON body, `{"error": "...", "request_id":
//! "..."}`, so clients and logs can be matched up by request id. The response carries what it says as
//! an [`OwnError`] extension, so an edge can render it again in another shape: [`openai_shape`] writes
//! OpenAI's, `{"error": {"message", "type", "param", "code"}, "request_id"}`.
//!
//! Two texts per error: the full one (`Display`, for the logs) names the endpoint, and what the client
//! is told ([`ProxyError::client_message`]) says what kind of failure it was but never which endpoint:
//! an endpoint's URL or address is the fleet's inside, not the client's business.

use std::borrow::Cow;
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
    #[error("request head ({size} bytes) is larger than the limit of {limit} bytes")]
    HeadTooLarge { size: usize, limit: usize },
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
    /// The request names a model no pool serves.
    #[error("the model `{}` does not exist", shown(.model))]
    ModelNotFound { model: String },
    /// No pool serves the request (by its path, or its model when it names none).
    #[error("no pool serves this request")]
    NoRoute,
    /// Inbound API keys are on (`auth.keys_file`) and the request presented none, or an unknown one.
    #[error("{detail}")]
    Unauthorized { detail: &'static str },
}

impl ProxyError {
    pub fn status(&self) -> StatusCode {
        match self {
            ProxyError::Refused { reason, .. } if reason.is_tenant_cap() => {
                StatusCode::TOO_MANY_REQUESTS
            }
            ProxyError::Refused { .. } => StatusCode::SERVICE_UNAVAILABLE,
            ProxyError::Unauthorized { .. } => StatusCode::UNAUTHORIZED,
            ProxyError::BadDeadline { .. } => StatusCode::BAD_REQUEST,
            ProxyError::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ProxyError::HeadTooLarge { .. } => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            ProxyError::MethodNotAllowed { .. } => StatusCode::METHOD_NOT_ALLOWED,
            ProxyError::Connect { .. } | ProxyError::Upstream { .. } => StatusCode::BAD_GATEWAY,
            ProxyError::ResponseTimeout { .. } => StatusCode::GATEWAY_TIMEOUT,
            ProxyError::Status { status, .. } => {
                StatusCode::from_u16(*status).unwrap_or(StatusCode::BAD_GATEWAY)
            }
            ProxyError::ClientBody { .. } => StatusCode::BAD_REQUEST,
            ProxyError::ClientTooSlow => StatusCode::REQUEST_TIMEOUT,
            ProxyError::ModelNotFound { .. } | ProxyError::NoRoute => StatusCode::NOT_FOUND,
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
            | ProxyError::HeadTooLarge { .. }
            | ProxyError::MethodNotAllowed { .. }
            | ProxyError::ClientBody { .. }
            | ProxyError::ClientTooSlow
            | ProxyError::ModelNotFound { .. }
            | ProxyError::NoRoute
            | ProxyError::Unauthorized { .. } => self.to_string(),
        }
    }

    /// What the response tells the client, in every shape tongs can render it.
    pub fn own_error(&self, request_id: &HeaderValue) -> OwnError {
        let status = self.status();
        let (reason, retry_after) = match self {
            ProxyError::Refused {
                reason,
                retry_after,
                ..
            } => (Some(*reason), Some(*retry_after)),
            _ => (None, None),
        };
        OwnError {
            status,
            message: self.client_message(),
            error_type: openai_type(status),
            code: self.openai_code(),
            param: match self {
                ProxyError::ModelNotFound { .. } => Some("model"),
                _ => None,
            },
            reason,
            retry_after,
            request_id: request_id.to_str().unwrap_or_default().to_owned(),
        }
    }

    /// OpenAI's `code`: the failure in one word a program can match, where there is one.
    fn openai_code(&self) -> Option<&'static str> {
        match self {
            ProxyError::Refused {
                reason: Refusal::NoEndpoints,
                ..
            } => Some("service_unavailable"),
            ProxyError::Refused { reason, .. } if reason.is_tenant_cap() => {
                Some("rate_limit_exceeded")
            }
            ProxyError::Refused { .. } => Some("server_is_overloaded"),
            ProxyError::Unauthorized { .. } => Some("invalid_api_key"),
            ProxyError::BadDeadline { .. } => Some("invalid_header"),
            ProxyError::BodyTooLarge { .. } => Some("request_too_large"),
            ProxyError::HeadTooLarge { .. } => Some("request_header_fields_too_large"),
            ProxyError::MethodNotAllowed { .. } => Some("method_not_allowed"),
            ProxyError::Connect { .. } | ProxyError::Upstream { .. } => Some("bad_gateway"),
            ProxyError::ResponseTimeout { .. } => Some("gateway_timeout"),
            ProxyError::Status { status, .. } => node_status_code(*status),
            ProxyError::ClientBody { .. } => Some("invalid_body"),
            ProxyError::ClientTooSlow => Some("request_timeout"),
            ProxyError::ModelNotFound { .. } => Some("model_not_found"),
            // OpenAI's own answer to a path it does not serve has no code.
            ProxyError::NoRoute => None,
        }
    }

    /// The response a client sees, carrying its [`OwnError`].
    pub fn into_response(self, request_id: &HeaderValue) -> Response<ProxyBody> {
        let own = self.own_error(request_id);
        let mut body = serde_json::json!({
            "error": own.message,
            "request_id": own.request_id,
        });
        if let (Some(reason), Some(retry_after)) = (own.reason, own.retry_after) {
            body["reason"] = reason.as_str().into();
            body["retry_after_seconds"] = retry_after.into();
        }
        let mut response = Response::new(ProxyBody::full(body.to_string()));
        *response.status_mut() = own.status;
        let headers = response.headers_mut();
        if let Some(reason) = own.reason {
            headers.insert(
                &X_TONGS_REJECT_REASON,
                HeaderValue::from_static(reason.as_str()),
            );
        }
        if let Some(retry_after) = own.retry_after {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(retry_after));
        }
        if let ProxyError::MethodNotAllowed { .. } = &self {
            headers.insert(header::ALLOW, HeaderValue::from_static(FORWARDED_METHODS));
        }
        if let ProxyError::Unauthorized { .. } = &self {
            headers.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        headers.insert(&X_REQUEST_ID, request_id.clone());
        response.extensions_mut().insert(own);
        response
    }
}

/// What one of tongs' own error answers says, kept on the response (an extension) so that it can be
/// rendered again in another shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OwnError {
    pub status: StatusCode,
    /// What the client is told ([`ProxyError::client_message`]).
    pub message: String,
    /// OpenAI's `type`: `invalid_request_error`, `rate_limit_error` or `server_error`.
    pub error_type: &'static str,
    /// OpenAI's `code`, e.g. `model_not_found`.
    pub code: Option<&'static str>,
    /// OpenAI's `param`: the request field at fault, e.g. `model`.
    pub param: Option<&'static str>,
    /// Why tongs refused the request, when it did.
    pub reason: Option<Refusal>,
    /// The seconds of `Retry-After`, when tongs refused the request.
    pub retry_after: Option<u64>,
    pub request_id: String,
}

/// The response with its body in OpenAI's error shape when it is one of tongs' own error answers
/// (it carries an [`OwnError`]), `{"error": {"message", "type", "param", "code"}, "request_id"}`; its
/// status and headers kept (`Content-Length`, if any, fixed). Any other response is returned as is.
pub fn openai_shape(response: Response<ProxyBody>) -> Response<ProxyBody> {
    let Some(own) = response.extensions().get::<OwnError>() else {
        return response;
    };
    let mut body = serde_json::json!({
        "error": {
            "message": own.message,
            "type": own.error_type,
            "param": own.param,
            "code": own.code,
        },
        "request_id": own.request_id,
    });
    // tongs' own fields beside OpenAI's: a client that knows them keeps them, others ignore them.
    if let Some(reason) = own.reason {
        body["reason"] = reason.as_str().into();
    }
    if let Some(retry_after) = own.retry_after {
        body["retry_after_seconds"] = retry_after.into();
    }
    let body = body.to_string();
    let (mut parts, _) = response.into_parts();
    parts.headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    if parts.headers.contains_key(header::CONTENT_LENGTH) {
        parts
            .headers
            .insert(header::CONTENT_LENGTH, HeaderValue::from(body.len()));
    }
    Response::from_parts(parts, ProxyBody::full(body))
}

/// OpenAI's error `type` for a status: a client's fault, too many requests, or the server's.
fn openai_type(status: StatusCode) -> &'static str {
    if status == StatusCode::TOO_MANY_REQUESTS {
        "rate_limit_error"
    } else if status.is_client_error() {
        "invalid_request_error"
    } else {
        "server_error"
    }
}

/// OpenAI's `code` for a node's or gateway's error status that tongs answers with.
fn node_status_code(status: u16) -> Option<&'static str> {
    match status {
        429 => Some("rate_limit_exceeded"),
        502 => Some("bad_gateway"),
        503 => Some("service_unavailable"),
        504 | 524 => Some("gateway_timeout"),
        _ => None,
    }
}

/// A name from the client as logs and answers show it: at most [`SHOWN`] characters, so that a body's
/// worth of model name is not echoed whole.
fn shown(name: &str) -> Cow<'_, str> {
    match name.char_indices().nth(SHOWN) {
        Some((cut, _)) => Cow::Owned(format!("{}…", &name[..cut])),
        None => Cow::Borrowed(name),
    }
}

/// Characters of a client's name that an answer repeats.
const SHOWN: usize = 200;

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

    /// One error of every kind.
    fn every_error() -> Vec<ProxyError> {
        vec![
            refused(),
            ProxyError::BadDeadline {
                header: "x-tongs-timeout-ms".into(),
                value: "soon".into(),
            },
            ProxyError::BodyTooLarge { limit: 10 },
            ProxyError::MethodNotAllowed {
                method: Method::CONNECT,
            },
            ProxyError::Connect {
                endpoint: "http://10.0.0.7:8000".into(),
                detail: "refused".into(),
                cause: "connection refused",
            },
            ProxyError::Upstream {
                endpoint: "http://10.0.0.7:8000".into(),
                detail: "reset".into(),
                summary: "the endpoint broke the connection before its response",
            },
            ProxyError::ResponseTimeout {
                endpoint: "http://10.0.0.7:8000".into(),
                after: Duration::from_secs(3),
            },
            ProxyError::Status {
                endpoint: "http://10.0.0.7:8000".into(),
                status: 503,
            },
            ProxyError::ClientBody {
                detail: "connection reset".into(),
            },
            ProxyError::ClientTooSlow,
            ProxyError::ModelNotFound {
                model: "llama-9".into(),
            },
            ProxyError::NoRoute,
        ]
    }

    async fn body_of(response: Response<ProxyBody>) -> serde_json::Value {
        let body = http_body_util::BodyExt::collect(response.into_body())
            .await
            .unwrap()
            .to_bytes();
        serde_json::from_slice(&body).unwrap()
    }

    #[test]
    fn every_answer_carries_what_it_says() {
        let request_id = HeaderValue::from_static("rid-4");
        for error in every_error() {
            let (status, message) = (error.status(), error.client_message());
            let expected = error.own_error(&request_id);
            let response = error.into_response(&request_id);
            let own = response.extensions().get::<OwnError>().unwrap();
            assert_eq!(own, &expected);
            assert_eq!((own.status, &own.message), (status, &message));
            assert_eq!(own.request_id, "rid-4");
            assert_eq!(response.status(), status);
        }
    }

    #[test]
    fn openai_type_code_and_param_per_error() {
        let request_id = HeaderValue::from_static("rid-5");
        let openai: Vec<_> = every_error()
            .iter()
            .map(|error| {
                let own = error.own_error(&request_id);
                (own.status.as_u16(), own.error_type, own.code, own.param)
            })
            .collect();
        let server = "server_error";
        let invalid = "invalid_request_error";
        assert_eq!(
            openai,
            [
                (503, server, Some("server_is_overloaded"), None),
                (400, invalid, Some("invalid_header"), None),
                (413, invalid, Some("request_too_large"), None),
                (405, invalid, Some("method_not_allowed"), None),
                (502, server, Some("bad_gateway"), None),
                (502, server, Some("bad_gateway"), None),
                (504, server, Some("gateway_timeout"), None),
                (503, server, Some("service_unavailable"), None),
                (400, invalid, Some("invalid_body"), None),
                (408, invalid, Some("request_timeout"), None),
                (404, invalid, Some("model_not_found"), Some("model")),
                (404, invalid, None, None),
            ]
        );
        let no_endpoints = ProxyError::Refused {
            reason: Refusal::NoEndpoints,
            detail: "no endpoint is available".into(),
            retry_after: 1,
        }
        .own_error(&request_id);
        assert_eq!(
            (no_endpoints.error_type, no_endpoints.code),
            (server, Some("service_unavailable"))
        );
        assert_eq!(
            (no_endpoints.reason, no_endpoints.retry_after),
            (Some(Refusal::NoEndpoints), Some(1))
        );
        for (status, error_type, code) in [
            (429, "rate_limit_error", Some("rate_limit_exceeded")),
            (502, server, Some("bad_gateway")),
            (504, server, Some("gateway_timeout")),
            (524, server, Some("gateway_timeout")),
        ] {
            let own = ProxyError::Status {
                endpoint: "http://a".into(),
                status,
            }
            .own_error(&request_id);
            assert_eq!((own.error_type, own.code), (error_type, code), "{status}");
        }
    }

    #[test]
    fn an_unknown_model_is_named_and_nothing_else() {
        let error = ProxyError::ModelNotFound {
            model: "llama-9".into(),
        };
        assert_eq!(error.status(), 404);
        assert_eq!(error.client_message(), "the model `llama-9` does not exist");
        let long = ProxyError::ModelNotFound {
            model: "é".repeat(10_000),
        };
        let message = long.client_message();
        assert_eq!(message.chars().filter(|&c| c == 'é').count(), SHOWN);
        assert!(message.ends_with("…` does not exist"), "{message}");
        assert_eq!(
            ProxyError::NoRoute.client_message(),
            "no pool serves this request"
        );
        assert_eq!(ProxyError::NoRoute.status(), 404);
    }

    #[tokio::test]
    async fn openai_shape_rewrites_the_body_and_keeps_the_head() {
        let response = refused().into_response(&HeaderValue::from_static("rid-6"));
        let shaped = openai_shape(response);
        assert_eq!(shaped.status(), 503);
        let headers = shaped.headers();
        assert_eq!(headers["retry-after"], "7");
        assert_eq!(headers["x-tongs-reject-reason"], "queue-full");
        assert_eq!(headers["x-request-id"], "rid-6");
        assert_eq!(headers["content-type"], "application/json");
        assert!(!headers.contains_key("content-length"));
        assert_eq!(
            body_of(shaped).await,
            serde_json::json!({
                "error": {
                    "message": "the queue is full",
                    "type": "server_error",
                    "param": null,
                    "code": "server_is_overloaded",
                },
                "request_id": "rid-6",
                "reason": "queue-full",
                "retry_after_seconds": 7,
            })
        );

        let mut response = ProxyError::ModelNotFound {
            model: "llama-9".into(),
        }
        .into_response(&HeaderValue::from_static("rid-7"));
        response
            .headers_mut()
            .insert(header::CONTENT_LENGTH, HeaderValue::from(1));
        let shaped = openai_shape(response);
        assert_eq!(shaped.status(), 404);
        let length: usize = shaped.headers()["content-length"]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        let body = http_body_util::BodyExt::collect(shaped.into_body())
            .await
            .unwrap()
            .to_bytes();
        assert_eq!(length, body.len(), "the length is the new body's");
        let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            body["error"]["message"],
            "the model `llama-9` does not exist"
        );
        assert_eq!(body["error"]["type"], "invalid_request_error");
        assert_eq!(body["error"]["param"], "model");
        assert_eq!(body["error"]["code"], "model_not_found");
        assert_eq!(body["request_id"], "rid-7");

        let shaped = openai_shape(
            ProxyError::MethodNotAllowed {
                method: Method::CONNECT,
            }
            .into_response(&HeaderValue::from_static("rid-8")),
        );
        assert!(
            shaped.headers()["allow"]
                .to_str()
                .unwrap()
                .starts_with("GET")
        );
    }

    #[tokio::test]
    async fn openai_shape_leaves_other_responses_alone() {
        let mut response = Response::new(ProxyBody::full(r#"{"error":"the node's own"}"#));
        *response.status_mut() = StatusCode::BAD_GATEWAY;
        response
            .headers_mut()
            .insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
        let shaped = openai_shape(response);
        assert_eq!(shaped.status(), 502);
        assert_eq!(shaped.headers()["content-type"], "text/plain");
        assert_eq!(body_of(shaped).await["error"], "the node's own");
    }

    fn refused() -> ProxyError {
        ProxyError::Refused {
            reason: Refusal::QueueFull,
            detail: "the queue is full".into(),
            retry_after: 7,
        }
    }
}
