//! The admin listener (`src/admin/`, `src/metrics/`, `src/admin/status.html`): probes, `/metrics` and
//! `/debug/endpoints`, the status page in a real headless Chromium, and a real Prometheus scraping it.
//!
//! The endpoints behind the proxy are small in-process HTTP servers standing in for GPU nodes.

#![forbid(unsafe_code)]

// The one path: shared with the other test binaries (see `tests/support/mod.rs`).
#[path = "../support/mod.rs"]
mod support;

mod connections;
mod operations;
mod probes;
mod prometheus;
mod status_page;
