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


class SafeJSONParser(JSONParser):
    def parse(
        self, stream: Any, media_type: str | None = None, parser_context: Mapping[str, Any] | None = None
    ) -> Any:
        try:
            data = super().parse(stream, media_type, parser_context)
        except RecursionError:
            raise ParseError(f"JSON parse error - nested deeper than {MAX_DEPTH} levels") from None
        if _too_deep(data, MAX_DEPTH):
            raise ParseError(f"JSON parse error - nested deeper than {MAX_DEPTH} levels")
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
