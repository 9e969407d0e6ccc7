"""Tracing with OpenTelemetry: off by default, on with the standard ``OTEL_*`` variables.

Every job is one trace: the submit's request starts it (its W3C ``traceparent`` is kept on the
job), and whatever moves the job later, in any process, adds a span under it: admission,
placement (the pool claim within it), the wake-up sent to the agent, the agent server's answer
to the poll, the agent's own ``poll`` and ``start`` (the trace id travels to the agent in the job
payload, ``JobPayload.traceparent``, and back as the ``traceparent`` header of its reports). The
official instrumentations add Django's requests, Celery's tasks, psycopg's statements and Redis'
commands around them.

On when the extra is installed (``pip install 'catacloud[tracing]'``) and either
``OTEL_TRACES_EXPORTER`` names an exporter (``otlp``, ``console``, or ``file``: JSON lines into
``CATACLOUD_TRACES_FILE``, Catacloud's own) or ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or
``..._TRACES_ENDPOINT``) is set; ``OTEL_SDK_DISABLED=true`` turns it off. ``OTEL_SERVICE_NAME``,
the sampler (``OTEL_TRACES_SAMPLER``) and the exporters' own variables are read by the SDK as
usual. Off, every function here costs a check of one flag.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

log = logging.getLogger(__name__)

_on = False
_setup_lock = threading.Lock()
_tracer: Any = None


def wanted(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the environment asks for tracing (the standard variables)."""
    if environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    exporters = [e.strip() for e in environ.get("OTEL_TRACES_EXPORTER", "").split(",") if e.strip()]
    if exporters:
        return exporters != ["none"]
    return bool(
        environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


def on() -> bool:
    return _on


def setup(service: str, environ: Mapping[str, str] = os.environ) -> bool:
    """Start tracing in this process (once) when the environment asks for it; ``service``:
    ``web``, ``agent-server``, ``worker``, ``beat`` (``OTEL_SERVICE_NAME`` overrides
    ``catacloud-<service>``). Returns whether tracing is on."""
    global _on, _tracer
    with _setup_lock:
        if _on or not wanted(environ):
            return _on
        try:
            from opentelemetry import trace
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError:
            log.warning("OTEL_* asks for traces but the tracing extra is not installed: catacloud[tracing]")
            return False
        name = environ.get("OTEL_SERVICE_NAME") or f"catacloud-{service}"
        provider = TracerProvider(resource=Resource.create({"service.name": name}))
        for exporter in _exporters(environ):
            provider.add_span_processor(BatchSpanProcessor(exporter))
        trace.set_tracer_provider(provider)
        _instrument()
        _tracer = trace.get_tracer("catacloud")
        _on = True
        log.info("tracing on (%s)", name)
        return True


def _exporters(environ: Mapping[str, str]) -> list[Any]:
    names = [e.strip() for e in environ.get("OTEL_TRACES_EXPORTER", "otlp").split(",") if e.strip()]
    out: list[Any] = []
    for name in names:
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            out.append(OTLPSpanExporter())
        elif name == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            out.append(ConsoleSpanExporter())
        elif name == "file":
            out.append(_file_exporter(environ.get("CATACLOUD_TRACES_FILE") or "catacloud-traces.jsonl"))
        elif name != "none":
            log.warning("OTEL_TRACES_EXPORTER=%s: unknown exporter, ignored (otlp, console, file)", name)
    return out


def _file_exporter(path: str) -> Any:
    """Spans as JSON lines appended to ``path`` (one process or many: each line is one write)."""
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    class FileSpanExporter(SpanExporter):
        def export(self, spans: Sequence[Any]) -> SpanExportResult:
            lines = "".join(json.dumps(span_record(s)) + "\n" for s in spans)
            with open(path, "a", encoding="utf-8") as fh:
                fh.write(lines)
            return SpanExportResult.SUCCESS

    return FileSpanExporter()


def span_record(span: Any) -> dict[str, Any]:
    """What the file exporter writes of a finished span (and ``jobs show --timing`` reads)."""
    ctx = span.get_span_context()
    return {
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_id": f"{span.parent.span_id:016x}" if span.parent is not None else "",
        "name": span.name,
        "service": span.resource.attributes.get("service.name", ""),
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "attributes": {k: v for k, v in (span.attributes or {}).items() if isinstance(v, str | int | float)},
    }


def _instrument() -> None:
    """The official instrumentations that are installed (each optional)."""
    for module, cls, kwargs in (
        ("opentelemetry.instrumentation.django", "DjangoInstrumentor", {}),
        ("opentelemetry.instrumentation.psycopg", "PsycopgInstrumentor", {"enable_commenter": False}),
        ("opentelemetry.instrumentation.redis", "RedisInstrumentor", {}),
        ("opentelemetry.instrumentation.celery", "CeleryInstrumentor", {}),
    ):
        try:
            instrumentor = getattr(__import__(module, fromlist=[cls]), cls)()
        except ImportError:
            continue
        if not instrumentor.is_instrumented_by_opentelemetry:
            instrumentor.instrument(**kwargs)


# ---- the spans of our own ----------------------------------------------------------------------


def _context(traceparent: str) -> Any:
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract({"traceparent": traceparent}) if traceparent else None


@contextlib.contextmanager
def span(name: str, *, traceparent: str = "", **attributes: Any) -> Iterator[Any]:
    """A span around the block: under ``traceparent`` (a job's trace) when given, else under
    the current span. Off: nothing."""
    if not _on:
        yield None
        return
    with _tracer.start_as_current_span(name, context=_context(traceparent), attributes=attributes) as s:
        yield s


def record(name: str, *, traceparent: str, start: float, end: float | None = None, **attributes: Any) -> None:
    """A span already over, in a job's trace: ``start``/``end`` are ``time.time()`` seconds (a
    batch that moved many jobs records one span in each job's trace)."""
    if not _on or not traceparent:
        return
    s = _tracer.start_span(
        name, context=_context(traceparent), start_time=int(start * 1e9), attributes=attributes
    )
    s.end(end_time=int((end if end is not None else time.time()) * 1e9))


def current_traceparent() -> str:
    """The W3C ``traceparent`` of the current span ("" when off or outside any)."""
    if not _on:
        return ""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier)
    return carrier.get("traceparent", "")


def trace_id(traceparent: str) -> str:
    """The trace id of a ``traceparent`` (``00-<trace id>-<span id>-<flags>``), or ""."""
    parts = traceparent.split("-")
    return parts[1] if len(parts) == 4 and len(parts[1]) == 32 else ""
