"""Public contracts kept as enums (event kinds, error codes): a value not listed is a bug."""

from __future__ import annotations

import logging
from enum import StrEnum
from typing import TypeVar, cast

from django.conf import settings

log = logging.getLogger(__name__)
E = TypeVar("E", bound=StrEnum)


def registered(value: str, registry: type[E]) -> E:
    """``value``'s member of ``registry``. Typed callers pass members (mypy refuses a name the
    registry lacks); a plain string reaches here only from untyped code (a test, a shell). One
    not listed is raised when CATACLOUD_STRICT_REGISTRIES is on (tests, development) and logged
    in production, where the event or answer still goes out (as that string) rather than
    failing the request that made it."""
    member = registry._value2member_map_.get(value)
    if member is None:
        where = f"{registry.__module__}.{registry.__name__}"
        if settings.CATACLOUD_STRICT_REGISTRIES:
            raise ValueError(f"{value!r} is not registered in {where}")
        log.error("%r is not registered in %s", value, where)
        return cast(E, value)
    return cast(E, member)
