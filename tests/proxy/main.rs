//! The request path (`src/proxy/`, `src/balance/`, `src/limit/`, `src/admission/`,
//! `src/retry/`, `src/breaker.rs`, `src/http/`): forwarding, streaming, resilience, back-pressure,
//! inbound limits and balancing, through a real proxy over loopback sockets.
//!
//! The endpoints are scripted in-process backends and the simulator's GPU nodes (`tongs::sim`), which
//! stand in for the remote inference nodes; no real GPU node is involved.

#![forbid(unsafe_code)]

// The one path: shared with the other test binaries (see `tests/support/mod.rs`).
#[path = "../support/mod.rs"]
mod support;

mod answers;
mod backpressure;
mod balancing;
mod bodies;
mod continuation;
mod drain;
mod engine;
mod forwarding;
mod gray;
mod latency;
mod limits;
mod pauses;
mod pools;
mod resilience;
mod streaming;
mod tenants;
mod tracing;
