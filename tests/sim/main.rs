//! The simulator (`src/sim/`, `src/demo/`): simulated GPU nodes behave like the real nodes they stand
//! in for, and `tongs demo` runs a simulated fleet behind a real proxy end to end.
//!
//! No real GPU node is involved: the simulator is the fake, and these tests check it against what real
//! nodes do on the socket.

#![forbid(unsafe_code)]

// The one path: shared with the other test binaries (see `tests/support/mod.rs`).
#[path = "../support/mod.rs"]
mod support;

mod demo;
mod nodes;
mod openai;
mod pauses;
