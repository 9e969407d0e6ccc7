"""Every answer under ``/api/`` is JSON ``{code, detail}``, also the ones Django makes itself
(an unknown path or method in DEBUG, an oversized body), never an HTML page. A path without its
trailing slash answers like the path with it."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import is_valid_path

from apps.core.errors import ErrorCode, error_payload

log = logging.getLogger(__name__)

CODES = {
    400: (ErrorCode.INVALID, "bad request"),
    403: (ErrorCode.PERMISSION_DENIED, "forbidden"),
    404: (ErrorCode.NOT_FOUND, "no such endpoint"),
    405: (ErrorCode.METHOD_NOT_ALLOWED, "method not allowed here"),
    413: (ErrorCode.PAYLOAD_TOO_LARGE, "the request body is larger than allowed"),
    500: (ErrorCode.SERVER_ERROR, "internal error"),
}


def body_limit_detail(limit: int) -> str:
    """``the request body may have at most 2,621,440 bytes (2.5 MiB)``: a 413 names its limit."""
    if limit >= 1024 * 1024:
        size = f"{limit / (1024 * 1024):.1f}".removesuffix(".0") + " MiB"
    else:
        size = f"{limit // 1024} KiB"
    return f"the request body may have at most {limit:,} bytes ({size})"


# SQLSTATEs of a server that is not there for us: connection exceptions (class 08), the server
# shutting down or starting (57P01-57P03), no connection slot left (53300). A deadlock, a
# statement or lock timeout, a full disk are not: they stay 500s, logged with their traceback.
_UNAVAILABLE_STATES = ("57P01", "57P02", "57P03", "53300")


def database_unavailable(exc: BaseException) -> bool:
    import psycopg
    from django.db import InterfaceError, OperationalError

    if isinstance(exc, InterfaceError | psycopg.InterfaceError):
        return True  # the connection is closed
    if not isinstance(exc, OperationalError | psycopg.OperationalError):
        return False
    cause = exc if isinstance(exc, psycopg.Error) else exc.__cause__
    state = getattr(cause, "sqlstate", None)
    return state is None or state.startswith("08") or state in _UNAVAILABLE_STATES


def database_unavailable_response(exc: BaseException) -> JsonResponse | None:
    """The 503 of PostgreSQL not answering (a restart, a failover, a dropped connection: Django's
    wrapped errors and psycopg's own, from statements on the raw connection, apps.core.db), for
    the REST handler and the middleware alike; None for any other error. Not a 500: nothing of
    ours is broken, and the caller (an agent, a client) retries."""
    if not database_unavailable(exc):
        return None
    log.warning("database unavailable: %s", str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    response = JsonResponse(
        error_payload(ErrorCode.DATABASE_UNAVAILABLE, "the database did not answer; retry in a few seconds"),
        status=503,
    )
    response["Retry-After"] = "2"
    return response


def too_large_detail() -> str:
    """The 413 of the web API: Django's ``DATA_UPLOAD_MAX_MEMORY_SIZE``."""
    return body_limit_detail(settings.DATA_UPLOAD_MAX_MEMORY_SIZE or 0)


def too_large() -> JsonResponse:
    return JsonResponse(error_payload(ErrorCode.PAYLOAD_TOO_LARGE, too_large_detail()), status=413)


class ApiTrailingSlashMiddleware:
    """``/api/v1/jobs`` answers as ``/api/v1/jobs/``, whatever the method. Django's APPEND_SLASH
    answered a GET with a bare 301 and a POST with a 500 (DEBUG) or a redirect that turned it
    into a GET. The path is rewritten only when it resolves with the slash and not without."""

    def __init__(self, get_response: Callable[[HttpRequest], Any]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> Any:
        path = request.path_info
        if path.startswith("/api/") and not path.endswith("/"):
            urlconf = getattr(request, "urlconf", None)
            if not is_valid_path(path, urlconf) and is_valid_path(f"{path}/", urlconf):
                request.path_info = f"{path}/"
                request.path = f"{request.path}/"
        return self.get_response(request)


class ApiJsonErrorsMiddleware:
    # Async-capable too: the agent server (ASGI) runs it without a thread per request.
    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Callable[[HttpRequest], Any]) -> None:
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    def __call__(self, request: HttpRequest) -> Any:
        if self.is_async:
            return self._acall(request)
        return self._json(request, self.get_response(request))

    async def _acall(self, request: HttpRequest) -> HttpResponse:
        return self._json(request, await self.get_response(request))

    def _json(self, request: HttpRequest, response: HttpResponse) -> HttpResponse:
        if not request.path.startswith("/api/") or response.status_code < 400:
            return response
        if response.get("Content-Type", "").startswith("application/json"):
            return response
        code, detail = CODES.get(response.status_code, (ErrorCode.ERROR, "request failed"))
        json = JsonResponse(error_payload(code, detail), status=response.status_code)
        for header in ("Allow", "Retry-After", "WWW-Authenticate"):
            if header in response:
                json[header] = response[header]
        return json

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse | None:
        if isinstance(exception, RequestDataTooBig):
            return too_large()
        if request.path.startswith("/api/"):
            return database_unavailable_response(exception)
        return None
