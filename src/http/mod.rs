//! The HTTP vocabulary every layer shares: the body handed to clients, tongs' own error answers (and
//! their OpenAI shape), and the header names and rewrites. It knows nothing of endpoints, queues or
//! metrics: what a streamed answer must keep alive rides in its body as an opaque [`body::Guard`].

pub mod body;
pub mod error;
pub mod headers;
pub mod relay;

pub use body::{BoxError, Guard, ProxyBody};
pub use error::{OwnError, ProxyError, describe, openai_shape};
