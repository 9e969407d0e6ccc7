"""Every answer under ``/api/`` is JSON ``{code, detail}``, also the ones Django makes itself
(an unknown path or method in DEBUG, an oversized body), never an HTML page."""

from __future__ import annotations

from collections.abc import Callable

from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponse, JsonResponse

from apps.core.errors import error_payload

CODES = {
    400: ("invalid", "bad request"),
    403: ("permission_denied", "forbidden"),
    404: ("not_found", "no such endpoint"),
    405: ("method_not_allowed", "method not allowed here"),
    413: ("payload_too_large", "the request body is larger than allowed"),
    500: ("server_error", "internal error"),
}


def too_large() -> JsonResponse:
    code, detail = CODES[413]
    return JsonResponse(error_payload(code, detail), status=413)


class ApiJsonErrorsMiddleware:
    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        response = self.get_response(request)
        if not request.path.startswith("/api/") or response.status_code < 400:
            return response
        if response.get("Content-Type", "").startswith("application/json"):
            return response
        code, detail = CODES.get(response.status_code, ("error", "request failed"))
        json = JsonResponse(error_payload(code, detail), status=response.status_code)
        for header in ("Allow", "Retry-After", "WWW-Authenticate"):
            if header in response:
                json[header] = response[header]
        return json

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse | None:
        if isinstance(exception, RequestDataTooBig):
            return too_large()
        return None
