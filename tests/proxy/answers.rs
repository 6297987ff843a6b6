//! What tongs answers when it cannot pass an endpoint's response on: a 504 names the time the
//! attempt was given.
//!
//! Real sockets on 127.0.0.1; the endpoints stand in for GPU nodes.

use crate::support::*;
use http::Request;

/// One attempt per request, so each answer is about the one endpoint configured.
const ONE_ATTEMPT: &str = "retry: { enabled: false }\n";

/// A GET of `path` through `proxy`, with its response head and body.
async fn get_answer(proxy: &TestProxy, path: &str) -> (http::response::Parts, String) {
    exchange(Request::get(proxy.url(path)).body(full("")).unwrap()).await
}

#[tokio::test]
async fn a_504_names_the_timeout_the_attempt_was_given() {
    let silent = Silent::start().await;
    let config = format!("{ONE_ATTEMPT}timeouts: {{ response_headers: 300ms }}\n");
    let proxy = start_proxy(config_with(&config, &[format!("http://{}", silent.addr)])).await;

    let (head, body) = get_answer(&proxy, "/v1/models").await;
    assert_eq!(head.status, 504, "{body}");
    let (error, _) = proxy_error(&body);
    assert!(error.contains("within 300ms"), "{error}");
    proxy.stop().await;
}
