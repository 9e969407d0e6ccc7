"""OpenAPI: every operation documents the error format and the errors it may answer."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from drf_spectacular.openapi import AutoSchema as _AutoSchema
from rest_framework import serializers

if TYPE_CHECKING:  # generic in the stubs only
    Serializer = serializers.Serializer[Any]
else:
    Serializer = serializers.Serializer


class ErrorSerializer(Serializer):
    code = serializers.CharField(help_text="machine-readable, snake_case")
    detail = serializers.CharField(help_text="a human sentence")
    fields = serializers.DictField(  # type: ignore[assignment]  # the error body's field, not Serializer.fields
        child=serializers.ListField(child=serializers.CharField()),
        required=False,
        help_text="validation errors by field",
    )


class AutoSchema(_AutoSchema):
    ERRORS = {
        "400": "invalid input",
        "401": "missing or invalid token",
        "403": "role or privilege missing",
        "404": "not found (or another organization's)",
        "405": "method not allowed",
        "406": "not acceptable",
        "409": "conflict: the object's state does not allow this",
        "415": "unsupported media type",
        "429": "throttled",
    }

    def _get_response_bodies(self, direction: Literal["request", "response"] = "response") -> dict[str, Any]:
        responses = super()._get_response_bodies(direction)
        error = self._get_response_for_code(  # type: ignore[no-untyped-call]  # untyped upstream
            ErrorSerializer, "400", direction=direction
        )
        for code, description in self.ERRORS.items():
            if code not in responses:
                responses[code] = {**error, "description": description}
        return responses
