//! tongs: an in-cluster reverse proxy that makes a fleet of remote, interruptible GPU inference nodes
//! look like one reliable service.
//!
//! [`App::bind`] opens the listeners for a validated [`config::Config`]; [`App::run`] serves until the
//! shutdown token is cancelled, then drains in-flight requests within the grace period.

#![forbid(unsafe_code)]

pub mod admin;
pub mod admission;
pub mod app;
pub mod balance;
pub mod breaker;
pub mod demo;

pub mod endpoint;
pub mod health;
pub mod http;
pub mod limit;
pub mod metrics;
pub mod proxy;
pub mod readiness;
pub mod registry;
pub mod reload;
pub mod retry;
pub mod route;
pub mod server;
pub mod sim;
pub mod source;
pub mod trace;
pub mod upstream;

pub use app::{App, AppError};
/// The configuration and the OpenAI protocol as tongs reads them live in `tongs-wire`, a crate kept
/// pure by the compiler (`crates/wire/`); the proxy names them here, as before.
pub use tongs_wire::{config, engine, openai};
