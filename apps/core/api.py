"""What every API view shares: one error format, and tenancy in one place.

Errors: ``{"code": "snake_case", "detail": "a sentence", ...}`` for every 4xx; validation
errors add ``fields``. Unexpected exceptions are logged and answered with a bare 500.

Tenancy: :class:`OrgScopedViewSet` filters every queryset by the caller's organization, so
another org's object is a 404 exactly like a missing one.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.core.exceptions import RequestDataTooBig
from django.db import DataError, IntegrityError
from django.db.models import ProtectedError
from django.http import Http404
from rest_framework import exceptions, serializers, status
from rest_framework.response import Response
from rest_framework.views import set_rollback

from apps.core.errors import DomainError, ErrorCode, ValidationFailed, error_payload
from apps.core.middleware import database_unavailable_response, too_large_detail

if TYPE_CHECKING:  # generic in the stubs only
    Serializer = serializers.Serializer[Any]
else:
    Serializer = serializers.Serializer


log = logging.getLogger(__name__)


def _flatten(detail: Any) -> Any:
    if isinstance(detail, dict):
        return {k: _flatten(v) for k, v in detail.items()}
    if isinstance(detail, list):
        return [_flatten(v) for v in detail]
    return str(detail)


def _messages(value: Any, prefix: str = "") -> list[str]:
    """Any nesting of DRF error details as a flat list of sentences (``key: message``)."""
    if isinstance(value, dict):
        return [m for k, v in value.items() for m in _messages(v, f"{prefix}{k}: ")]
    if isinstance(value, list):
        return [m for v in value for m in _messages(v, prefix)]
    return [f"{prefix}{value}"]


_DRF_CODES: dict[type[exceptions.APIException], ErrorCode] = {
    exceptions.NotAuthenticated: ErrorCode.NOT_AUTHENTICATED,
    exceptions.AuthenticationFailed: ErrorCode.AUTHENTICATION_FAILED,
    exceptions.PermissionDenied: ErrorCode.PERMISSION_DENIED,
    exceptions.NotFound: ErrorCode.NOT_FOUND,
    exceptions.MethodNotAllowed: ErrorCode.METHOD_NOT_ALLOWED,
    exceptions.NotAcceptable: ErrorCode.NOT_ACCEPTABLE,
    exceptions.UnsupportedMediaType: ErrorCode.UNSUPPORTED_MEDIA_TYPE,
    exceptions.Throttled: ErrorCode.THROTTLED,
    exceptions.ParseError: ErrorCode.PARSE_ERROR,
}


class StrictFields(Serializer):
    """Input that names a field the endpoint does not take, or one only Catacloud sets, is a
    400 naming it: DRF would drop it silently (``POST /jobs/ {"machine_type": …}`` answered
    201 and ran on the configuration's type). ``unknown_field_hints`` adds what to do instead."""

    unknown_field_hints: ClassVar[dict[str, str]] = {}

    def to_internal_value(self, data: Any) -> Any:
        if isinstance(data, Mapping):
            writable = sorted(name for name, field in self.fields.items() if not field.read_only)
            errors = {}
            for name in data:
                if name in writable:
                    continue
                if name in self.fields:
                    errors[name] = ["read-only: Catacloud sets it; leave it out"]
                else:
                    hint = self.unknown_field_hints.get(name) or f"this endpoint takes {', '.join(writable)}"
                    errors[name] = [f"unknown field ({hint})"]
            if errors:
                raise serializers.ValidationError(errors)
        return super().to_internal_value(data)


def _not_json(exc: exceptions.UnsupportedMediaType, context: dict[str, Any]) -> str:
    """What a client sending JSON without saying so needs to hear (curl -d sends
    ``application/x-www-form-urlencoded``; a bare body sends no Content-Type at all)."""
    request, view = context.get("request"), context.get("view")
    sent = (getattr(request, "content_type", "") or "").split(";")[0].strip() or "missing"
    parsers = getattr(view, "parser_classes", [])
    takes_json = any(getattr(parser, "media_type", "") == "application/json" for parser in parsers)
    if not takes_json:
        return str(exc.detail)
    return (
        f"the body was not read as JSON: its Content-Type is {sent}; "
        "send the header Content-Type: application/json (curl: -H 'Content-Type: application/json')"
    )


def error_response(status_code: int, code: ErrorCode, detail: str, **extra: Any) -> Response:
    return Response(error_payload(code, detail, **extra), status=status_code)


def _unique_violation(exc: IntegrityError) -> bool:
    from psycopg import errors as pg_errors

    return isinstance(exc.__cause__, pg_errors.UniqueViolation)


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response:
    set_rollback()  # an error leaves nothing half-written (ATOMIC_REQUESTS or not)
    if isinstance(exc, IntegrityError):
        # Two requests creating the same name at once: the loser's INSERT hits the unique index.
        if _unique_violation(exc):
            return error_response(400, ErrorCode.DUPLICATE_NAME, "an object with this name already exists")
        return error_response(409, ErrorCode.CONFLICT, "a concurrent change conflicts with this request")
    if (unavailable := database_unavailable_response(exc)) is not None:
        return unavailable  # type: ignore[return-value]  # a JsonResponse: DRF takes any HttpResponse
    if isinstance(exc, RequestDataTooBig):
        return error_response(413, ErrorCode.PAYLOAD_TOO_LARGE, too_large_detail())
    if isinstance(exc, RecursionError):
        return error_response(400, ErrorCode.PARSE_ERROR, "the request is nested too deeply")
    if isinstance(exc, ValidationFailed):
        return error_response(exc.status, exc.code, exc.detail, fields=exc.fields)
    if isinstance(exc, DomainError):
        return error_response(exc.status, exc.code, exc.detail, **exc.extra)
    if isinstance(exc, Http404):
        exc = exceptions.NotFound()
    elif isinstance(exc, DjangoPermissionDenied):
        exc = exceptions.PermissionDenied()
    elif isinstance(exc, ProtectedError):
        return error_response(
            409, ErrorCode.IN_USE, "this object is still used by others and cannot be deleted"
        )
    elif isinstance(exc, DataError):
        # A value PostgreSQL cannot store or compare (out of range date, offset, number).
        return error_response(400, ErrorCode.INVALID, "a value is out of the range the database accepts")
    if isinstance(exc, exceptions.ValidationError):
        raw = exc.detail if isinstance(exc.detail, dict) else {"non_field_errors": exc.detail}
        fields = {str(k): _messages(v) for k, v in raw.items()}
        name, messages = next(iter(fields.items()), ("", ["invalid input"]))
        message = messages[0] if messages else "invalid input"
        detail = message if name == "non_field_errors" else f"{name}: {message}"
        return error_response(400, ErrorCode.INVALID, detail, fields=fields)
    if isinstance(exc, exceptions.UnsupportedMediaType):
        return error_response(exc.status_code, ErrorCode.UNSUPPORTED_MEDIA_TYPE, _not_json(exc, context))
    if isinstance(exc, exceptions.APIException):
        code = next((c for cls, c in _DRF_CODES.items() if isinstance(exc, cls)), None)
        if code is None:
            default = exc.default_code if isinstance(exc.default_code, str) else ""
            code = ErrorCode(default) if default in ErrorCode._value2member_map_ else ErrorCode.ERROR
        response = error_response(exc.status_code, code, str(_flatten(exc.detail)))
        if auth_header := getattr(exc, "auth_header", None):
            response["WWW-Authenticate"] = auth_header
        if wait := getattr(exc, "wait", None):
            response["Retry-After"] = str(int(wait))
        return response
    view = context.get("view")
    log.exception("unhandled error in %s", type(view).__name__ if view else "API view")
    return error_response(status.HTTP_500_INTERNAL_SERVER_ERROR, ErrorCode.SERVER_ERROR, "internal error")
