//! The values of headers nodes and clients send, as tongs reads them: a node's `Retry-After` and its
//! drain notice, a request's priority.

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

/// The header of a heartbeat answer by which a node says it is going: `x-tongs-drain: <seconds left>`.
pub const DRAIN: &str = "x-tongs-drain";

/// The longest time left a drain notice is read as (a day): a node cannot hold its endpoint out of
/// the pick and in the registry for longer by saying so.
pub const MAX_DRAIN_NOTICE: Duration = Duration::from_secs(86_400);

/// A node's notice that it is going, from a heartbeat answer's [`DRAIN`] header, whatever the answer's
/// status: `None` without the header; `Some(left)` with it, `left` the time it has left (whole or
/// decimal seconds, at most [`MAX_DRAIN_NOTICE`]), or `None` when the value says no time (empty, or not
/// a number of seconds): the node still said it is going.
pub fn drain_notice(headers: &HeaderMap) -> Option<Option<Duration>> {
    let value = headers.get(DRAIN)?;
    let left = value
        .to_str()
        .ok()
        .map(str::trim)
        .filter(|v| !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit() || b == b'.'))
        .and_then(|v| v.parse::<f64>().ok())
        .filter(|seconds| seconds.is_finite())
        .map(|seconds| Duration::from_secs_f64(seconds.min(MAX_DRAIN_NOTICE.as_secs_f64())));
    Some(left)
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
    fn a_drain_notice_says_the_time_left_or_only_that_the_node_goes() {
        let notice = |value: Option<&'static str>| {
            let mut headers = HeaderMap::new();
            if let Some(value) = value {
                headers.insert(DRAIN, HeaderValue::from_static(value));
            }
            drain_notice(&headers)
        };
        assert_eq!(notice(None), None, "no header: not going");
        assert_eq!(notice(Some("30")), Some(Some(Duration::from_secs(30))));
        assert_eq!(
            notice(Some(" 2.5 ")),
            Some(Some(Duration::from_millis(2500)))
        );
        assert_eq!(notice(Some("0")), Some(Some(Duration::ZERO)));
        assert_eq!(notice(Some("99999999999")), Some(Some(MAX_DRAIN_NOTICE)));
        for unreadable in ["", "soon", "-5", "1e3", "inf", "1.2.3"] {
            assert_eq!(notice(Some(unreadable)), Some(None), "{unreadable:?}");
        }
    }

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
