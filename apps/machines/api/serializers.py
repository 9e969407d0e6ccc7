from __future__ import annotations

import uuid
from decimal import Decimal
from typing import Any

from django.db.models import Q
from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from apps.core.api import StrictFields
from apps.machines.choices import ProviderKind
from apps.machines.hosts import MAX_TTL_SECONDS
from apps.machines.models import (
    EnrolmentToken,
    Host,
    MachineInstance,
    MachineType,
    OrgMachineType,
    ProviderAccount,
)
from apps.machines.selectors import host_accounts_for_org


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
    alternatives = serializers.SerializerMethodField(
        help_text="machine types (names) that may run this type's jobs instead (those your org may use)"
    )
    own = serializers.SerializerMethodField(help_text="true: on your organization's own provider account")
    provider_account = serializers.SerializerMethodField(
        help_text="your own provider account's name (null on the operator's machine types)"
    )

    class Meta:
        model = MachineType
        fields = (
            "id",
            "name",
            "provider",
            "own",
            "provider_account",
            *MachineType.SETTABLE_FIELDS,
            "capacity_cooling_until",
            "capacity_error",
            "version",
            "quota",
            "usable",
        )
        read_only_fields = fields

    def get_own(self, obj: MachineType) -> bool:
        return obj.org_id is not None

    def get_provider_account(self, obj: MachineType) -> str | None:
        return obj.provider_account.name if obj.org_id is not None else None

    def get_alternatives(self, obj: MachineType) -> list[str]:
        """Only the ones granted to the caller's organization: no tenant learns what others use."""
        org = self.context.get("org")
        if not obj.alternatives or org is None:
            return []
        names: set[str] | None = getattr(self.root, "_granted_names", None)
        if names is None:  # one query for the whole answer, not one a type
            names = set(MachineType.objects.filter(grants__org=org).values_list("name", flat=True))
            setattr(self.root, "_granted_names", names)  # noqa: B010 (a serializer has no such field)
        return [name for name in obj.alternatives if name in names]

    @extend_schema_field(QuotaSerializer)
    def get_quota(self, obj: MachineType) -> dict:
        grants = getattr(obj, "org_grants", [])
        return QuotaSerializer(grants[0]).data if grants else {}

    def get_usable(self, obj: MachineType) -> bool:
        privilege = obj.required_privilege
        return privilege is None or privilege.pk in self.context.get("org_privileges", set())


# Who logs in on a fresh machine of each provider, unless the provider account's config says
# ``ssh_user``. AWS has no such default: it depends on the AMI (ubuntu, ec2-user, admin, …).
# Azure: the admin user the driver makes (``admin_username``, catacloud/providers/azure.py).
DEFAULT_SSH_USER = {"hetzner": "root", "azure": "catacloud"}


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
    config = account.config or {}
    user = config.get("ssh_user") or (config.get("admin_username") if kind == "azure" else None)
    user = user or DEFAULT_SSH_USER.get(kind)
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


# ---- enrolled hosts and their enrolment tokens ---------------------------------------------------

LABELS_HELP = "labels, {key: value} (at most 32; keys of 1-63 characters, values of 0-63)"
MAX_DRAIN_SECONDS = 30 * 86_400


def _labels_field(**kwargs: Any) -> serializers.DictField:
    return serializers.DictField(
        child=serializers.CharField(max_length=63, allow_blank=True, trim_whitespace=False),
        help_text=LABELS_HELP,
        **kwargs,
    )


@extend_schema_field(OpenApiTypes.STR)
class HostAccountField(serializers.Field):
    """A provider account of kind ``hosts`` by name or id, among those where the caller's org
    holds a grant of a machine type. Left out: the org's only such account. One that is not
    there is answered the same whether it exists for other organizations or not at all."""

    default_error_messages = {
        "not_granted": "no grant for a machine type on provider account {ref} in organization {org} "
        "(accounts of enrolled hosts it may use: {usable})",
        "not_hosts": "provider account {ref} is not for enrolled hosts (its kind is {kind}); "
        "accounts of enrolled hosts it may use: {usable}",
        "invalid": "a provider account's name or id (a string)",
    }

    def to_representation(self, value: ProviderAccount) -> str:
        return value.name

    def to_internal_value(self, data: Any) -> ProviderAccount:
        if not isinstance(data, str) or not data.strip():
            self.fail("invalid")
        ref, org = data.strip(), self.context.get("org")
        accounts = host_accounts_for_org(org=org) if org else ProviderAccount.objects.none()
        try:
            found = accounts.filter(Q(pk=uuid.UUID(ref)) | Q(name=ref)).first()
        except ValueError:
            found = accounts.filter(name=ref).first()
        usable = ", ".join(
            accounts.filter(kind=ProviderKind.HOSTS).order_by("name").values_list("name", flat=True)
        )
        if found is None:
            self.fail("not_granted", ref=ref, org=getattr(org, "slug", "?"), usable=usable or "none")
        elif found.kind != ProviderKind.HOSTS:
            self.fail("not_hosts", ref=ref, kind=found.kind, usable=usable or "none")
        return found


