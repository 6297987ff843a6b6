//! Traces over OTLP/HTTP (`tracing.otlp`): one SERVER span per client request, one CLIENT span per
//! attempt beneath it (first, retry, hedge or continuation), and a W3C `traceparent` naming the
//! attempt's span sent to the node.
//!
//! The OpenTelemetry API is used directly, not through `tracing-opentelemetry`: tongs' `tracing`
//! events are its log, and a subscriber layer would turn every log span into a trace span, be one
//! global per process (tests run several tongs in one), and cost every request a subscriber call even
//! with tracing off. Here tracing off is one branch per request ([`Traces::request`] finds no
//! exporter) and nothing is allocated; the request's other hooks see `None` and do nothing.
//!
//! Spans go through the SDK's batch span processor, which exports on its own thread with reqwest's
//! blocking client: nothing runs on the workers' current-thread runtimes but building the spans. A
//! full export queue drops spans, never blocks a request.
//!
//! The exporter is made once, by the first configuration applied; a reload that changes `tracing`
//! needs a restart (see `reload`). [`Traces::shutdown`] exports what is left when tongs stops.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, OnceLock};

use http::header::{HeaderMap, HeaderName, HeaderValue};
use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::{
    Span as _, SpanContext, SpanKind, Status, TraceContextExt, Tracer as _, TracerProvider as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{BatchSpanProcessor, Sampler, SdkTracer, SdkTracerProvider, Span};

use crate::config::OtlpConfig;

pub static TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");
pub static TRACESTATE: HeaderName = HeaderName::from_static("tracestate");

/// The exporter, if tracing is on. Set by the first configuration applied, and only then.
#[derive(Default)]
pub struct Traces {
    exporter: OnceLock<Option<Exporter>>,
}

struct Exporter {
    provider: SdkTracerProvider,
    tracer: SdkTracer,
}

/// Why the exporter could not be made.
#[derive(Debug, thiserror::Error)]
#[error("cannot start the OTLP exporter (tracing.otlp): {0}")]
pub struct ExporterError(String);

impl Traces {
    /// Starts exporting as `config` says, the first time it is called; later calls change nothing
    /// (a change of `tracing` needs a restart).
    pub fn configure(&self, config: &OtlpConfig) -> Result<(), ExporterError> {
        if self.exporter.get().is_some() {
            return Ok(());
        }
        let exporter = if config.enabled() {
            Some(Exporter::new(config)?)
        } else {
            None
        };
        if let Some(exporter) = &exporter {
            tracing::info!(endpoint = %config.traces_url(), "exporting traces over OTLP");
            // Lost a race with another first configuration: that one stands.
            if self.exporter.get().is_some() {
                let _ = exporter.provider.shutdown();
            }
        }
        let _ = self.exporter.set(exporter);
        Ok(())
    }

    /// The span of a client request, started now; `None` when tracing is off. A `traceparent` (and
    /// `tracestate`) the client sent makes it that span's child, and its sampled flag decides.
    pub fn request(
        &self,
        method: &http::Method,
        path: &str,
        headers: &HeaderMap,
    ) -> Option<RequestSpan> {
        let exporter = self.exporter.get()?.as_ref()?;
        let parent = TraceContextPropagator::new()
            .extract_with_context(&Context::new(), &HeaderExtractor(headers));
        let span = exporter
            .tracer
            .span_builder(method.as_str().to_owned())
            .with_kind(SpanKind::Server)
            .with_attributes([
                KeyValue::new("http.request.method", method.as_str().to_owned()),
                KeyValue::new("url.path", path.to_owned()),
            ])
            .start_with_context(&exporter.tracer, &parent);
        let context = Context::new().with_remote_span_context(span.span_context().clone());
        let trace = Arc::new(RequestTrace {
            tracer: exporter.tracer.clone(),
            context,
            method: method.clone(),
            attempts: AtomicU32::new(0),
        });
        Some(RequestSpan {
            span: Box::new(span),
            trace,
        })
    }

    /// Exports the spans not sent yet and stops the exporter (its thread blocks until done, so it
    /// runs on the blocking pool).
    pub async fn shutdown(&self) {
        let Some(Some(exporter)) = self.exporter.get() else {
            return;
        };
        let provider = exporter.provider.clone();
        let done = tokio::task::spawn_blocking(move || provider.shutdown()).await;
        if let Ok(Err(error)) = done {
            tracing::warn!(%error, "the last spans could not be exported");
        }
    }
}

impl Exporter {
    fn new(config: &OtlpConfig) -> Result<Exporter, ExporterError> {
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary)
            .with_endpoint(config.traces_url())
            .with_timeout(config.timeout.get())
            .build()
            .map_err(|e| ExporterError(e.to_string()))?;
        let provider = SdkTracerProvider::builder()
            .with_span_processor(BatchSpanProcessor::builder(exporter).build())
            .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
                config.sample_ratio,
            ))))
            .with_resource(
                Resource::builder()
                    .with_service_name(config.service_name.clone())
                    .build(),
            )
            .build();
        let tracer = provider.tracer("tongs");
        Ok(Exporter { provider, tracer })
    }
}

