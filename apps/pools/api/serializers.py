from __future__ import annotations

from django.db.models import QuerySet
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from apps.core.api import StrictFields
from apps.machines.api.serializers import InstanceSerializer, OrgMachineTypeField
from apps.machines.choices import INSTANCE_TERMINAL, InstanceStatus
from apps.machines.models import MachineInstance
from apps.pools.choices import PoolStatus
from apps.pools.models import InstancePool, PoolSchedule


def live_members() -> QuerySet[MachineInstance]:
    """A pool's members an answer shows: every one not ended, oldest first."""
    return MachineInstance.objects.exclude(status__in=INSTANCE_TERMINAL).order_by("created_at")


class MemberSerializer(serializers.ModelSerializer):
    instance_id = serializers.UUIDField(source="id", read_only=True)

    class Meta:
        model = MachineInstance
        fields = (
            "instance_id",
            "status",
            "provider_id",
            "outdated",
            "machine_type_version",
            "images",
            "created_at",
            "warming_started_at",
            "warmed_at",
            "ready_at",
            "claimed_at",
            "claimed_by",
            "claimed_for",
        )
        read_only_fields = fields


class ScheduleSerializer(serializers.ModelSerializer):
    class Meta:
        model = PoolSchedule
        fields = ("name", "cron", "timezone", "target_size")


class PoolSerializer(StrictFields, serializers.ModelSerializer):
    machine_type = OrgMachineTypeField()
    machine_type_name = serializers.CharField(source="machine_type.name", read_only=True)
    target_size = serializers.IntegerField(min_value=0, max_value=10_000)
    min_size = serializers.IntegerField(min_value=0, max_value=10_000, required=False)
    max_size = serializers.IntegerField(min_value=0, max_value=10_000, required=False)
    warmup_grace_seconds = serializers.IntegerField(min_value=10, max_value=86_400, required=False)
    images = serializers.ListField(
        child=serializers.CharField(max_length=512),
        required=False,
        max_length=20,
        help_text="container images every member pulls before it is ready (placement prefers a "
        "member that holds a job's image); changing them replaces the members",
    )
    status = serializers.SerializerMethodField(
        help_text="read with the members below: a pool short of ready members never reads ready"
    )
    member_count = serializers.SerializerMethodField(help_text="len(members): every live member")
    ready_count = serializers.SerializerMethodField()
    counts = serializers.SerializerMethodField(help_text="live members by status")
    members = serializers.SerializerMethodField()
    schedules = ScheduleSerializer(many=True, read_only=True)

    class Meta:
        model = InstancePool
        fields = (
            "id",
            "name",
            "description",
            "machine_type",
            "machine_type_name",
            "status",
            "target_size",
            "min_size",
            "max_size",
            "warmup_grace_seconds",
            "images",
            "member_count",
            "ready_count",
            "counts",
            "limit_reason",
            "created_at",
            "updated_at",
            "drained_at",
            "schedules",
            "members",
        )
        read_only_fields = ("id", "limit_reason", "created_at", "updated_at", "drained_at")

    def _members(self, obj: InstancePool) -> list[MachineInstance]:
        prefetched = getattr(obj, "live_members", None)  # PoolViewSet: one query for the page
        if prefetched is not None:
            return prefetched
        cache = self.context.setdefault("_members", {})  # type: ignore[attr-defined]  # a dict
        if obj.pk not in cache:
            cache[obj.pk] = list(live_members().filter(pool=obj))
        return cache[obj.pk]

    @extend_schema_field(serializers.ChoiceField(choices=PoolStatus.choices))
    def get_status(self, obj: InstancePool) -> str:
        """The stored status moves on the refill that follows a claim or a termination (the
        claim path writes nothing to the pool row); until then it may lag by a moment. Read
        together with this answer's members it never contradicts them: ``ready`` needs
        ``target_size`` fresh ready members, else an active pool is ``replenishing`` (or still
        ``warming`` if it never was ready)."""
        if obj.status not in (PoolStatus.READY, PoolStatus.REPLENISHING):
            return obj.status
        ready = sum(1 for m in self._members(obj) if m.status == InstanceStatus.READY and not m.outdated)
        return PoolStatus.READY if ready >= obj.target_size else PoolStatus.REPLENISHING

    def get_member_count(self, obj: InstancePool) -> int:
        return len(self._members(obj))

    def get_ready_count(self, obj: InstancePool) -> int:
        return sum(1 for m in self._members(obj) if m.status == InstanceStatus.READY)

    @extend_schema_field(serializers.DictField(child=serializers.IntegerField()))
    def get_counts(self, obj: InstancePool) -> dict[str, int]:
        counts: dict[str, int] = {}
        for m in self._members(obj):
            counts[m.status] = counts.get(m.status, 0) + 1
        return counts

    @extend_schema_field(MemberSerializer(many=True))
    def get_members(self, obj: InstancePool) -> list[dict]:
        return list(MemberSerializer(self._members(obj), many=True).data)


class PoolUpdateSerializer(StrictFields):
    description = serializers.CharField(max_length=300, required=False, allow_blank=True)
    images = serializers.ListField(child=serializers.CharField(max_length=512), required=False, max_length=20)
    target_size = serializers.IntegerField(min_value=0, max_value=10_000, required=False)
    min_size = serializers.IntegerField(min_value=0, max_value=10_000, required=False)
    max_size = serializers.IntegerField(min_value=0, max_value=10_000, required=False)
    warmup_grace_seconds = serializers.IntegerField(min_value=10, max_value=86_400, required=False)


class AcquireIn(StrictFields):
    acquired_by = serializers.CharField(max_length=200, required=False, allow_blank=True, default="")
    acquired_for = serializers.CharField(max_length=200, required=False, allow_blank=True, default="")
    lease_seconds = serializers.IntegerField(
        min_value=1,
        max_value=30 * 86_400,
        required=False,
        allow_null=True,
        default=None,
        help_text="the claim ends after this: the machine is terminated and the pool refills",
    )


class AcquireOut(serializers.Serializer):
    claim_id = serializers.UUIDField()
    instance = InstanceSerializer()


class DrainIn(StrictFields):
    terminate_members = serializers.BooleanField(default=False)


class DrainOut(serializers.Serializer):
    drained = serializers.BooleanField()
    terminated_count = serializers.IntegerField()
