from __future__ import annotations

import hmac
from typing import Any

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.http import require_GET

from apps.core import health, metrics
from apps.core.errors import ErrorCode, error_payload


def _health_answer(request: HttpRequest, code: int, body: dict[str, Any]) -> JsonResponse:
    """A health answer: its ``status`` for everyone; the ``checks`` (which part is down, how
    long each took, how many workers) only with the metrics token (``Authorization: Bearer``)
    or a staff session. A wrong token is a 401, not a silently shorter answer."""
    given = request.headers.get("Authorization", "")
    if given:
        expected = settings.CATACLOUD_METRICS_TOKEN
        token = given.removeprefix("Bearer ").strip()
        if not expected or not hmac.compare_digest(token.encode(), expected.encode()):
            return JsonResponse(
                error_payload(ErrorCode.NOT_AUTHENTICATED, "health details need the metrics token"),
                status=401,
            )
    elif not getattr(getattr(request, "user", None), "is_staff", False):
        body = {"status": body["status"]}
    return JsonResponse(body, status=code)


@require_GET
def healthz(request: HttpRequest) -> JsonResponse:
    code, body = health.health()
    return _health_answer(request, code, body)


@require_GET
def livez(request: HttpRequest) -> JsonResponse:
    """Liveness: the process answers requests. No dependency is asked (a database outage must
    not get every web process restarted)."""
    return JsonResponse({"status": "alive"})


@require_GET
def readyz(request: HttpRequest) -> JsonResponse:
    """Readiness: database, broker, a worker and beat all up; 503 until then. A 503 here is an
    answer, not a server error: Django's request log (ERROR for every 5xx) leaves it out, or a
    start polled each second would print a line per second."""
    code, body = health.readiness()
    response = _health_answer(request, code, body)
    response._has_been_logged = True  # type: ignore[attr-defined]  # see django.utils.log.log_response
    return response


@require_GET
def metrics_view(request: HttpRequest) -> HttpResponse:
    """Prometheus text format. Scrapers send CATACLOUD_METRICS_TOKEN as Bearer; without a token
    configured the endpoint is closed unless CATACLOUD_METRICS_PUBLIC opens it (it names every
    org and pool)."""
    expected = settings.CATACLOUD_METRICS_TOKEN
    if not expected and not settings.CATACLOUD_METRICS_PUBLIC:
        return JsonResponse(
            error_payload(
                ErrorCode.METRICS_CLOSED,
                "set CATACLOUD_METRICS_TOKEN (or CATACLOUD_METRICS_PUBLIC=true) to serve metrics",
            ),
            status=403,
        )
    if expected:
        given = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), expected.encode()):
            return JsonResponse(
                error_payload(ErrorCode.NOT_AUTHENTICATED, "metrics need the metrics token"), status=401
            )
    body, content_type = metrics.render()
    return HttpResponse(body, content_type=content_type)


def _wants_json(request: HttpRequest) -> bool:
    return request.path.startswith("/api/") or request.path in ("/healthz", "/livez", "/readyz", "/metrics")


def not_found(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    if _wants_json(request):
        return JsonResponse(error_payload(ErrorCode.NOT_FOUND, "no such endpoint"), status=404)
    from django.views.defaults import page_not_found

    return page_not_found(request, exception)


def server_error(request: HttpRequest) -> HttpResponse:
    if _wants_json(request):
        return JsonResponse(error_payload(ErrorCode.SERVER_ERROR, "internal error"), status=500)
    from django.views.defaults import server_error as default

    return default(request)
