//! Traces sent to an OpenTelemetry collector over OTLP/HTTP (`tracing.otlp`): off unless an endpoint
//! is named.

use serde::{Deserialize, Serialize};

use super::{HumanDuration, MIN_DURATION, Problem};

/// Distributed tracing.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TracingConfig {
    pub otlp: OtlpConfig,
}

/// The OTLP/HTTP exporter: one span per request, one child per attempt.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OtlpConfig {
    /// The collector's OTLP/HTTP base URL (`http://otel-collector:4318`); spans are POSTed as protobuf
    /// to `{endpoint}/v1/traces`. Empty (the default): tracing is off.
    pub endpoint: String,
    /// `service.name` of every span.
    pub service_name: String,
    /// Share of the traces tongs starts that are recorded (0 ..= 1). A client's `traceparent` decides
    /// for its own trace (parent-based sampling).
    pub sample_ratio: f64,
    /// Longest one export to the collector may take.
    pub timeout: HumanDuration,
}

impl Default for OtlpConfig {
    fn default() -> Self {
        Self {
            endpoint: String::new(),
            service_name: "tongs".into(),
            sample_ratio: 1.0,
            timeout: HumanDuration::from_secs(10),
        }
    }
}

/// Longest `tracing.otlp.timeout`.
const MAX_TIMEOUT: HumanDuration = HumanDuration::from_secs(60);

impl OtlpConfig {
    /// Whether spans are exported.
    pub fn enabled(&self) -> bool {
        !self.endpoint.is_empty()
    }

    /// Where spans are POSTed: `{endpoint}/v1/traces`.
    pub fn traces_url(&self) -> String {
        format!("{}/v1/traces", self.endpoint.trim_end_matches('/'))
    }
}

impl TracingConfig {
    pub(super) fn validate(&self, problems: &mut Vec<Problem>) {
        let otlp = &self.otlp;
        let mut problem = |field: &str, message: String| {
            problems.push(Problem {
                field: format!("tracing.otlp.{field}"),
                message,
            })
        };
        if otlp.enabled()
            && let Err(message) = check_endpoint(&otlp.endpoint)
        {
            problem("endpoint", message);
        }
        if otlp.service_name.trim().is_empty() {
            problem("service_name", "must not be empty".into());
        }
        if !(0.0..=1.0).contains(&otlp.sample_ratio) {
            problem(
                "sample_ratio",
                format!("must be between 0 and 1, got {}", otlp.sample_ratio),
            );
        }
        if otlp.timeout < MIN_DURATION || otlp.timeout > MAX_TIMEOUT {
            problem(
                "timeout",
                format!(
                    "must be between {MIN_DURATION} and {MAX_TIMEOUT}, got {}",
                    otlp.timeout
                ),
            );
        }
    }
}

/// An `http://host[:port][/path]` base URL without query or fragment.
fn check_endpoint(endpoint: &str) -> Result<(), String> {
    let uri: http::Uri = endpoint
        .parse()
        .map_err(|e| format!("not a URL ({e}): {endpoint:?}"))?;
    match uri.scheme_str() {
        Some("http") => {}
        Some("https") => {
            return Err(format!(
                "{endpoint:?}: only http:// is supported; send to a collector in the cluster or \
                 beside the pod, which forwards over TLS"
            ));
        }
        _ => {
            return Err(format!(
                "must be an http:// URL such as http://otel-collector:4318, got {endpoint:?}"
            ));
        }
    }
    if uri.host().is_none_or(str::is_empty) {
        return Err(format!("names no host: {endpoint:?}"));
    }
    if uri.query().is_some() || endpoint.contains('#') {
        return Err(format!(
            "must be a base URL without query or fragment, got {endpoint:?}"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn problems(otlp: OtlpConfig) -> Vec<String> {
        let mut problems = Vec::new();
        TracingConfig { otlp }.validate(&mut problems);
        problems.iter().map(ToString::to_string).collect()
    }

    #[test]
    fn off_by_default_and_valid() {
        assert!(!OtlpConfig::default().enabled());
        assert!(problems(OtlpConfig::default()).is_empty());
    }

    #[test]
    fn every_bad_field_is_named() {
        let bad = OtlpConfig {
            endpoint: "otel-collector:4318".into(),
            service_name: " ".into(),
            sample_ratio: 1.5,
            timeout: HumanDuration::from_secs(0),
        };
        let problems = problems(bad);
        for field in ["endpoint", "service_name", "sample_ratio", "timeout"] {
            assert!(
                problems
                    .iter()
                    .any(|p| p.starts_with(&format!("tracing.otlp.{field}: "))),
                "{field} not named in {problems:?}"
            );
        }
        let nan = OtlpConfig {
            sample_ratio: f64::NAN,
            ..OtlpConfig::default()
        };
        assert_eq!(self::problems(nan).len(), 1);
    }

    #[test]
    fn endpoints() {
        for good in ["http://otel-collector:4318", "http://10.0.0.1:4318/otlp/"] {
            assert_eq!(check_endpoint(good), Ok(()), "{good}");
        }
        for bad in [
            "https://c:4318",
            "otel:4318",
            "http://c:4318/?x=1",
            "ftp://c",
            "http://",
        ] {
            assert!(check_endpoint(bad).is_err(), "{bad}");
        }
        let otlp = OtlpConfig {
            endpoint: "http://c:4318/".into(),
            ..OtlpConfig::default()
        };
        assert_eq!(otlp.traces_url(), "http://c:4318/v1/traces");
    }
}
