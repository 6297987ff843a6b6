//! Header rewriting between client and endpoint: hop-by-hop removal, forwarding headers, request ids.

use std::net::IpAddr;

use http::header::{self, HeaderMap, HeaderName, HeaderValue};

// Every header name tongs itself reads or writes, defined here once (those an operator can rename are
// `queue.*_header` in the configuration).
pub static X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
/// A request can opt out of retries with `x-tongs-retry: off` (non-idempotent routes).
pub static X_TONGS_RETRY: HeaderName = HeaderName::from_static("x-tongs-retry");
/// Names why tongs itself refused a request (`queue-full`, `queue-timeout`, `no-endpoints`,
/// `shed-low-priority`).
pub static X_TONGS_REJECT_REASON: HeaderName = HeaderName::from_static("x-tongs-reject-reason");
pub static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
pub static X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
pub static X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");

static KEEP_ALIVE: HeaderName = HeaderName::from_static("keep-alive");
static PROXY_CONNECTION: HeaderName = HeaderName::from_static("proxy-connection");

/// Headers that describe one connection, not the message (RFC 9110 §7.6.1, plus the legacy
/// `Keep-Alive` and `Proxy-Connection`). They must not cross the proxy.
fn is_hop_by_hop(name: &HeaderName) -> bool {
    // Standard names compare as enum values; this runs for every header of every message.
    name == header::CONNECTION
        || name == header::TE
        || name == header::TRAILER
        || name == header::TRANSFER_ENCODING
        || name == header::UPGRADE
        || name == header::PROXY_AUTHENTICATE
        || name == header::PROXY_AUTHORIZATION
        || name == KEEP_ALIVE
        || name == PROXY_CONNECTION
}

/// Longest client-supplied request id kept as is; longer ones are replaced.
const MAX_REQUEST_ID_LEN: usize = 128;

/// Whether an HTTP/1.1 request asks to switch protocols (WebSocket and the like).
pub fn is_upgrade_request(headers: &HeaderMap) -> bool {
    headers.contains_key(header::UPGRADE) && connection_has_token(headers, "upgrade")
}

fn connection_has_token(headers: &HeaderMap, token: &str) -> bool {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case(token))
}

/// Removes hop-by-hop headers, including those the `Connection` header names. With `keep_upgrade` the
/// `Upgrade` header and `Connection: upgrade` survive, as a protocol switch needs them on the next hop.
pub fn strip_hop_by_hop(headers: &mut HeaderMap, keep_upgrade: bool) {
    // Most messages carry none, or only `Connection: keep-alive`: one pass over the names decides.
    if !headers.keys().any(is_hop_by_hop) {
        return;
    }
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .filter_map(|token| HeaderName::from_bytes(token.trim().as_bytes()).ok())
        .collect();
    for name in named {
        if !(keep_upgrade && name == header::UPGRADE) {
            headers.remove(name);
        }
    }
    // `TE: trailers` is end-to-end in practice: gRPC over HTTP/2 requires it.
    let te_trailers = headers
        .get(header::TE)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"trailers"));
    let upgrade = headers.get(header::UPGRADE).cloned();
    let present: Vec<HeaderName> = headers
        .keys()
        .filter(|name| is_hop_by_hop(name))
        .cloned()
        .collect();
    for name in present {
        headers.remove(name);
    }
    if te_trailers {
        headers.insert(header::TE, HeaderValue::from_static("trailers"));
    }
    if keep_upgrade && let Some(upgrade) = upgrade {
        headers.insert(header::UPGRADE, upgrade);
        headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    }
}

/// Appends the client's address to `X-Forwarded-For` and sets `X-Forwarded-Proto`/`-Host` unless an
/// earlier proxy (an ingress) already did.
pub fn add_forwarded(
    headers: &mut HeaderMap,
    client_ip: IpAddr,
    original_host: Option<HeaderValue>,
) {
    let client = client_ip.to_string();
    let forwarded_for = match headers.get(&X_FORWARDED_FOR).and_then(|v| v.to_str().ok()) {
        Some(earlier) if !earlier.trim().is_empty() => format!("{earlier}, {client}"),
        _ => client,
    };
    if let Ok(value) = HeaderValue::from_str(&forwarded_for) {
        headers.insert(&X_FORWARDED_FOR, value);
    }
    if !headers.contains_key(&X_FORWARDED_PROTO) {
        headers.insert(&X_FORWARDED_PROTO, HeaderValue::from_static("http"));
    }
    if let Some(host) = original_host
        && !headers.contains_key(&X_FORWARDED_HOST)
    {
        headers.insert(&X_FORWARDED_HOST, host);
    }
}

/// The client's `X-Request-Id` when it is usable, else a fresh random one (32 hex digits).
pub fn request_id(headers: &HeaderMap) -> HeaderValue {
    if let Some(value) = headers.get(&X_REQUEST_ID)
        && !value.is_empty()
        && value.len() <= MAX_REQUEST_ID_LEN
        && value.to_str().is_ok()
    {
        return value.clone();
    }
    let id = format!("{:032x}", fastrand::u128(..));
    HeaderValue::from_str(&id).unwrap_or_else(|_| HeaderValue::from_static("unknown"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for (name, value) in pairs {
            headers.append(
                HeaderName::from_bytes(name.as_bytes()).unwrap(),
                HeaderValue::from_str(value).unwrap(),
            );
        }
        headers
    }

    #[test]
    fn strips_hop_by_hop_and_connection_named_headers() {
        let mut headers = map(&[
            ("connection", "keep-alive, x-secret-hop"),
            ("keep-alive", "timeout=5"),
            ("x-secret-hop", "1"),
            ("transfer-encoding", "chunked"),
            ("te", "gzip"),
            ("authorization", "Bearer t"),
            ("content-type", "application/json"),
        ]);
        strip_hop_by_hop(&mut headers, false);
        let mut names: Vec<_> = headers.keys().map(|k| k.as_str()).collect();
        names.sort();
        assert_eq!(names, ["authorization", "content-type"]);
    }

    #[test]
    fn keeps_te_trailers_and_upgrade_when_asked() {
        let mut headers = map(&[
            ("te", "trailers"),
            ("connection", "Upgrade"),
            ("upgrade", "websocket"),
        ]);
        assert!(is_upgrade_request(&headers));
        strip_hop_by_hop(&mut headers, true);
        assert_eq!(headers["te"], "trailers");
        assert_eq!(headers["upgrade"], "websocket");
        assert_eq!(headers["connection"], "upgrade");
        strip_hop_by_hop(&mut headers, false);
        assert!(!headers.contains_key("upgrade"));
    }

    #[test]
    fn forwarded_headers_append() {
        let mut headers = map(&[
            ("x-forwarded-for", "203.0.113.9"),
            ("x-forwarded-proto", "https"),
        ]);
        add_forwarded(
            &mut headers,
            "10.1.2.3".parse().unwrap(),
            Some(HeaderValue::from_static("api.example")),
        );
        assert_eq!(headers["x-forwarded-for"], "203.0.113.9, 10.1.2.3");
        assert_eq!(headers["x-forwarded-proto"], "https");
        assert_eq!(headers["x-forwarded-host"], "api.example");
    }

    #[test]
    fn request_id_is_kept_or_made() {
        let kept = request_id(&map(&[("x-request-id", "abc-123")]));
        assert_eq!(kept, "abc-123");
        let made = request_id(&HeaderMap::new());
        assert_eq!(made.len(), 32);
        let too_long = "x".repeat(200);
        assert_ne!(
            request_id(&map(&[("x-request-id", &too_long)])),
            too_long.as_str()
        );
    }
}