class EnrolmentTokenSerializer(serializers.ModelSerializer):
    provider_account = HostAccountField(read_only=True)
    state = serializers.SerializerMethodField(help_text="active, revoked, expired or used_up")
    revoked = serializers.SerializerMethodField()

    class Meta:
        model = EnrolmentToken
        fields: tuple[str, ...] = (
            "id",
            "prefix",
            "description",
            "provider_account",
            "labels",
            "uses",
            "max_uses",
            "expires_at",
            "state",
            "revoked",
            "revoked_at",
            "created_by",
            "created_at",
        )
        read_only_fields: tuple[str, ...] = fields

    def get_state(self, obj: EnrolmentToken) -> str:
        if obj.revoked_at is not None:
            return "revoked"
        if obj.uses >= obj.max_uses:
            return "used_up"
        return "expired" if obj.expires_at <= timezone.now() else "active"

    def get_revoked(self, obj: EnrolmentToken) -> bool:
        return obj.revoked_at is not None


class EnrolmentTokenCreated(EnrolmentTokenSerializer):
    token = serializers.CharField(
        help_text="the enrolment token: shown this once (only its hash is stored); give it to "
        "`catacloud host` on the host as CATACLOUD_ENROLMENT_TOKEN"
    )

    class Meta(EnrolmentTokenSerializer.Meta):
        fields = (*EnrolmentTokenSerializer.Meta.fields, "token")
        read_only_fields = fields


class EnrolmentTokenIn(StrictFields):
    provider_account = HostAccountField(
        required=False,
        help_text="a provider account of kind hosts (name or id) with a machine type granted to your "
        "organization; may be left out when there is one",
    )
    labels = _labels_field(required=False, default=dict)
    max_uses = serializers.IntegerField(
        min_value=1, max_value=10_000, default=1, help_text="how many hosts may enroll with it"
    )
    ttl_seconds = serializers.IntegerField(
        min_value=60, max_value=MAX_TTL_SECONDS, default=86_400, help_text="it expires after this"
    )
    description = serializers.CharField(max_length=200, required=False, allow_blank=True, default="")

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if "provider_account" not in attrs:
            org = self.context.get("org")
            accounts = list(host_accounts_for_org(org=org).filter(kind=ProviderKind.HOSTS)[:2]) if org else []
            if len(accounts) != 1:
                names = ", ".join(a.name for a in accounts) or "none"
                raise serializers.ValidationError(
                    {"provider_account": [f"name the provider account of enrolled hosts (usable: {names})"]}
                )
            attrs["provider_account"] = accounts[0]
        return attrs


class HostCapacitySerializer(serializers.Serializer):
    cpus = serializers.IntegerField()
    memory_mb = serializers.IntegerField()
    disk_gb = serializers.IntegerField()
    gpus = serializers.IntegerField()
    arch = serializers.CharField(allow_blank=True)


class HostUsedSerializer(serializers.Serializer):
    cpus = serializers.IntegerField()
    memory_mb = serializers.IntegerField()
    disk_gb = serializers.IntegerField()
    gpus = serializers.IntegerField()
    slots = serializers.IntegerField(help_text="live slots (machines) on the host, every organization's")


USED_KEYS = ("cpus", "memory_mb", "disk_gb", "gpus", "slots")


