//! Tracing over OTLP (`tracing.otlp`): a span per request, a child per attempt, and the W3C
//! `traceparent` a node receives, checked against a collector that decodes what tongs exports.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::support::*;
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use opentelemetry_proto::tonic::trace::v1::status::StatusCode as SpanStatus;
use opentelemetry_proto::tonic::trace::v1::{ResourceSpans, Span};
use prost::Message;

/// A fake OpenTelemetry collector speaking the real wire format: an OTLP/HTTP receiver on a real
/// socket that decodes each `POST /v1/traces` body as an `ExportTraceServiceRequest` (the
/// opentelemetry-proto types, protobuf) and keeps its spans with their resource's `service.name`.
struct Collector {
    backend: Backend,
    spans: Arc<Mutex<Vec<(String, Span)>>>,
    /// Requests on any other path, or bodies that did not decode.
    wrong: Arc<AtomicUsize>,
}

impl Collector {
    async fn start() -> Collector {
        let spans = Arc::new(Mutex::new(Vec::new()));
        let wrong = Arc::new(AtomicUsize::new(0));
        let (keep, bad) = (Arc::clone(&spans), Arc::clone(&wrong));
        let backend = backend(move |request: Request<hyper::body::Incoming>| {
            let (keep, bad) = (Arc::clone(&keep), Arc::clone(&bad));
            async move {
                let protobuf = request
                    .headers()
                    .get("content-type")
                    .is_some_and(|v| v == "application/x-protobuf");
                let path_ok = request.method() == "POST" && request.uri().path() == "/v1/traces";
                let body = request.into_body().collect().await.unwrap().to_bytes();
                match ExportTraceServiceRequest::decode(body) {
                    Ok(export) if protobuf && path_ok => {
                        let mut kept = keep.lock().unwrap();
                        for resource in export.resource_spans {
                            let service = service_name(&resource);
                            for scope in resource.scope_spans {
                                kept.extend(scope.spans.into_iter().map(|s| (service.clone(), s)));
                            }
                        }
                    }
                    _ => {
                        bad.fetch_add(1, Ordering::SeqCst);
                    }
                }
                Response::builder()
                    .header("content-type", "application/x-protobuf")
                    .body(full(""))
                    .unwrap()
            }
        })
        .await;
        Collector {
            backend,
            spans,
            wrong,
        }
    }

    fn url(&self) -> String {
        self.backend.url()
    }

    /// The spans received once at least `count` have come (polled, with a deadline).
    async fn spans(&self, count: usize) -> Vec<(String, Span)> {
        eventually(&format!("{count} spans exported"), HANG, || {
            self.spans.lock().unwrap().len() >= count
        })
        .await;
        assert_eq!(self.wrong.load(Ordering::SeqCst), 0, "undecodable exports");
        self.spans.lock().unwrap().clone()
    }
}

fn service_name(resource: &ResourceSpans) -> String {
    resource
        .resource
        .iter()
        .flat_map(|r| &r.attributes)
        .find(|a| a.key == "service.name")
        .and_then(|a| text(a.value.as_ref()?.value.as_ref()?))
        .unwrap_or_default()
}

fn text(value: &Value) -> Option<String> {
    match value {
        Value::StringValue(s) => Some(s.clone()),
        Value::IntValue(i) => Some(i.to_string()),
        _ => None,
    }
}

