"""OpenTelemetry: one trace per request, with admission, queue-wait, prefill and decode spans.

Off unless `--otel` is given or an OTLP endpoint is configured through the standard OTEL_* variables;
when off nothing is imported and `RequestTracer.record` is never reached. Spans are written after
the request ends, from the times the engine measured, so tracing adds nothing to the step loop.
Exporter: OTLP over HTTP when OTEL_EXPORTER_OTLP_ENDPOINT (or ..._TRACES_ENDPOINT) is set, else the
console.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

_OTLP_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")


@dataclass(frozen=True)
class RequestTimes:
    """Wall-clock nanoseconds of one request's stages (the engine's measures, shifted to wall time)."""

    received: int  # the HTTP request arrived
    submitted: int  # admitted and handed to the engine
    scheduled: int | None  # left the waiting queue
    first_token: int | None
    finished: int


def tracing_requested(flag: bool) -> bool:
    return flag or any(os.environ.get(name) for name in _OTLP_VARIABLES)


class RequestTracer:
    def __init__(self, service_name: str = "tinymlx", exporter=None):
        """`exporter`: an OpenTelemetry SpanExporter (default: OTLP or the console, as configured)."""
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

        if exporter is not None:
            pass
        elif any(os.environ.get(name) for name in _OTLP_VARIABLES):
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter()  # endpoint, headers and timeouts from the OTEL_* variables
        else:
            exporter = ConsoleSpanExporter()
        self._provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self._provider.add_span_processor(BatchSpanProcessor(exporter))
        self._tracer = self._provider.get_tracer("tinymlx.server")

    def record(self, name: str, times: RequestTimes, attributes: dict) -> None:
        from opentelemetry.trace import set_span_in_context

        root = self._tracer.start_span(name, start_time=times.received, attributes=attributes)
        context = set_span_in_context(root)
        stages = [("admission", times.received, times.submitted),
                  ("queue_wait", times.submitted, times.scheduled),
                  ("prefill", times.scheduled, times.first_token),
                  ("decode", times.first_token, times.finished)]
        for stage, start, end in stages:
            if start is not None and end is not None:
                self._tracer.start_span(stage, context=context, start_time=start).end(end_time=end)
        root.end(end_time=times.finished)

    def flush(self) -> None:
        self._provider.force_flush()

    def shutdown(self) -> None:
        self._provider.shutdown()  # flushes what the batch processor holds
