//! Configuration (`crates/wire/src/config/`, `src/reload.rs`, `src/main.rs`): the shipped example and the table of
//! keys in `docs/configuration.md`, reload from a ConfigMap-style volume, and the `tongs` binary's config check and
//! SIGTERM drain.
//!
//! The kubelet's ConfigMap volume is played by the test (real files, real symlink swaps, real inotify);
//! the endpoints are in-process HTTP servers standing in for GPU nodes.

#![forbid(unsafe_code)]

// The one path: shared with the other test binaries (see `tests/support/mod.rs`).
#[path = "../support/mod.rs"]
mod support;

mod cli;
mod config_file;
mod reload;
