//! The HTTP vocabulary every layer shares: the body handed to clients, tongs' own error answers (and
//! their OpenAI shape), the header names and rewrites, and the kept-alive connections requests go
//! out on (given a way to connect). It knows nothing of endpoints, queues or
//! metrics: what a streamed answer must keep alive rides in its body as an opaque [`body::Guard`].

pub mod body;
pub mod error;
pub mod headers;
pub mod pool;
pub mod relay;

pub use body::{BoxError, Guard, ProxyBody};
pub use error::{OwnError, ProxyError, describe, openai_shape};
pub use pool::{Connections, ResponseBody, SendError, UpstreamBody};
