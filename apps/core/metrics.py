"""Prometheus metrics: request counters here, domain gauges collected from PostgreSQL.

Gauges about the fleet (members by pool and status, queue depth) are read from the
database at scrape time by collectors that later modules register, so every web process
reports the same truth. Counters and histograms are per process; set
``PROMETHEUS_MULTIPROC_DIR`` under gunicorn to aggregate them.
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
        multiprocess.MultiProcessCollector(registry)
        body = generate_latest(registry)
    else:
        body = generate_latest(REGISTRY)
    db = CollectorRegistry()
    db.register(_DatabaseCollector())
    return body + generate_latest(db), CONTENT_TYPE_LATEST


_GROUP = re.compile(r"\(\?P<(\w+)>[^)]*\)")


def _route_label(route: str) -> str:
    """``api/v1/pools/(?P<pk>[^/.]+)/$`` → ``api/v1/pools/{pk}/``: one label per endpoint."""
    return _GROUP.sub(r"{\1}", route).replace("^", "").replace("$", "")


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