class HostSerializer(serializers.ModelSerializer):
    """An enrolled host; ``used`` is what its live slots take now (set by the view)."""

    org: serializers.SlugRelatedField[Any] = serializers.SlugRelatedField(
        slug_field="slug", read_only=True, allow_null=True, help_text="null: shared by the operator"
    )
    shared = serializers.SerializerMethodField(help_text="enrolled by the operator for every granted org")
    provider_account: serializers.SlugRelatedField[Any] = serializers.SlugRelatedField(
        slug_field="name", read_only=True
    )
    capacity = HostCapacitySerializer(source="*", read_only=True)
    used = serializers.SerializerMethodField()
    cordoned = serializers.BooleanField(read_only=True)
    draining = serializers.SerializerMethodField(help_text="cordoned with a deadline for its jobs")

    class Meta:
        model = Host
        fields = (
            "id",
            "name",
            "status",
            "org",
            "shared",
            "provider_account",
            "labels",
            "capacity",
            "used",
            "cordoned",
            "cordoned_at",
            "draining",
            "drain_deadline",
            "last_seen_at",
            "agent_version",
            "monthly_price",
            "enrolled_at",
            "status_changed_at",
        )
        read_only_fields = fields

    def get_shared(self, obj: Host) -> bool:
        return obj.org_id is None

    @extend_schema_field(HostUsedSerializer)
    def get_used(self, obj: Host) -> dict[str, int]:
        used = getattr(obj, "usage", None) or {}
        return {key: int(used.get(key) or 0) for key in USED_KEYS}

    def get_draining(self, obj: Host) -> bool:
        return obj.drain_deadline is not None


class HostUpdateIn(StrictFields):
    monthly_price = serializers.DecimalField(
        max_digits=12,
        decimal_places=2,
        min_value=Decimal("0"),
        allow_null=True,
        required=False,
        help_text="what the host costs a month, for cost attribution only (null clears it)",
    )
    labels = _labels_field(required=False)


class HostCordonIn(StrictFields):
    drain_seconds = serializers.IntegerField(
        min_value=0,
        max_value=MAX_DRAIN_SECONDS,
        required=False,
        allow_null=True,
        help_text="drain: its running jobs may finish for this long, then are requeued elsewhere "
        "(0: at once); left out: cordon only (running jobs finish, nothing new starts)",
    )


# ---- an organization's own cloud (apps/machines/owned.py) -------------------------------------------


class ProviderAccountSerializer(serializers.ModelSerializer):
    """An organization's own provider account: the credentials are never shown, only their keys."""

    credential_keys = serializers.SerializerMethodField(
        help_text="the credentials' names (never their values)"
    )
    machine_types = serializers.SerializerMethodField(help_text="its machine types (names)")

    class Meta:
        model = ProviderAccount
        fields = (
            "id",
            "name",
            "kind",
            "config",
            "credential_keys",
            "machine_types",
            "created_at",
            "updated_at",
        )
        read_only_fields = fields

    def get_credential_keys(self, obj: ProviderAccount) -> list[str]:
        return sorted(obj.credentials)

    def get_machine_types(self, obj: ProviderAccount) -> list[str]:
        return sorted(mt.name for mt in obj.machine_types.all())


def _credentials_field(**kwargs: Any) -> serializers.DictField:
    return serializers.DictField(
        child=serializers.CharField(max_length=10_000, trim_whitespace=False),
        write_only=True,
        help_text="write-only, stored encrypted: hetzner {token}; aws {access_key_id, secret_access_key}; "
        "azure {tenant_id, client_id, client_secret}",
        **kwargs,
    )


class ProviderAccountIn(StrictFields):
    name = serializers.CharField(max_length=64)
    kind = serializers.CharField(max_length=16, help_text="hetzner, aws or azure (as the operator allows)")
    config = serializers.DictField(
        required=False, default=dict, help_text="e.g. hetzner {location}, aws {region}"
    )
    credentials = _credentials_field()


class ProviderAccountUpdateIn(StrictFields):
    name = serializers.CharField(max_length=64, required=False)
    config = serializers.DictField(required=False)
    credentials = _credentials_field(required=False)


class OwnMachineTypeIn(StrictFields, serializers.ModelSerializer):
    """A machine type on your organization's own provider account."""

    name = serializers.CharField(max_length=64)
    provider_account = serializers.CharField(max_length=64, help_text="your own provider account's name")
    limits = QuotaSerializer(required=False, help_text="your own limits on it (a grant's quota fields)")

    class Meta:
        model = MachineType
        fields = (
            "name",
            "provider_account",
            *(f for f in MachineType.SETTABLE_FIELDS if f not in ("required_privilege", "host_labels")),
            "limits",
        )
        validators: list[Any] = []  # the service checks names within the organization

    def validate_provider_account(self, value: str) -> ProviderAccount:
        org = self.context.get("org")
        account = ProviderAccount.objects.filter(org=org, name=value).first() if org else None
        if account is None:
            slug = getattr(org, "slug", "?")
            raise serializers.ValidationError(f"no provider account {value} in organization {slug}")
        return account
