"""Prometheus metrics: request counters here, domain figures collected from PostgreSQL.

Two sources, so that a scrape answers the same whichever web process serves it:

- **PostgreSQL at scrape time** (collectors that later modules register): the fleet (members
  by pool and status), the queue (jobs by status) and job wait times. These are facts of rows
  that workers write, so they are right wherever the worker runs (another host, another
  container) and whichever web process is asked.
- **In-process counters and histograms** (HTTP requests and latency, claim latency) live in
  each process; with ``PROMETHEUS_MULTIPROC_DIR`` set (``make dev`` and docker-compose set it
  for web and worker, one directory shared by both) prometheus_client writes them to files
  there and every scrape sums every process's files. Without it (one process) they are that
  process's own.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterable

from django.http import HttpRequest, HttpResponse
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, multiprocess
from prometheus_client.core import REGISTRY, Metric
from prometheus_client.registry import Collector

HTTP_REQUESTS = Counter(
    "catacloud_http_requests_total", "HTTP requests handled", ["method", "route", "status"]
)
HTTP_LATENCY = Histogram(
    "catacloud_http_request_duration_seconds",
    "HTTP request latency",
    ["method", "route"],
    buckets=(0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)

_db_collectors: list[Callable[[], Iterable[Metric]]] = []


def register_db_collector(fn: Callable[[], Iterable[Metric]]) -> Callable[[], Iterable[Metric]]:
    """Register a function yielding metrics read from PostgreSQL at scrape time."""
    _db_collectors.append(fn)
    return fn


class _DatabaseCollector(Collector):
    def collect(self) -> Iterable[Metric]:
        for fn in _db_collectors:
            yield from fn()


def render() -> tuple[bytes, str]:
    from prometheus_client import CONTENT_TYPE_LATEST

    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]  # untyped upstream
        body = generate_latest(registry)
    else:
        body = generate_latest(REGISTRY)
    db = CollectorRegistry()
    db.register(_DatabaseCollector())
    return body + generate_latest(db), CONTENT_TYPE_LATEST


_CONVERTER = re.compile(r"<(?:\w+:)?(\w+)>")


def _route_label(route: str) -> str:
    """One label style for every endpoint, whether its pattern is a regex (DRF routers) or a
    ``path()`` with converters: ``api/v1/pools/(?P<pk>[^/.]+)/$`` → ``/api/v1/pools/{pk}/``,
    ``api/agent/v1/jobs/<uuid:job_id>/finished`` → ``/api/agent/v1/jobs/{job_id}/finished``."""
    out: list[str] = []
    i = 0
    while i < len(route):
        if route.startswith("(?P<", i):  # a named group, whatever it nests: {name}
            end = route.index(">", i)
            name, depth, k = route[i + 4 : end], 1, end + 1
            while k < len(route) and depth:
                if route[k] == "\\":
                    k += 1
                elif route[k] == "(":
                    depth += 1
                elif route[k] == ")":
                    depth -= 1
                k += 1
            out.append("{" + name + "}")
            i = k
            continue
        ch = route[i]
        if ch == "\\" and i + 1 < len(route):
            out.append(route[i + 1])
            i += 2
            continue
        if ch not in "^$?":
            out.append(ch)
        i += 1
    return "/" + _CONVERTER.sub(r"{\1}", "".join(out)).lstrip("/")


class RequestMetricsMiddleware:
    """Counts requests by method, resolved route pattern (not raw path) and status."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        start = time.perf_counter()
        response = self.get_response(request)
        match = getattr(request, "resolver_match", None)
        route = _route_label(match.route) if match is not None else "unmatched"
        HTTP_REQUESTS.labels(request.method, route, str(response.status_code)).inc()
        HTTP_LATENCY.labels(request.method, route).observe(time.perf_counter() - start)
        return response
