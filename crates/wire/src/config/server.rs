//! The listeners' own settings: the admin port, timeouts, limits on what a client may send, and graceful
//! shutdown.

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::{HumanDuration, Problem};

/// The admin listener (health probes now; metrics and debug pages later).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdminConfig {
    pub listen: SocketAddr,
    /// A file holding a bearer token (a mounted Secret). When set, every admin path but `/healthz` and
    /// `/readyz` (the kubelet's probes) requires `Authorization: Bearer <token>`.
    pub bearer_token_file: Option<PathBuf>,
    /// Most connections open on the admin port at once; more are closed as they arrive. Connections
    /// that send no request within `timeouts.header_read` are closed, so room comes back within that.
    pub max_connections: usize,
}

/// The admin port's `max_connections` may be at most this (a bound for the semaphore behind it).
const ADMIN_MAX_CONNECTIONS: usize = 65_536;

impl Default for AdminConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([0, 0, 0, 0], 9090)),
            bearer_token_file: None,
            max_connections: 256,
        }
    }
}

/// Timeouts. `total` is the SaladCloud gateway's own limit by default (100 s).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Timeouts {
    /// TCP (and TLS) connect to an endpoint.
    pub connect: HumanDuration,
    /// From sending the request until the endpoint's response headers arrive.
    pub response_headers: HumanDuration,
    /// The whole exchange, response body included (WebSocket upgrades excepted).
    pub total: HumanDuration,
    /// An unused pooled connection to an endpoint is closed after this long.
    pub idle: HumanDuration,
    /// A client must send its complete request headers within this time of connecting (slowloris).
    pub header_read: HumanDuration,
    /// A client may pause its request body at most this long between two pieces of it (408).
    pub body_read: HumanDuration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            connect: HumanDuration::from_secs(2),
            response_headers: HumanDuration::from_secs(100),
            total: HumanDuration::from_secs(100),
            idle: HumanDuration::from_secs(90),
            header_read: HumanDuration::from_secs(10),
            body_read: HumanDuration::from_secs(30),
        }
    }
}

/// The default request body limit: room for the audio, images and long prompts inference requests
/// carry (OpenAI's own limits are 25 MB for audio and 20 MB per image), without letting one client
/// stream gigabytes through.
pub const DEFAULT_MAX_BODY_BYTES: u64 = 100 * 1024 * 1024;

/// Limits on what a client may send.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// Largest request head (request line plus headers) in bytes; larger gets 431. At least 8192.
    pub max_header_bytes: usize,
    /// Largest request body in bytes; larger gets 413. `null` means no limit.
    pub max_body_bytes: Option<u64>,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_header_bytes: 64 * 1024,
            max_body_bytes: Some(DEFAULT_MAX_BODY_BYTES),
        }
    }
}

/// Graceful shutdown.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ShutdownConfig {
    /// After SIGTERM/SIGINT, in-flight requests (streams included) get this long to finish.
    /// Keep it below the pod's terminationGracePeriodSeconds (30 s by default in Kubernetes).
    pub grace: HumanDuration,
}

impl Default for ShutdownConfig {
    fn default() -> Self {
        Self {
            grace: HumanDuration::from_secs(25),
        }
    }
}

impl Limits {
    pub(super) fn validate(&self, problems: &mut Vec<Problem>) {
        let mut problem =
            |field: String, message: String| problems.push(Problem { field, message });
        if self.max_header_bytes < 8192 {
            problem(
                "limits.max_header_bytes".into(),
                format!("must be at least 8192, got {}", self.max_header_bytes),
            );
        }
        if self.max_body_bytes == Some(0) {
            problem(
                "limits.max_body_bytes".into(),
                "must be greater than zero (null for no limit)".into(),
            );
        }
    }
}

impl AdminConfig {
    pub(super) fn validate(&self, problems: &mut Vec<Problem>) {
        let mut problem =
            |field: String, message: String| problems.push(Problem { field, message });
        if !(1..=ADMIN_MAX_CONNECTIONS).contains(&self.max_connections) {
            problem(
                "admin.max_connections".into(),
                format!(
                    "must be between 1 and {ADMIN_MAX_CONNECTIONS}, got {}",
                    self.max_connections
                ),
            );
        }
        if let Some(path) = &self.bearer_token_file {
            match std::fs::read_to_string(path) {
                Ok(token) if token.trim().is_empty() => problem(
                    "admin.bearer_token_file".into(),
                    format!("{} is empty", path.display()),
                ),
                Ok(_) => {}
                Err(err) => problem(
                    "admin.bearer_token_file".into(),
                    format!("cannot read {}: {err}", path.display()),
                ),
            }
        }
    }
}
