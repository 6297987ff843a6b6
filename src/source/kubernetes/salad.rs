//! The SaladCloud public API, for the one thing the Virtual Kubelet does not tell: a container group's
//! Container Gateway host.
//!
//! `GET {api_url}/organizations/{org}/projects/{project}/containers/{namespace}-{pod}` with the
//! `Salad-Api-Key` header answers the container group, whose `networking.dns` is the gateway's host
//! (`https://` is implied). The key is sent only to `api_url`, never logged.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Empty, Limited};

use crate::upstream::{UpstreamBody, UpstreamClient};

/// Largest container group document tongs reads.
const MAX_ANSWER_BYTES: usize = 1 << 20;
/// One lookup may take this long.
const LOOKUP_TIMEOUT: Duration = Duration::from_secs(10);

/// Where the API is and how to authenticate.
#[derive(Clone)]
pub struct SaladApi {
    base: String,
    organization: String,
    project: String,
    /// Marked sensitive: `Debug` shows no key.
    key: http::HeaderValue,
    client: Arc<UpstreamClient>,
}

impl std::fmt::Debug for SaladApi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SaladApi")
            .field("base", &self.base)
            .field("organization", &self.organization)
            .field("project", &self.project)
            .finish_non_exhaustive()
    }
}

/// Why a lookup failed.
#[derive(Debug, thiserror::Error)]
pub enum LookupError {
    #[error("SaladCloud API {url}: {detail}")]
    Transport { url: String, detail: String },
    #[error("SaladCloud API {url} answered {status}: {detail}")]
    Status {
        url: String,
        status: StatusCode,
        detail: String,
    },
    #[error("SaladCloud API {url}: the answer is not a container group: {detail}")]
    Malformed { url: String, detail: String },
}

/// What the API says about a container group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Group {
    /// The group has a gateway host.
    Gateway(String),
    /// The group exists but has no gateway (yet, or not configured).
    NoGateway,
    /// No such group (the VK has not created it yet, or it is gone).
    Missing,
}

impl SaladApi {
    pub fn new(
        base: &str,
        organization: &str,
        project: &str,
        mut key: http::HeaderValue,
        client: Arc<UpstreamClient>,
    ) -> SaladApi {
        key.set_sensitive(true);
        SaladApi {
            base: base.trim_end_matches('/').to_owned(),
            organization: organization.to_owned(),
            project: project.to_owned(),
            key,
            client,
        }
    }

    fn url(&self, group: &str) -> String {
        format!(
            "{}/organizations/{}/projects/{}/containers/{}",
            self.base, self.organization, self.project, group
        )
    }

    /// Looks up container group `group`'s gateway host.
    pub async fn lookup(&self, group: &str) -> Result<Group, LookupError> {
        let url = self.url(group);
        let transport = |detail: String| LookupError::Transport {
            url: url.clone(),
            detail,
        };
        let request = Request::builder()
            .method(Method::GET)
            .uri(&url)
            .header(http::header::ACCEPT, "application/json")
            .header("salad-api-key", self.key.clone())
            .body(UpstreamBody::new(
                Empty::<Bytes>::new().map_err(|never| match never {}),
            ))
            .map_err(|err| transport(err.to_string()))?;
        let exchange = async {
            let response = self
                .client
                .request_as_is(request)
                .await
                .map_err(|err| transport(err.to_string()))?;
            let status = response.status();
            let body = Limited::new(response.into_body(), MAX_ANSWER_BYTES)
                .collect()
                .await
                .map_err(|err| transport(format!("reading the answer: {err}")))?
                .to_bytes();
            Ok::<_, LookupError>((status, body))
        };
        let (status, body) = tokio::time::timeout(LOOKUP_TIMEOUT, exchange)
            .await
            .map_err(|_| transport(format!("no answer within {LOOKUP_TIMEOUT:?}")))??;
        match status {
            StatusCode::OK => parse_group(&body).map_err(|detail| LookupError::Malformed {
                url: url.clone(),
                detail,
            }),
            StatusCode::NOT_FOUND => Ok(Group::Missing),
            status => Err(LookupError::Status {
                url,
                status,
                detail: String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned(),
            }),
        }
    }
}

/// Reads `networking.dns` out of a container group document.
pub fn parse_group(body: &[u8]) -> Result<Group, String> {
    let value: serde_json::Value =
        serde_json::from_slice(body).map_err(|err| format!("not JSON: {err}"))?;
    if !value.is_object() {
        return Err("not a JSON object".into());
    }
    let dns = value
        .get("networking")
        .and_then(|n| n.get("dns"))
        .and_then(|d| d.as_str())
        .map(str::trim)
        .filter(|d| !d.is_empty());
    match dns {
        None => Ok(Group::NoGateway),
        Some(dns) if valid_host(dns) => Ok(Group::Gateway(dns.to_ascii_lowercase())),
        Some(dns) => Err(format!("networking.dns {dns:?} is not a host name")),
    }
}

/// A DNS name: labels of letters, digits and `-`, separated by dots.
fn valid_host(host: &str) -> bool {
    host.len() <= 253
        && host.split('.').count() >= 2
        && host.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-')
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gateway_host_comes_from_networking_dns() {
        let body = br#"{"name":"gpu-llm-0","networking":{"protocol":"http","port":8000,"auth":true,"dns":"Tamarind-Navybean-2kln8fkx9xruvxa2.salad.cloud"},"current_state":{"status":"running"}}"#;
        assert_eq!(
            parse_group(body),
            Ok(Group::Gateway(
                "tamarind-navybean-2kln8fkx9xruvxa2.salad.cloud".into()
            ))
        );
        assert_eq!(parse_group(br#"{"name":"x"}"#), Ok(Group::NoGateway));
        assert_eq!(
            parse_group(br#"{"networking":{"dns":""}}"#),
            Ok(Group::NoGateway)
        );
        assert!(parse_group(br#"{"networking":{"dns":"evil.com/path?x"}}"#).is_err());
        assert!(parse_group(b"[1]").is_err());
        assert!(parse_group(b"<html>").is_err());
    }
}
