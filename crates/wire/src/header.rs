//! The values of headers nodes and clients send, as tongs reads them: a node's `Retry-After`, a
//! request's priority.

use std::time::Duration;

use http::{HeaderMap, HeaderValue, header};

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

/// A request's priority, from the configured header (`high`, `normal`, `low`; anything else is normal).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Priority {
    High = 0,
    Normal = 1,
    Low = 2,
}

impl Priority {
    pub fn from_header(value: Option<&HeaderValue>) -> Priority {
        match value.map(HeaderValue::as_bytes) {
            Some(v) if v.eq_ignore_ascii_case(b"high") => Priority::High,
            Some(v) if v.eq_ignore_ascii_case(b"low") => Priority::Low,
            _ => Priority::Normal,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Priority::High => "high",
            Priority::Normal => "normal",
            Priority::Low => "low",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_too_large_to_count_is_the_cap() {
        let cap = Duration::from_secs(30);
        let after = |value: &'static str| {
            let mut headers = HeaderMap::new();
            headers.insert(header::RETRY_AFTER, HeaderValue::from_static(value));
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

    #[test]
    fn a_priority_is_read_in_any_case_and_anything_else_is_normal() {
        let read =
            |text: &'static str| Priority::from_header(Some(&HeaderValue::from_static(text)));
        assert_eq!(read("HIGH"), Priority::High);
        assert_eq!(read("low"), Priority::Low);
        assert_eq!(read("urgent"), Priority::Normal);
        assert_eq!(Priority::from_header(None), Priority::Normal);
        assert_eq!(Priority::High.as_str(), "high");
    }
}
