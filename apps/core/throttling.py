"""The API throttle. Fairness only (quotas live in PostgreSQL), so it fails open: when its
cache (Redis) is unreachable, requests are let through and a warning is logged."""

from __future__ import annotations

import logging
from typing import Any

from rest_framework import throttling

from apps.core.broker import BROKER_ERRORS, broker_down, mark_broker_down

log = logging.getLogger(__name__)


class UserRateThrottle(throttling.UserRateThrottle):
    def allow_request(self, request: Any, view: Any) -> bool:
        if broker_down():
            return True
        try:
            return super().allow_request(request, view)
        except BROKER_ERRORS as exc:
            mark_broker_down(exc)
            return True
