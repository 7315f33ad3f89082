//! Trace context: the W3C `traceparent` of the code that enqueues an event travels with it.
//!
//! At enqueue, the current OpenTelemetry context (when it holds a valid span) is written into the
//! event's headers as `traceparent` (and `tracestate` when present); every sink forwards headers, so
//! a trace spans producer → relay → consumer. Applications using `tracing-opentelemetry` make a
//! span's context current with `let _guard = tracing::Span::current().context().attach();`.

use opentelemetry::trace::TraceContextExt;

/// The header carrying the W3C trace context.
pub const TRACEPARENT: &str = "traceparent";
/// The header carrying vendor trace state.
pub const TRACESTATE: &str = "tracestate";

/// `traceparent` (and `tracestate`) of the current OpenTelemetry context, if it has a valid span.
pub fn current() -> Option<(String, Option<String>)> {
    let context = opentelemetry::Context::current();
    let span = context.span();
    let sc = span.span_context();
    if !sc.is_valid() {
        return None;
    }
    let traceparent = format!(
        "00-{}-{}-{:02x}",
        sc.trace_id(),
        sc.span_id(),
        sc.trace_flags().to_u8()
    );
    let state = sc.trace_state().header();
    Some((traceparent, (!state.is_empty()).then_some(state)))
}

#[cfg(test)]
mod tests {
    use opentelemetry::trace::{SpanContext, SpanId, TraceFlags, TraceId, TraceState};

    use super::*;

    #[test]
    fn the_current_span_becomes_a_traceparent() {
        assert_eq!(current(), None, "no span, no header");
        let sc = SpanContext::new(
            TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").expect("hex"),
            SpanId::from_hex("00f067aa0ba902b7").expect("hex"),
            TraceFlags::SAMPLED,
            true,
            TraceState::default(),
        );
        let _guard = opentelemetry::Context::current()
            .with_remote_span_context(sc)
            .attach();
        assert_eq!(
            current(),
            Some((
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into(),
                None
            ))
        );
    }
}
