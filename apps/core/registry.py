"""Public contracts kept as enums (event kinds, error codes): a value not listed is a bug."""

from __future__ import annotations

import logging
from enum import StrEnum

from django.conf import settings

log = logging.getLogger(__name__)


def registered(value: str, registry: type[StrEnum]) -> str:
    """``value`` when ``registry`` lists it. Otherwise: raised when CATACLOUD_STRICT_REGISTRIES
    is on (tests, development), logged in production, where the event or answer still goes
    out rather than failing the request that made it."""
    if value not in registry._value2member_map_:
        where = f"{registry.__module__}.{registry.__name__}"
        if settings.CATACLOUD_STRICT_REGISTRIES:
            raise ValueError(f"{value!r} is not registered in {where}")
        log.error("%r is not registered in %s", value, where)
    return value
