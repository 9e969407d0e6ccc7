from __future__ import annotations

from rest_framework import serializers

from apps.jobs.models import JobConfiguration
from apps.machines.models import MachineType
from apps.resources.models import ResourceType


class OrgMachineTypeField(serializers.PrimaryKeyRelatedField):
    """A machine type id, looked up only among the caller's org's grants (others: 'does not exist')."""

    def get_queryset(self):
        ctx = self.context.get("org")
        return MachineType.objects.filter(grants__org=ctx) if ctx is not None else MachineType.objects.none()


class JobConfigurationSerializer(serializers.ModelSerializer):
    machine_type = OrgMachineTypeField()
    resources = serializers.SlugRelatedField(
        source="resource_types",
        slug_field="id",
        many=True,
        required=False,
        queryset=ResourceType.objects.all(),
        help_text="resource type ids the job acquires before it gets a machine",
    )
    env = serializers.DictField(
        child=serializers.CharField(allow_blank=True, max_length=32768), required=False
    )
    timeout_seconds = serializers.IntegerField(min_value=1, max_value=7 * 86400, required=False)
    priority = serializers.IntegerField(min_value=-1000, max_value=1000, required=False)
    max_attempts = serializers.IntegerField(min_value=1, max_value=20, required=False)
    artifact_retention_days = serializers.IntegerField(min_value=0, max_value=3650, required=False)

    class Meta:
        model = JobConfiguration
        fields = (
            "id",
            "name",
            "machine_type",
            "command",
            "env",
            "timeout_seconds",
            "resources",
            "priority",
            "max_attempts",
            "reuse",
            "artifact_retention_days",
            "created_at",
            "updated_at",
        )
        read_only_fields = ("id", "created_at", "updated_at")
        extra_kwargs = {"command": {"max_length": 65536, "trim_whitespace": False}}

    def validate_command(self, value: str) -> str:
        if not value.strip():
            raise serializers.ValidationError("must not be empty")
        if "\x00" in value:
            raise serializers.ValidationError("must not contain NUL characters")
        return value
