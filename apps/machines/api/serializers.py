from __future__ import annotations

import uuid
from typing import Any

from django.db.models import Q
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from apps.machines.models import MachineInstance, MachineType, OrgMachineType


@extend_schema_field(OpenApiTypes.STR)
class OrgMachineTypeField(serializers.Field):
    """A machine type by id or by name, among the caller's org's grants. One that is not
    there says so and names the types the organization may use; the answer is the same
    whether the type exists for other organizations or not at all (no tenant learns what
    others may use). Shown as the id (``represent="name"``: as the name)."""

    default_error_messages = {
        "not_granted": "no grant for {ref} in organization {org} (it may use: {usable})",
        "invalid": "a machine type's id or name (a string)",
    }

    def __init__(self, *, represent: str = "id", **kwargs: Any) -> None:
        self.represent = represent
        kwargs.setdefault("help_text", "a machine type's name or id (one your organization has a grant for)")
        super().__init__(**kwargs)

    def to_representation(self, value: MachineType) -> str:
        return value.name if self.represent == "name" else str(value.pk)

    def to_internal_value(self, data: Any) -> MachineType:
        if not isinstance(data, str) or not data.strip():
            self.fail("invalid")
        ref = data.strip()
        org = self.context.get("org")
        granted = MachineType.objects.filter(grants__org=org) if org else MachineType.objects.none()
        try:
            found = granted.filter(Q(pk=uuid.UUID(ref)) | Q(name=ref)).first()
        except ValueError:
            found = granted.filter(name=ref).first()
        if found is None:
            usable = ", ".join(granted.order_by("name").values_list("name", flat=True)) or "none"
            self.fail("not_granted", ref=ref, org=getattr(org, "slug", "?"), usable=usable)
        return found


class QuotaSerializer(serializers.ModelSerializer):
    class Meta:
        model = OrgMachineType
        fields = OrgMachineType.QUOTA_FIELDS


class MachineTypeSerializer(serializers.ModelSerializer):
    provider = serializers.CharField(source="provider_account.kind", read_only=True)
    required_privilege: serializers.SlugRelatedField[Any] = serializers.SlugRelatedField(
        slug_field="name", read_only=True, allow_null=True
    )
    quota = serializers.SerializerMethodField()
    usable = serializers.SerializerMethodField(help_text="false when the org lacks the required privilege")

    class Meta:
        model = MachineType
        fields = ("id", "name", "provider", *MachineType.SETTABLE_FIELDS, "version", "quota", "usable")
        read_only_fields = fields

    @extend_schema_field(QuotaSerializer)
    def get_quota(self, obj: MachineType) -> dict:
        grants = getattr(obj, "org_grants", [])
        return QuotaSerializer(grants[0]).data if grants else {}

    def get_usable(self, obj: MachineType) -> bool:
        privilege = obj.required_privilege
        return privilege is None or privilege.pk in self.context.get("org_privileges", set())


# Who logs in on a fresh machine of each provider, unless the provider account's config says
# ``ssh_user``. AWS has no such default: it depends on the AMI (ubuntu, ec2-user, admin, …).
DEFAULT_SSH_USER = {"hetzner": "root"}


class AccessSerializer(serializers.Serializer):
    host = serializers.CharField(
        allow_null=True, help_text="the address to reach it at: public, else private"
    )
    public_ip = serializers.CharField(allow_blank=True)
    private_ip = serializers.CharField(allow_blank=True)
    ssh_user = serializers.CharField(allow_null=True, help_text="set ssh_user in the provider account config")
    ssh = serializers.CharField(
        allow_null=True, help_text="a command that logs in, when host and user are known"
    )
    provider = serializers.CharField()
    provider_id = serializers.CharField(allow_blank=True)
    provider_state = serializers.CharField(allow_blank=True)
    provider_checked_at = serializers.DateTimeField(allow_null=True)
    server_type = serializers.CharField(allow_blank=True)
    location = serializers.CharField(allow_blank=True)
    note = serializers.CharField(allow_blank=True)


def instance_access(obj: MachineInstance) -> dict:
    """How to reach a machine: addresses, SSH user and what the provider knows of it."""
    account, mt = obj.provider_account, obj.machine_type
    kind = account.kind
    host = obj.public_ip or obj.private_ip or None
    user = (account.config or {}).get("ssh_user") or DEFAULT_SSH_USER.get(kind)
    note = ""
    if kind == "local":
        user, host = None, host or "127.0.0.1"
        note = "a local agent process on the control plane's host: no SSH; its log is in the state dir"
    return {
        "host": host,
        "public_ip": obj.public_ip,
        "private_ip": obj.private_ip,
        "ssh_user": user,
        "ssh": f"ssh {user}@{host}" if user and host else None,
        "provider": kind,
        "provider_id": obj.provider_id,
        "provider_state": obj.provider_state,
        "provider_checked_at": serializers.DateTimeField().to_representation(obj.provider_checked_at)
        if obj.provider_checked_at
        else None,
        "server_type": mt.server_type,
        "location": mt.location,
        "note": note,
    }


class InstanceSerializer(serializers.ModelSerializer):
    access = serializers.SerializerMethodField(help_text="how to reach the machine")
    machine_type: serializers.SlugRelatedField[Any] = serializers.SlugRelatedField(
        slug_field="name", read_only=True
    )
    machine_type_id = serializers.UUIDField(read_only=True)
    provider = serializers.CharField(source="provider_account.kind", read_only=True)
    pool = serializers.UUIDField(source="pool_id", read_only=True, allow_null=True)

    class Meta:
        model = MachineInstance
        fields = (
            "id",
            "status",
            "machine_type",
            "machine_type_id",
            "machine_type_version",
            "outdated",
            "pool",
            "provider",
            "provider_id",
            "provider_state",
            "provider_checked_at",
            "public_ip",
            "private_ip",
            "access",
            "claim_id",
            "claimed_by",
            "claimed_for",
            "lease_expires_at",
            "failure_reason",
            "end_cause",
            "status_changed_at",
            "created_at",
            "provisioning_started_at",
            "warming_started_at",
            "ready_at",
            "warmed_at",
            "claimed_at",
            "last_heartbeat_at",
            "terminating_at",
            "ended_at",
            "billed_seconds",
            "cost",
            "isolation",
            "images",
        )
        read_only_fields = fields

    @extend_schema_field(AccessSerializer)
    def get_access(self, obj: MachineInstance) -> dict:
        return instance_access(obj)
