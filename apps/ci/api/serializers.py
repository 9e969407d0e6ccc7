"""What every forge's API shares: a runner class's serializer (its machine type and pool, the
org's; its live runners) and an endpoint's health (availability, calls, the reconciler)."""

from __future__ import annotations

from typing import Any, ClassVar

from django.conf import settings
from django.urls import reverse
from rest_framework import serializers

from apps.jobs.choices import JOB_LIVE
from apps.machines.api.serializers import OrgMachineTypeField
from apps.pools.models import InstancePool


class OrgPoolField(serializers.PrimaryKeyRelatedField):
    def get_queryset(self) -> Any:
        org = self.context.get("org")
        return InstancePool.objects.filter(org=org) if org is not None else InstancePool.objects.none()


# A forge's runner class: each forge's subclass adds its labels (GitLab: tags) and its waiting
# jobs, and names its model and fields in a ``Meta(RunnerClassSerializer.Meta)``. (A comment, not
# a docstring: the schema would show it as each subclass's description.)
class RunnerClassSerializer(serializers.ModelSerializer):
    machine_type = OrgMachineTypeField()
    pool = OrgPoolField(required=False, allow_null=True)
    runners = serializers.SerializerMethodField(help_text="live runners (Catacloud jobs) of this class")

    class Meta:
        read_only_fields = ("id", "job_config", "created_at", "updated_at")
        extra_kwargs = {"command": {"trim_whitespace": False, "max_length": 65536}}

    def get_runners(self, obj: Any) -> int:
        return int(obj.runners.filter(job__status__in=JOB_LIVE).count())


class SecretSet(serializers.BooleanField):
    """Whether a write-only secret (``source``) is set: what the API answers instead of it."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(read_only=True, **kwargs)

    def to_representation(self, value: Any) -> bool:
        return bool(value)


class ConnectionOut(serializers.ModelSerializer):
    """A forge connection as answered: each forge's subclass names its model, its fields (its
    secrets as :class:`SecretSet`) and the forge whose webhook URL it gives."""

    forge_name: ClassVar[str]

    def get_webhook_url(self, obj: Any) -> str:
        return settings.CATACLOUD_PUBLIC_URL.rstrip("/") + reverse(f"{self.forge_name}-webhook")


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