/// A client request's span, ended when its answer ends ([`RequestSpan::end`]).
///
/// The SDK's span is a few hundred bytes: boxed, so that `Option<RequestSpan>` (and `AttemptSpan`'s)
/// adds a word, not its size, to every request's future when tracing is off.
pub struct RequestSpan {
    span: Box<Span>,
    trace: Arc<RequestTrace>,
}

impl RequestSpan {
    /// What the request's attempts are traced under; it travels in the request's extensions.
    pub fn trace(&self) -> Arc<RequestTrace> {
        Arc::clone(&self.trace)
    }

    /// The pool that served the request.
    pub fn set_pool(&mut self, pool: &str) {
        self.span
            .set_attribute(KeyValue::new("tongs.pool", pool.to_owned()));
    }

    /// The tenant the request's API key named.
    pub fn set_tenant(&mut self, tenant: &str) {
        self.span
            .set_attribute(KeyValue::new("tongs.tenant", tenant.to_owned()));
    }

    /// The answer's status and request id are known: the span ends when the returned guard is
    /// dropped (with the answer's body, so a stream's at its last byte). A 5xx is an error.
    pub fn end(mut self, status: u16, request_id: Option<&HeaderValue>) -> Box<dyn Send> {
        self.span.set_attribute(KeyValue::new(
            "http.response.status_code",
            i64::from(status),
        ));
        if let Some(id) = request_id.and_then(|id| id.to_str().ok()) {
            self.span
                .set_attribute(KeyValue::new("tongs.request_id", id.to_owned()));
        }
        if status >= 500 {
            self.span.set_status(Status::error(status.to_string()));
        }
        // The SDK's span ends when dropped.
        self.span
    }
}

/// What attempts are traced under: the request span's context.
pub struct RequestTrace {
    tracer: SdkTracer,
    context: Context,
    method: http::Method,
    /// Attempts sent so far.
    attempts: AtomicU32,
}

/// Why an attempt was sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttemptKind {
    /// One after another: the request's first attempt, or a retry after a failed one (told apart by
    /// whether one was sent before).
    Next,
    /// Beside a slow attempt, the first to answer wins.
    Hedge,
    /// Beside an attempt past its stall point, paid as a retry.
    Stalled,
    /// A broken stream continued on another endpoint.
    Continuation,
}

impl RequestTrace {
    /// Starts an attempt's span at `endpoint` (`authority` its host and port) and points the
    /// request's `traceparent` at it, replacing the client's (its `tracestate` goes on, from the
    /// span's context).
    pub fn attempt(
        &self,
        kind: AttemptKind,
        endpoint: &str,
        authority: &http::uri::Authority,
        headers: &mut HeaderMap,
    ) -> AttemptSpan {
        let number = self.attempts.fetch_add(1, Ordering::Relaxed) + 1;
        let kind = match kind {
            AttemptKind::Next if number == 1 => "first",
            AttemptKind::Next | AttemptKind::Stalled => "retry",
            AttemptKind::Hedge => "hedge",
            AttemptKind::Continuation => "continuation",
        };
        let mut attributes = vec![
            KeyValue::new("http.request.method", self.method.as_str().to_owned()),
            KeyValue::new("server.address", authority.host().to_owned()),
            KeyValue::new("url.full", endpoint.to_owned()),
            KeyValue::new("tongs.attempt", i64::from(number)),
            KeyValue::new("tongs.attempt.kind", kind),
        ];
        if let Some(port) = authority.port_u16() {
            attributes.push(KeyValue::new("server.port", i64::from(port)));
        }
        let span = self
            .tracer
            .span_builder(self.method.as_str().to_owned())
            .with_kind(SpanKind::Client)
            .with_attributes(attributes)
            .start_with_context(&self.tracer, &self.context);
        inject(span.span_context(), headers);
        AttemptSpan {
            span: Box::new(span),
            outcome: false,
        }
    }
}

