"""What every forge's API shares: a runner class's pool (one of the org's) and its live counts,
and an endpoint's health (availability, calls, the reconciler)."""

from __future__ import annotations

from typing import Any

from rest_framework import serializers

from apps.jobs.choices import JOB_LIVE
from apps.pools.models import InstancePool


class OrgPoolField(serializers.PrimaryKeyRelatedField):
    def get_queryset(self) -> Any:
        org = self.context.get("org")
        return InstancePool.objects.filter(org=org) if org is not None else InstancePool.objects.none()


def live_runners(runner_class: Any) -> int:
    """Live runners (Catacloud jobs) of a class."""
    return int(runner_class.runners.filter(job__status__in=JOB_LIVE).count())


def endpoint_health(endpoint: Any) -> dict[str, Any]:
    """Whether the forge answers the endpoint, the calls made, the reconciler's last run."""
    available = endpoint.is_available()
    return {
        "available": available,
        "unavailable_reason": endpoint.unavailable_reason if not available else "",
        "calls_this_hour": endpoint.window_calls,
        "calls_total": endpoint.calls_total,
        "rate_remaining": endpoint.rate_remaining,
        "reconciled_at": endpoint.reconciled_at,
    }
