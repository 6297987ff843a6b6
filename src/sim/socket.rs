//! A simulated node's sockets: its listener and its connections, and how the interruptions that
//! live below HTTP are made real on them:
//! - `refuse`: the listener is closed (new connects get ECONNREFUSED) and every open connection is reset
//!   (SO_LINGER 0, so the peer sees RST); the port is bound again on recovery.
//! - `blackhole`: connections are accepted but never read or answered, and in-flight requests stop where
//!   they are; on recovery those connections are reset, as a reallocated node would.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

use super::node::{NodeShared, handle};
use super::schedule::InterruptionKind;

pub(super) async fn accept_loop(
    listener: TcpListener,
    addr: SocketAddr,
    shared: Arc<NodeShared>,
    stop: CancellationToken,
) {
    let mut conditions = shared.conditions();
    let mut listener = Some(listener);
    loop {
        let refusing = conditions.borrow_and_update().is(InterruptionKind::Refuse);
        match (refusing, listener.as_ref()) {
            (true, Some(_)) => listener = None, // closing the socket is what makes connects fail
            (false, None) => match TcpListener::bind(addr).await {
                Ok(bound) => listener = Some(bound),
                Err(err) => {
                    tracing::debug!(%addr, error = %err, "sim node cannot rebind yet");
                    tokio::select! {
                        () = stop.cancelled() => return,
                        () = tokio::time::sleep(Duration::from_millis(20)) => continue,
                    }
                }
            },
            _ => {}
        }
        let accepted = tokio::select! {
            () = stop.cancelled() => return,
            changed = conditions.changed() => {
                if changed.is_err() { return; }
                continue;
            }
            accepted = accept(listener.as_ref()) => accepted,
        };
        if let Ok((stream, _)) = accepted {
            tokio::spawn(connection(stream, Arc::clone(&shared), stop.clone()));
        }
    }
}

async fn accept(listener: Option<&TcpListener>) -> std::io::Result<(TcpStream, SocketAddr)> {
    match listener {
        Some(listener) => listener.accept().await,
        None => std::future::pending().await,
    }
}

/// Closes a connection with RST rather than FIN, as a vanished host's network would.
fn reset(twin: socket2::Socket) {
    let _ = twin.set_linger(Some(Duration::ZERO));
    drop(twin);
}

async fn connection(stream: TcpStream, shared: Arc<NodeShared>, stop: CancellationToken) {
    // A second handle on the same socket, so it can be reset while hyper owns the stream.
    let Ok(twin) = socket2::SockRef::from(&stream).try_clone() else {
        return;
    };
    let _ = stream.set_nodelay(true);
    let mut conditions = shared.conditions();
    // A handler cancels it to have this connection reset (the OpenAI answers' `x-sim-cut` hook).
    let reset_asked = CancellationToken::new();
    let service_shared = Arc::clone(&shared);
    let service_reset = reset_asked.clone();
    let service = service_fn(move |request| {
        let shared = Arc::clone(&service_shared);
        let reset = service_reset.clone();
        async move { Ok::<_, Infallible>(handle(request, shared, reset).await) }
    });
    let builder = auto::Builder::new(TokioExecutor::new());
    let connection = builder.serve_connection(TokioIo::new(stream), service);
    tokio::pin!(connection);
    loop {
        let current = *conditions.borrow_and_update();
        if current.is(InterruptionKind::Refuse) {
            return reset(twin);
        }
        if current.is(InterruptionKind::Blackhole) {
            // Stop reading and answering; keep the socket open until the node comes back, then reset.
            loop {
                tokio::select! {
                    () = stop.cancelled() => return reset(twin),
                    changed = conditions.changed() => {
                        if changed.is_err() || !conditions.borrow().is(InterruptionKind::Blackhole) {
                            return reset(twin);
                        }
                    }
                }
            }
        }
        tokio::select! {
            _ = &mut connection => return,
            () = stop.cancelled() => return reset(twin),
            () = reset_asked.cancelled() => return reset(twin),
            changed = conditions.changed() => if changed.is_err() { return reset(twin) },
        }
    }
}
