"""The API throttles: fairness only (quotas live in PostgreSQL), so they cost no network round
trip and cannot fail when Redis does. Each web process counts in its own memory, so the
effective limit is the configured rate per process (docs/operator/configuration.md)."""

from __future__ import annotations

import logging
from typing import Any

from django.core.cache import caches
from rest_framework import throttling

log = logging.getLogger(__name__)


class LocalThrottleMixin:
    """Counts in the process's memory and lets the request through on any error."""

    cache = caches["local"]

    def allow_request(self, request: Any, view: Any) -> bool:
        try:
            return bool(super().allow_request(request, view))  # type: ignore[misc]
        except Exception:  # never let fairness take the API down
            log.exception("throttle failed; letting the request through")
            return True


class UserRateThrottle(LocalThrottleMixin, throttling.UserRateThrottle):
    pass
