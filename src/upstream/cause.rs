//! Why a connection to an endpoint failed, in words a client may be told.
//!
//! The full error (kept for the logs) names the endpoint, and some of its causes name the destination
//! again (a proxied connection's `RouteError`, a certificate's names). A client is told only the kind
//! of failure, from a fixed vocabulary that never carries an address.

use std::error::Error;
use std::io;

use super::route::RouteError;

/// The kind of connection failure behind `err`, from the outermost cause that tells one.
pub fn connect_cause(err: &(dyn Error + 'static)) -> &'static str {
    find(err, 0).unwrap_or("the connection failed")
}

/// Causes are followed this deep at most.
const MAX_DEPTH: usize = 16;

/// The kind told by `err` or its causes, outermost first. An `io::Error` made from another error
/// reports that error's cause as its source, skipping the error itself (the TLS connector wraps
/// rustls' error in two of them): what it wraps is looked into too.
fn find(err: &(dyn Error + 'static), depth: usize) -> Option<&'static str> {
    if depth > MAX_DEPTH {
        return None;
    }
    if let Some(kind) = known(err) {
        return Some(kind);
    }
    if let Some(inner) = err.downcast_ref::<io::Error>().and_then(io::Error::get_ref)
        && let Some(kind) = find(inner, depth + 1)
    {
        return Some(kind);
    }
    err.source().and_then(|cause| find(cause, depth + 1))
}

fn known(err: &(dyn Error + 'static)) -> Option<&'static str> {
    if let Some(route) = err.downcast_ref::<RouteError>() {
        return Some(match route {
            RouteError::Proxy { .. } => "the connection through tailscaled's proxy failed",
            RouteError::NoProxy { .. } => {
                "a Tailscale address, but no upstream.tailscale.proxy is configured"
            }
            RouteError::Timeout { .. } => {
                "no connection within timeouts.connect through tailscaled's proxy"
            }
        });
    }
    if let Some(tls) = err.downcast_ref::<rustls::Error>() {
        return Some(match tls {
            rustls::Error::InvalidCertificate(_) => "its TLS certificate was not accepted",
            _ => "the TLS handshake failed",
        });
    }
    if let Some(io) = err.downcast_ref::<io::Error>() {
        match io.kind() {
            io::ErrorKind::ConnectionRefused => return Some("connection refused"),
            io::ErrorKind::TimedOut => return Some("no connection within timeouts.connect"),
            io::ErrorKind::ConnectionReset | io::ErrorKind::ConnectionAborted => {
                return Some("the connection was reset");
            }
            io::ErrorKind::HostUnreachable | io::ErrorKind::NetworkUnreachable => {
                return Some("no route to the endpoint");
            }
            _ => {}
        }
    }
    // hyper-util's connector names a failed name lookup only in its message.
    (err.to_string() == "dns error").then_some("its name did not resolve")
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// An error with a message and an optional cause, as connectors nest them.
    #[derive(Debug)]
    struct Wrapped(&'static str, Option<Box<dyn Error + Send + Sync>>);

    impl std::fmt::Display for Wrapped {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.0)
        }
    }

    impl Error for Wrapped {
        fn source(&self) -> Option<&(dyn Error + 'static)> {
            self.1.as_deref().map(|e| e as &(dyn Error + 'static))
        }
    }

    fn wrapped(message: &'static str, cause: impl Error + Send + Sync + 'static) -> Wrapped {
        Wrapped(message, Some(Box::new(cause)))
    }

    #[test]
    fn names_the_kind_of_failure_and_never_the_destination() {
        let refused = wrapped(
            "client error (Connect)",
            wrapped(
                "tcp connect error",
                io::Error::from(io::ErrorKind::ConnectionRefused),
            ),
        );
        assert_eq!(connect_cause(&refused), "connection refused");

        let dst = "100.101.102.103:8000";
        let proxied = wrapped(
            "client error (Connect)",
            RouteError::Proxy {
                dst: dst.into(),
                source: Box::new(io::Error::from(io::ErrorKind::ConnectionRefused)),
            },
        );
        let stalled = RouteError::Timeout {
            dst: dst.into(),
            after: Duration::from_secs(2),
        };
        let unrouted = RouteError::NoProxy { dst: dst.into() };
        for err in [&proxied as &(dyn Error + 'static), &stalled, &unrouted] {
            let cause = connect_cause(err);
            assert!(cause.contains("tailscale"), "{cause}");
            assert!(!cause.contains("100.101"), "{cause}");
        }

        // rustls' error inside an io::Error inside another, as the TLS connector returns it.
        let certificate = io::Error::other(io::Error::new(
            io::ErrorKind::InvalidData,
            rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer),
        ));
        let tls = wrapped("client error (Connect)", certificate);
        assert_eq!(connect_cause(&tls), "its TLS certificate was not accepted");
        let handshake = io::Error::other(io::Error::new(
            io::ErrorKind::InvalidData,
            rustls::Error::HandshakeNotComplete,
        ));
        assert_eq!(connect_cause(&handshake), "the TLS handshake failed");

        let dns = wrapped("dns error", io::Error::other("no such host gpu-7.internal"));
        assert_eq!(connect_cause(&dns), "its name did not resolve");

        let odd = wrapped(
            "client error (Connect)",
            io::Error::other("10.0.0.7 said no"),
        );
        assert_eq!(connect_cause(&odd), "the connection failed");
    }
}
