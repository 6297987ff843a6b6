//! Connections to endpoints (`src/upstream/`): HTTPS with certificate verification, SNI and ALPN, and
//! Tailscale addresses through tailscaled's outbound proxies.
//!
//! tailscaled cannot run here (no tailnet): its SOCKS5 and HTTP CONNECT proxies are played by Debian's
//! `microsocks` and `tinyproxy`. The HTTPS endpoints are rustls servers on loopback with certificates
//! made by each test.

#![forbid(unsafe_code)]

// The one path: shared with the other test binaries (see `tests/support/mod.rs`).
#[path = "../support/mod.rs"]
mod support;

mod tls;
mod transports;
