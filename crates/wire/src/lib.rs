//! What reaches tongs from outside, as tongs reads it: the configuration file by section (schema,
//! defaults, validation naming every field), the OpenAI protocol (the `model` a body names, Server-Sent
//! Events, which streams can be continued, the continuation request, the splice of pieces), the values of
//! the headers nodes and clients send, node addresses, and a model server's own metrics (`engine`). Pure: no I/O, no clock, no runtime.
//!
//! tongs re-exports `config` and `openai` at its root, so the proxy's code names them `crate::config`
//! and `crate::openai` as before.

#![forbid(unsafe_code)]

pub mod config;
pub mod engine;
pub mod header;
pub mod openai;
