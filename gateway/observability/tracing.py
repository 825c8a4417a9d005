"""OpenTelemetry: a tracer per app; spans for auth, policy, queue, prefill and decode.

Off the wire by default: spans go nowhere unless PREFIXGATE_OTLP_ENDPOINT names an OTLP/HTTP
collector. Tests attach their own in-memory exporter.
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Span, Tracer

from engine.request import Timings


def make_tracer_provider(otlp_endpoint: str | None) -> TracerProvider:
    """A provider for one app; it exports to `otlp_endpoint` when one is given."""
    provider = TracerProvider(resource=Resource.create({"service.name": "prefixgate"}))
    if otlp_endpoint:  # the exporter is loaded only when spans are sent somewhere
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint)))
    return provider


def record_engine_phases(tracer: Tracer, parent: Span, timings: Timings) -> None:
    """Queue, prefill and decode spans from the engine's own timestamps."""
    context = trace.set_span_in_context(parent)
    phases = (
        ("queue", timings.arrived, timings.admitted),
        ("prefill", timings.admitted, timings.first_token),
        ("decode", timings.first_token, timings.finished),
    )
    for name, start, end in phases:
        span = tracer.start_span(name, context=context, start_time=int(start * 1e9))
        span.end(end_time=int(max(end, start) * 1e9))
