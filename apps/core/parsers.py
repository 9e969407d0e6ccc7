"""Request parsing that never turns bad input into a 500.

DRF's JSON parser lets ``RecursionError`` (deeply nested JSON) escape; this one answers 400
``parse_error`` for it and for any document nested deeper than ``MAX_DEPTH``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from rest_framework.exceptions import ParseError, UnsupportedMediaType
from rest_framework.parsers import FormParser, JSONParser

MAX_DEPTH = 64


def _too_deep(value: Any, limit: int) -> bool:
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = list(item.values())
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def loads(raw: bytes | str) -> Any:
    """``json.loads`` for input from outside: a document nested deeper than ``MAX_DEPTH`` is a
    ``ValueError`` like any other bad JSON (never a ``RecursionError``)."""
    try:
        data = json.loads(raw)
    except RecursionError:
        raise ValueError(f"nested deeper than {MAX_DEPTH} levels") from None
    if _too_deep(data, MAX_DEPTH):
        raise ValueError(f"nested deeper than {MAX_DEPTH} levels")
    return data


# json's messages (``Expecting ',' delimiter: line 1 column 9 (char 8)``) in plain words.
_JSON_FAULTS = {
    "Expecting value": "expecting a value",
    "Expecting property name enclosed in double quotes": "expecting a property name in double quotes",
    "Expecting ',' delimiter": "expecting a comma",
    "Expecting ':' delimiter": "expecting a colon",
    "Extra data": "unexpected text after the document",
    "Unterminated string starting at": "a string that is never closed, starting",
    "Invalid control character at": "a control character (a raw newline or tab) inside a string",
    "Invalid \\escape": "an invalid backslash escape",
}
NOT_JSON = "the request body is not valid JSON"


def json_fault(exc: BaseException | None) -> str:
    """``the request body is not valid JSON: expecting a comma at line 1, column 9``."""
    if isinstance(exc, json.JSONDecodeError):
        fault = _JSON_FAULTS.get(exc.msg) or exc.msg[:1].lower() + exc.msg[1:]
        return f"{NOT_JSON}: {fault} at line {exc.lineno}, column {exc.colno}"
    if isinstance(exc, UnicodeDecodeError):
        return f"{NOT_JSON}: it is not UTF-8 text"
    return f"{NOT_JSON}: {exc}" if exc else NOT_JSON


class SafeJSONParser(JSONParser):
    def parse(
        self, stream: Any, media_type: str | None = None, parser_context: Mapping[str, Any] | None = None
    ) -> Any:
        try:
            data = super().parse(stream, media_type, parser_context)
        except RecursionError:
            raise ParseError(f"{NOT_JSON}: it is nested deeper than {MAX_DEPTH} levels") from None
        except ParseError as exc:  # DRF's "JSON parse error - <json's message>"
            raise ParseError(json_fault(exc.__context__)) from None
        if _too_deep(data, MAX_DEPTH):
            raise ParseError(f"{NOT_JSON}: it is nested deeper than {MAX_DEPTH} levels")
        return data


class StrictFormParser(FormParser):
    """A form body that is one JSON document (``curl -d '{"config": …}'`` without a
    Content-Type header) is refused as not JSON, instead of read as a form with one odd
    field and answered "config: This field is required"."""

    def parse(
        self, stream: Any, media_type: str | None = None, parser_context: Mapping[str, Any] | None = None
    ) -> Any:
        data = super().parse(stream, media_type, parser_context)
        keys = list(data.keys())
        if len(keys) == 1 and keys[0].lstrip()[:1] in ("{", "[") and data.get(keys[0]) in ("", None):
            raise UnsupportedMediaType(media_type or self.media_type)
        return data
