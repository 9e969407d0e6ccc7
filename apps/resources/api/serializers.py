from __future__ import annotations

from typing import Any

from rest_framework import serializers

from apps.resources.models import ResourceInstance, ResourceType


class ResourceTypeSerializer(serializers.ModelSerializer):
    required_privilege: serializers.SlugRelatedField[Any] = serializers.SlugRelatedField(
        slug_field="name", read_only=True, allow_null=True
    )
    in_use = serializers.IntegerField(
        read_only=True, help_text="live instances counting against max_instances"
    )
    usable = serializers.SerializerMethodField(help_text="false when your organization lacks the privilege")

    class Meta:
        model = ResourceType
        fields = ("id", "description", "well", "max_instances", "in_use", "required_privilege", "usable")
        read_only_fields = fields

    def get_usable(self, obj: ResourceType) -> bool:
        return obj.required_privilege_id is None or obj.required_privilege_id in self.context.get(
            "org_privileges", ()
        )


class ResourceSerializer(serializers.ModelSerializer):
    """A resource instance. Its secret part is never shown here (only the job reads it)."""

    resource_type: serializers.SlugRelatedField[Any] = serializers.SlugRelatedField(
        slug_field="id", read_only=True
    )
    job = serializers.UUIDField(source="job_id", read_only=True, allow_null=True)

    class Meta:
        model = ResourceInstance
        fields = (
            "id",
            "resource_type",
            "status",
            "job",
            "external_id",
            "metadata",
            "failure_reason",
            "created_at",
            "ready_at",
            "held_at",
            "releasing_at",
            "destroyed_at",
        )
        read_only_fields = fields
