//! What an attempt's outcome is: a failure (and of which kind), back-pressure, or fine.

use std::time::Duration;

use http::{HeaderMap, StatusCode, header};

/// Why an attempt failed (or was turned away): the very conditions `retry.on` lists.
pub use crate::config::RetryOn as FailureKind;

impl FailureKind {
    /// Whether the endpoint is at fault (feeds the breaker); back-pressure is not a fault.
    pub fn is_endpoint_fault(self) -> bool {
        self != FailureKind::BackPressure
    }
}

/// Classifies a response by status: failure, back-pressure, or fine (`None`).
pub fn classify_status(status: StatusCode, headers: &HeaderMap) -> Option<FailureKind> {
    match status.as_u16() {
        429 => Some(FailureKind::BackPressure),
        503 if headers.contains_key(header::RETRY_AFTER) => Some(FailureKind::BackPressure),
        code @ (502 | 503 | 504 | 524) => Some(FailureKind::Status(code)),
        _ => None,
    }
}

/// `Retry-After` in seconds, capped at `cap`. Digits too many to count in a `u64` are a very long wait:
/// the cap. The HTTP-date form, and anything else that is not digits, counts as 1 s.
pub fn retry_after(headers: &HeaderMap, cap: Duration) -> Duration {
    let seconds = headers
        .get(header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|v| !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()))
        .map_or(1, |digits| digits.parse::<u64>().unwrap_or(u64::MAX));
    Duration::from_secs(seconds).min(cap)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_are_classified() {
        let none = HeaderMap::new();
        let mut with_retry_after = HeaderMap::new();
        with_retry_after.insert(header::RETRY_AFTER, "3".parse().unwrap());
        assert_eq!(classify_status(StatusCode::OK, &none), None);
        assert_eq!(classify_status(StatusCode::NOT_FOUND, &none), None);
        assert_eq!(
            classify_status(StatusCode::TOO_MANY_REQUESTS, &none),
            Some(FailureKind::BackPressure)
        );
        assert_eq!(
            classify_status(StatusCode::SERVICE_UNAVAILABLE, &with_retry_after),
            Some(FailureKind::BackPressure)
        );
        assert_eq!(
            classify_status(StatusCode::SERVICE_UNAVAILABLE, &none),
            Some(FailureKind::Status(503))
        );
        assert_eq!(
            classify_status(StatusCode::from_u16(524).unwrap(), &none),
            Some(FailureKind::Status(524))
        );
        assert_eq!(
            retry_after(&with_retry_after, Duration::from_secs(2)),
            Duration::from_secs(2)
        );
        assert_eq!(
            retry_after(&none, Duration::from_secs(30)),
            Duration::from_secs(1)
        );
    }

    #[test]
    fn retry_after_too_large_to_count_is_the_cap() {
        let cap = Duration::from_secs(30);
        let after = |value: &'static str| {
            let mut headers = HeaderMap::new();
            headers.insert(header::RETRY_AFTER, http::HeaderValue::from_static(value));
            retry_after(&headers, cap)
        };
        assert_eq!(after("99999999999999999999"), cap);
        assert_eq!(after(" 18446744073709551616 "), cap);
        assert_eq!(after("18446744073709551615"), cap);
        assert_eq!(after("12"), Duration::from_secs(12));
        assert_eq!(after("0"), Duration::ZERO);
        // Not a number of seconds: the HTTP-date form and anything malformed count as 1 s.
        assert_eq!(
            after("Wed, 21 Oct 2015 07:28:00 GMT"),
            Duration::from_secs(1)
        );
        assert_eq!(after("-5"), Duration::from_secs(1));
        assert_eq!(after("1.5"), Duration::from_secs(1));
        assert_eq!(after(""), Duration::from_secs(1));
    }
}
