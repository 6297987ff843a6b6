//! What an attempt's outcome is: a failure (and of which kind), back-pressure, or fine.

use http::{HeaderMap, StatusCode, header};

/// Why an attempt failed (or was turned away): the very conditions `retry.on` lists (whether the
/// endpoint is at fault is `RetryOn::is_endpoint_fault`).
pub use crate::config::RetryOn as FailureKind;

/// Classifies a response by status: failure, back-pressure, or fine (`None`).
pub fn classify_status(status: StatusCode, headers: &HeaderMap) -> Option<FailureKind> {
    match status.as_u16() {
        429 => Some(FailureKind::BackPressure),
        503 if headers.contains_key(header::RETRY_AFTER) => Some(FailureKind::BackPressure),
        code @ (502 | 503 | 504 | 524) => Some(FailureKind::Status(code)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::retry::retry_after;

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
}