/// A span's attribute as text.
fn attribute(span: &Span, key: &str) -> Option<String> {
    span.attributes
        .iter()
        .find(|a| a.key == key)
        .and_then(|a| text(a.value.as_ref()?.value.as_ref()?))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn status(span: &Span) -> SpanStatus {
    span.status.as_ref().map_or(SpanStatus::Unset, |s| s.code())
}

/// The `traceparent` and `tracestate` of each request a node received.
type Seen = Arc<Mutex<Vec<(Option<String>, Option<String>)>>>;

/// A backend that records the `traceparent` and `tracestate` of each request and answers 200; its
/// first `failing` requests (counted over every backend sharing `served`) get a 502.
async fn node(seen: Seen, served: Arc<AtomicUsize>, failing: usize) -> Backend {
    backend(move |request: Request<hyper::body::Incoming>| {
        let (seen, served) = (Arc::clone(&seen), Arc::clone(&served));
        async move {
            let header = |name: &str| {
                request
                    .headers()
                    .get(name)
                    .map(|v| v.to_str().unwrap().to_owned())
            };
            seen.lock()
                .unwrap()
                .push((header("traceparent"), header("tracestate")));
            let mut response = Response::new(full("done"));
            if served.fetch_add(1, Ordering::SeqCst) < failing {
                *response.status_mut() = StatusCode::BAD_GATEWAY;
            }
            response
        }
    })
    .await
}

fn traced(collector: &Collector) -> String {
    format!(
        "tracing:\n  otlp:\n    endpoint: {}\n    service_name: tongs-test\n",
        collector.url()
    )
}

const CLIENT_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN: &str = "00f067aa0ba902b7";

/// The one server span among `spans`.
fn server_span(spans: &[(String, Span)]) -> &Span {
    &spans
        .iter()
        .find(|(_, s)| s.kind() == SpanKind::Server)
        .expect("a server span")
        .1
}

/// The client (attempt) spans among `spans`.
fn client_spans(spans: &[(String, Span)]) -> Vec<&Span> {
    spans
        .iter()
        .map(|(_, s)| s)
        .filter(|s| s.kind() == SpanKind::Client)
        .collect()
}

/// GETs `path` through `proxy`, which must answer 200.
async fn get_ok(proxy: &TestProxy, path: &str) {
    let (status, body) = send(Request::get(proxy.url(path)).body(full("")).unwrap()).await;
    assert_eq!(status, 200, "{body}");
}

#[tokio::test]
async fn a_request_is_a_server_span_with_an_attempt_child_whose_traceparent_the_node_gets() {
    let collector = Collector::start().await;
    let seen = Arc::default();
    let node = node(Arc::clone(&seen), Arc::default(), 0).await;
    let proxy = start_proxy(config_with(&traced(&collector), &[node.url()])).await;

    let request = Request::post(proxy.url("/v1/completions?x=1"))
        .header("x-request-id", "req-trace-1")
        .body(full("{}"))
        .unwrap();
    let (code, body) = send(request).await;
    assert_eq!((code, body.as_str()), (200, "done"));
    proxy.stop().await;

    let spans = collector.spans(2).await;
    assert_eq!(spans.len(), 2, "{spans:#?}");
    let server = server_span(&spans);
    let client = client_spans(&spans)[0];
    assert!(spans.iter().all(|(service, _)| service == "tongs-test"));
    assert!(
        server.parent_span_id.is_empty(),
        "a root without a client traceparent"
    );
    assert_eq!(
        attribute(server, "http.request.method").as_deref(),
        Some("POST")
    );
    assert_eq!(
        attribute(server, "url.path").as_deref(),
        Some("/v1/completions")
    );
    assert_eq!(
        attribute(server, "http.response.status_code").as_deref(),
        Some("200")
    );
    assert_eq!(
        attribute(server, "tongs.request_id").as_deref(),
        Some("req-trace-1")
    );
    assert_eq!(attribute(server, "tongs.pool").as_deref(), Some("default"));
    assert_eq!(status(server), SpanStatus::Unset);

    assert_eq!(client.trace_id, server.trace_id);
    assert_eq!(client.parent_span_id, server.span_id);
    assert_eq!(attribute(client, "tongs.attempt").as_deref(), Some("1"));
    assert_eq!(
        attribute(client, "tongs.attempt.kind").as_deref(),
        Some("first")
    );
    assert_eq!(
        attribute(client, "tongs.attempt.outcome").as_deref(),
        Some("committed")
    );
    assert_eq!(attribute(client, "url.full"), Some(node.url()));
    assert_eq!(
        attribute(client, "server.address").as_deref(),
        Some("127.0.0.1")
    );
    assert_eq!(
        attribute(client, "http.response.status_code").as_deref(),
        Some("200")
    );
    assert_eq!(status(client), SpanStatus::Unset);

    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 1);
    let expected = format!("00-{}-{}-01", hex(&server.trace_id), hex(&client.span_id));
    assert_eq!(seen[0].0.as_deref(), Some(expected.as_str()));
}