/// An attempt's span: it ends when dropped, with the attempt's outcome, or `cancelled` if it had
/// none (a hedge beat it, or the client left). A committed attempt's span goes with the answer's
/// body, so it ends at the last byte.
pub struct AttemptSpan {
    span: Box<Span>,
    outcome: bool,
}

impl AttemptSpan {
    /// The attempt's answer goes to the client.
    pub fn committed(&mut self, status: u16) {
        self.outcome = true;
        self.span.set_attributes([
            KeyValue::new("tongs.attempt.outcome", "committed"),
            KeyValue::new("http.response.status_code", i64::from(status)),
        ]);
        if status >= 500 {
            self.span.set_status(Status::error(status.to_string()));
        }
    }

    /// The attempt failed for `cause` (`error.type`: `retry.on`'s name of it, a status code for a
    /// failing status); `status` when the node answered.
    pub fn failed(&mut self, cause: String, status: Option<u16>, error: String) {
        self.outcome = true;
        self.span.set_attributes([
            KeyValue::new("tongs.attempt.outcome", "failed"),
            KeyValue::new("error.type", cause),
        ]);
        if let Some(status) = status {
            self.span.set_attribute(KeyValue::new(
                "http.response.status_code",
                i64::from(status),
            ));
        }
        self.span.set_status(Status::error(error));
    }
}

impl Drop for AttemptSpan {
    fn drop(&mut self) {
        if !self.outcome {
            self.span
                .set_attribute(KeyValue::new("tongs.attempt.outcome", "cancelled"));
        }
    }
}

/// Writes `traceparent` (and `tracestate`, when the context has one) for `context`.
fn inject(context: &SpanContext, headers: &mut HeaderMap) {
    let traceparent = format!(
        "00-{}-{}-{:02x}",
        context.trace_id(),
        context.span_id(),
        context.trace_flags().to_u8() & 1
    );
    if let Ok(value) = HeaderValue::from_str(&traceparent) {
        headers.insert(&TRACEPARENT, value);
    }
    let state = context.trace_state().header();
    match HeaderValue::from_str(&state) {
        Ok(value) if !state.is_empty() => {
            headers.insert(&TRACESTATE, value);
        }
        _ => {
            headers.remove(&TRACESTATE);
        }
    }
}

struct HeaderExtractor<'a>(&'a HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(HeaderName::as_str).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::{SpanId, TraceFlags, TraceId, TraceState};

    #[test]
    fn off_is_nothing() {
        let traces = Traces::default();
        traces.configure(&OtlpConfig::default()).unwrap();
        assert!(
            traces
                .request(&http::Method::GET, "/", &HeaderMap::new())
                .is_none()
        );
    }

    #[test]
    fn inject_writes_traceparent_and_only_a_non_empty_tracestate() {
        let context = SpanContext::new(
            TraceId::from_hex("0af7651916cd43dd8448eb211c80319c").unwrap(),
            SpanId::from_hex("b7ad6b7169203331").unwrap(),
            TraceFlags::SAMPLED,
            true,
            TraceState::from_key_value([("vendor", "x")]).unwrap(),
        );
        let mut headers = HeaderMap::new();
        inject(&context, &mut headers);
        assert_eq!(
            headers[&TRACEPARENT],
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        );
        assert_eq!(headers[&TRACESTATE], "vendor=x");
        let plain = SpanContext::new(
            context.trace_id(),
            context.span_id(),
            TraceFlags::default(),
            true,
            TraceState::default(),
        );
        inject(&plain, &mut headers);
        assert!(headers[&TRACEPARENT].to_str().unwrap().ends_with("-00"));
        assert!(headers.get(&TRACESTATE).is_none());
    }
}