#[tokio::test]
async fn a_client_traceparent_makes_the_request_span_its_child() {
    let collector = Collector::start().await;
    let seen = Arc::default();
    let node = node(Arc::clone(&seen), Arc::default(), 0).await;
    let proxy = start_proxy(config_with(&traced(&collector), &[node.url()])).await;

    let request = Request::get(proxy.url("/x"))
        .header("traceparent", format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"))
        .header("tracestate", "vendor=abc")
        .body(full(""))
        .unwrap();
    assert_eq!(send(request).await.0, 200);
    proxy.stop().await;

    let spans = collector.spans(2).await;
    assert_eq!(spans.len(), 2, "{spans:#?}");
    let server = server_span(&spans);
    let client = client_spans(&spans)[0];
    assert_eq!(hex(&server.trace_id), CLIENT_TRACE);
    assert_eq!(hex(&server.parent_span_id), CLIENT_SPAN);
    assert_eq!(client.parent_span_id, server.span_id);
    let seen = seen.lock().unwrap().clone();
    assert_eq!(
        seen[0].0,
        Some(format!("00-{CLIENT_TRACE}-{}-01", hex(&client.span_id))),
        "the node's parent is the attempt, in the client's trace"
    );
    assert_eq!(seen[0].1.as_deref(), Some("vendor=abc"));
}

#[tokio::test]
async fn a_retry_after_a_failing_node_is_a_second_attempt_span() {
    let collector = Collector::start().await;
    let (seen, served) = (Arc::default(), Arc::new(AtomicUsize::new(0)));
    // Whichever node is tried first fails; the retry goes to the other.
    let a = node(Arc::clone(&seen), Arc::clone(&served), 1).await;
    let b = node(Arc::clone(&seen), Arc::clone(&served), 1).await;
    let yaml = format!(
        "{}hedge: {{ enabled: false }}\nretry: {{ backoff_base: 0s, backoff_max: 0s }}\n",
        traced(&collector)
    );
    let proxy = start_proxy(config_with(&yaml, &[a.url(), b.url()])).await;

    get_ok(&proxy, "/r").await;
    proxy.stop().await;

    let spans = collector.spans(3).await;
    assert_eq!(spans.len(), 3, "{spans:#?}");
    let server = server_span(&spans);
    let mut attempts = client_spans(&spans);
    attempts.sort_by_key(|s| attribute(s, "tongs.attempt"));
    assert_eq!(attempts.len(), 2);
    assert!(attempts.iter().all(|s| s.parent_span_id == server.span_id));
    let (first, retry) = (attempts[0], attempts[1]);
    assert_eq!(
        attribute(first, "tongs.attempt.kind").as_deref(),
        Some("first")
    );
    assert_eq!(
        attribute(first, "tongs.attempt.outcome").as_deref(),
        Some("failed")
    );
    assert_eq!(attribute(first, "error.type").as_deref(), Some("502"));
    assert_eq!(
        attribute(first, "http.response.status_code").as_deref(),
        Some("502")
    );
    assert_eq!(status(first), SpanStatus::Error);
    assert_eq!(attribute(retry, "tongs.attempt").as_deref(), Some("2"));
    assert_eq!(
        attribute(retry, "tongs.attempt.kind").as_deref(),
        Some("retry")
    );
    assert_eq!(
        attribute(retry, "tongs.attempt.outcome").as_deref(),
        Some("committed")
    );
    assert_eq!(status(retry), SpanStatus::Unset);
    assert_ne!(attribute(first, "url.full"), attribute(retry, "url.full"));

    // Each node was told its own attempt's span.
    let seen = seen.lock().unwrap().clone();
    let parents: Vec<String> = seen
        .iter()
        .map(|(traceparent, _)| traceparent.clone().unwrap()[36..52].to_owned())
        .collect();
    assert_eq!(parents, vec![hex(&first.span_id), hex(&retry.span_id)]);
}

#[tokio::test]
async fn off_by_default_the_client_traceparent_goes_on_untouched() {
    let seen = Arc::default();
    let node = node(Arc::clone(&seen), Arc::default(), 0).await;
    // No `tracing:` at all: the default is off.
    let proxy = start_proxy(config_with("", &[node.url()])).await;
    let traceparent = format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01");
    let request = Request::get(proxy.url("/x"))
        .header("traceparent", &traceparent)
        .header("tracestate", "vendor=abc")
        .body(full(""))
        .unwrap();
    assert_eq!(send(request).await.0, 200);
    proxy.stop().await;

    let seen = seen.lock().unwrap().clone();
    assert_eq!(
        seen,
        vec![(Some(traceparent), Some("vendor=abc".to_owned()))]
    );
}

#[tokio::test]
async fn a_hedge_that_wins_is_an_attempt_span_and_the_slow_one_is_cancelled() {
    let collector = Collector::start().await;
    let served = Arc::new(AtomicUsize::new(0));
    // Whichever node gets the first request never answers it; the hedge goes to the other.
    let hanging = |served: Arc<AtomicUsize>| {
        backend(move |_request: Request<hyper::body::Incoming>| {
            let served = Arc::clone(&served);
            async move {
                if served.fetch_add(1, Ordering::SeqCst) == 0 {
                    std::future::pending::<()>().await;
                }
                Response::new(full("done"))
            }
        })
    };
    let a = hanging(Arc::clone(&served)).await;
    let b = hanging(Arc::clone(&served)).await;
    let yaml = format!(
        "{}hedge: {{ min_delay: 20ms, max_extra_percent: 100 }}\n",
        traced(&collector)
    );
    let proxy = start_proxy(config_with(&yaml, &[a.url(), b.url()])).await;

    get_ok(&proxy, "/h").await;
    proxy.stop().await;

    let spans = collector.spans(3).await;
    let server = server_span(&spans);
    let attempts = client_spans(&spans);
    assert_eq!(attempts.len(), 2, "{spans:#?}");
    assert!(attempts.iter().all(|s| s.parent_span_id == server.span_id));
    let kind_of = |kind: &str| {
        *attempts
            .iter()
            .find(|s| attribute(s, "tongs.attempt.kind").as_deref() == Some(kind))
            .unwrap_or_else(|| panic!("no {kind} attempt in {attempts:#?}"))
    };
    let (first, hedge) = (kind_of("first"), kind_of("hedge"));
    assert_eq!(
        attribute(first, "tongs.attempt.outcome").as_deref(),
        Some("cancelled")
    );
    assert_eq!(status(first), SpanStatus::Unset);
    assert_eq!(attribute(hedge, "tongs.attempt").as_deref(), Some("2"));
    assert_eq!(
        attribute(hedge, "tongs.attempt.outcome").as_deref(),
        Some("committed")
    );
}

#[tokio::test]
async fn a_tenants_request_names_it_and_a_refusal_is_a_span_too() {
    let collector = Collector::start().await;
    let seen = Arc::default();
    let node = node(Arc::clone(&seen), Arc::default(), 0).await;
    let dir = TempDir::new("tongs-tracing-keys");
    let keys = dir.0.join("keys.yaml");
    std::fs::write(&keys, "team-a: [\"sk-team-a-0123456789abcdef\"]\n").unwrap();
    let yaml = format!(
        "{}auth: {{ keys_file: {} }}\n",
        traced(&collector),
        keys.display()
    );
    let proxy = start_proxy(config_with(&yaml, &[node.url()])).await;

    let keyed = Request::get(proxy.url("/t"))
        .header("authorization", "Bearer sk-team-a-0123456789abcdef")
        .body(full(""))
        .unwrap();
    assert_eq!(send(keyed).await.0, 200);
    // No key: tongs answers 401 itself, with no attempt.
    assert_eq!(
        send(Request::get(proxy.url("/t")).body(full("")).unwrap())
            .await
            .0,
        401
    );
    proxy.stop().await;

    let spans = collector.spans(3).await;
    assert_eq!(spans.len(), 3, "{spans:#?}");
    let servers: Vec<&Span> = spans
        .iter()
        .map(|(_, s)| s)
        .filter(|s| s.kind() == SpanKind::Server)
        .collect();
    let status_of = |span: &Span| attribute(span, "http.response.status_code");
    let ok = servers
        .iter()
        .find(|s| status_of(s).as_deref() == Some("200"))
        .expect("the keyed request's span");
    assert_eq!(attribute(ok, "tongs.tenant").as_deref(), Some("team-a"));
    let refused = servers
        .iter()
        .find(|s| status_of(s).as_deref() == Some("401"))
        .expect("the refused request's span");
    assert_eq!(attribute(refused, "tongs.tenant"), None);
    assert_eq!(attribute(refused, "tongs.pool"), None);
    assert_eq!(status(refused), SpanStatus::Unset, "a 4xx is the client's");
}

#[tokio::test]
async fn a_trace_not_sampled_is_not_exported_but_the_node_still_gets_a_traceparent() {
    let collector = Collector::start().await;
    let seen: Seen = Arc::default();
    let node = node(Arc::clone(&seen), Arc::default(), 0).await;
    let yaml = format!("{}    sample_ratio: 0\n", traced(&collector));
    let proxy = start_proxy(config_with(&yaml, &[node.url()])).await;
    // One trace tongs starts (ratio 0: not recorded), one a client sampled (recorded: parent-based).
    get_ok(&proxy, "/s").await;
    let sampled = Request::get(proxy.url("/s"))
        .header("traceparent", format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"))
        .body(full(""))
        .unwrap();
    assert_eq!(send(sampled).await.0, 200);
    proxy.stop().await;

    let spans = collector.spans(2).await;
    assert_eq!(
        spans.len(),
        2,
        "only the client's sampled trace: {spans:#?}"
    );
    assert!(spans.iter().all(|(_, s)| hex(&s.trace_id) == CLIENT_TRACE));
    let seen = seen.lock().unwrap().clone();
    let flags: Vec<String> = seen
        .iter()
        .map(|(traceparent, _)| traceparent.clone().expect("a traceparent")[53..].to_owned())
        .collect();
    assert_eq!(flags, vec!["00", "01"]);
}
