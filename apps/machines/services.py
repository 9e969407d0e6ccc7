"""Provider accounts, machine types, grants, and the machine instance state machine."""

from __future__ import annotations

import re
from datetime import datetime
from decimal import Decimal, InvalidOperation
from typing import Any

from django.db import transaction

from apps.core.actors import Actor
from apps.core.errors import ErrorCode, MissingPrivilege, NotFound, ValidationFailed
from apps.core.ids import MachineTypeId, OrgId
from apps.core.transitions import StateMachine
from apps.events.kinds import EventKind
from apps.events.services import event_record, events_record
from apps.machines.choices import (
    INSTANCE_TERMINAL,
    INSTANCE_TRANSITIONS,
    InstanceStatus,
    Policy,
    ProviderKind,
)
from apps.machines.models import MachineInstance, MachineType, OrgMachineType, ProviderAccount
from apps.orgs.models import Organization, Privilege
from catacloud.agent.netns import normalize_network
from catacloud.policy.billing import Billing

SLUG = re.compile(r"[-a-zA-Z0-9_]{1,64}")
ARCHES = ("x86_64", "arm64")  # EC2's names (Hetzner: x86 and arm)


def _invalid(field: str, message: str) -> ValidationFailed:
    return ValidationFailed.field(field, message)


# ---- catalog --------------------------------------------------------------------------------


@transaction.atomic
def provider_account_upsert(
    *, name: str, kind: str, config: dict[str, Any] | None = None, credentials: dict[str, str] | None = None
) -> tuple[ProviderAccount, bool]:
    """Create or update a provider account. Returns (account, changed)."""
    if kind not in ProviderKind.values:
        raise _invalid("kind", f"unknown provider kind {kind!r}; known: {', '.join(ProviderKind.values)}")
    config = dict(config or {})
    account = ProviderAccount.objects.select_for_update().filter(name=name, org__isnull=True).first()
    if account is None:
        account = ProviderAccount(name=name, kind=kind, config=config)
        account.credentials = credentials or {}
        account.save()
        event_record(
            kind=EventKind.PROVIDER_ACCOUNT_CREATED, actor=Actor.CATALOG, account=name, provider=kind
        )
        return account, True
    if account.kind != kind:
        raise _invalid("kind", f"provider account {name} is {account.kind}; its kind cannot change")
    return provider_account_update(account=account, name=name, config=config, credentials=credentials)


@transaction.atomic
def provider_account_update(
    *,
    account: ProviderAccount,
    name: str,
    config: dict[str, Any] | None = None,
    credentials: dict[str, str] | None = None,
    actor: Actor = Actor.CATALOG,
) -> tuple[ProviderAccount, bool]:
    """Change an account in place: its name (machines keep pointing at the same row), its
    config, its credentials (None keeps them). The kind never changes. Returns (account, changed)."""
    account = ProviderAccount.objects.select_for_update().get(pk=account.pk)
    config = dict(config or {})
    if name != account.name and (
        ProviderAccount.objects.filter(name=name, org_id=account.org_id).exclude(pk=account.pk).exists()
    ):
        raise _invalid("name", f"a provider account named {name} already exists")
    fields = [
        f for f, changed in (("name", name != account.name), ("config", account.config != config)) if changed
    ]
    if credentials is not None and account.credentials != credentials:
        fields.append("credentials")  # named, never shown
    if not fields:
        return account, False
    previous = account.name
    account.name = name
    account.config = config
    if credentials is not None:
        account.credentials = credentials
    account.save()
    event_record(
        kind=EventKind.PROVIDER_ACCOUNT_UPDATED,
        org=account.org_id,
        actor=actor,
        account=name,
        **({"renamed_from": previous} if previous != name else {}),
        fields=fields,
    )
    return account, True


def machine_type_clean(fields: dict[str, Any]) -> dict[str, Any]:
    """A machine type's settable fields as the catalog, the admin and the services take them
    (400 ``invalid`` naming the field otherwise)."""
    out = dict(fields)
    for name in ("cpus", "memory_mb"):
        if name in out and (not isinstance(out[name], int) or out[name] < 1):
            raise _invalid(name, "must be a whole number of at least 1")
    for name in ("gpus", "min_billed_seconds"):
        if name in out and (not isinstance(out[name], int) or out[name] < 0):
            raise _invalid(name, "must be a whole number of at least 0")
    if "billing_increment_seconds" in out and (
        not isinstance(out["billing_increment_seconds"], int) or out["billing_increment_seconds"] < 1
    ):
        raise _invalid("billing_increment_seconds", "must be a whole number of at least 1")
    if (
        "disk_gb" in out
        and out["disk_gb"] is not None
        and (not isinstance(out["disk_gb"], int) or isinstance(out["disk_gb"], bool) or out["disk_gb"] < 1)
    ):
        raise _invalid("disk_gb", "must be a whole number of at least 1 (GB), or empty for no limit")
    if "image_cache_mb" in out and (
        not isinstance(out["image_cache_mb"], int)
        or isinstance(out["image_cache_mb"], bool)
        or out["image_cache_mb"] < 1
    ):
        raise _invalid("image_cache_mb", "must be a whole number of at least 1 (MB)")
    if "containers" in out and not isinstance(out["containers"], bool):
        raise _invalid("containers", "must be true or false")
    if "host_labels" in out:  # enrolled hosts: the labels a host must carry
        from apps.machines.hosts import clean_labels

        out["host_labels"] = clean_labels(out["host_labels"] or {}, "host_labels")
    if "network" in out:
        try:
            out["network"] = normalize_network(out["network"])
        except ValueError as exc:
            raise _invalid("network", str(exc)) from None
    if "price_per_hour" in out:
        try:
            price = Decimal(str(out["price_per_hour"]))
        except InvalidOperation:
            raise _invalid("price_per_hour", "must be a number") from None
        if price < 0 or not price.is_finite():
            raise _invalid("price_per_hour", "must not be negative")
        out["price_per_hour"] = price
    if "alternatives" in out:
        out["alternatives"] = _clean_alternatives(out["alternatives"])
    if "labels" in out:
        from apps.machines.hosts import clean_labels

        out["labels"] = clean_labels(out["labels"] or {}, "labels")
    if "arch" in out and (not isinstance(out["arch"], str) or out["arch"] not in ARCHES):
        raise _invalid("arch", f"one of {', '.join(ARCHES)}")
    return out


def _clean_alternatives(value: Any) -> list[str]:
    """A list of machine type names, each once (they may be defined later in a catalog; a name
    that names no type is skipped when candidates are chosen, apps.machines.capacity)."""
    value = value or []
    if not isinstance(value, list) or not all(isinstance(v, str) and SLUG.fullmatch(v) for v in value):
        raise _invalid("alternatives", "must be a list of machine type names")
    return list(dict.fromkeys(value))


@transaction.atomic
def machine_type_upsert(
    *,
    name: str,
    provider_account: ProviderAccount,
    required_privilege: Privilege | None = None,
    **fields: Any,
) -> tuple[MachineType, bool]:
    """Create or update a machine type; a change to how machines are built bumps ``version``."""
    fields = machine_type_clean(fields)
    unknown = set(fields) - {f.name for f in MachineType._meta.get_fields()}
    if unknown:
        raise _invalid(sorted(unknown)[0], "unknown machine type field")
    mt = MachineType.objects.select_for_update().filter(name=name, org__isnull=True).first()
    if mt is None:
        mt = MachineType.objects.create(
            name=name, provider_account=provider_account, required_privilege=required_privilege, **fields
        )
        event_record(kind=EventKind.MACHINE_TYPE_CREATED, actor=Actor.CATALOG, machine_type=name)
        return mt, True
    return machine_type_update(
        machine_type=mt, provider_account=provider_account, required_privilege=required_privilege, **fields
    )


@transaction.atomic
def machine_type_update(
    *, machine_type: MachineType, actor: Actor = Actor.CATALOG, **fields: Any
) -> tuple[MachineType, bool]:
    """Change a machine type in place (its name too). The one place ``version`` grows: a
    change to how machines are built (``BUILD_FIELDS``) makes existing machines outdated."""
    fields = machine_type_clean(fields)
    mt = MachineType.objects.select_for_update(of=("self",)).get(pk=machine_type.pk)
    wanted: dict[str, Any] = {}
    for key, value in fields.items():
        if key in ("provider_account", "required_privilege"):
            wanted[f"{key}_id"] = getattr(value, "pk", value)
        else:
            wanted[key] = value
    known = {f.attname for f in MachineType._meta.concrete_fields} - {
        "id",
        "version",
        "created_at",
        "updated_at",
    }
    unknown = set(wanted) - known
    if unknown:
        raise _invalid(sorted(unknown)[0], "unknown machine type field")
    if "name" in wanted and (
        MachineType.objects.filter(name=wanted["name"], org_id=mt.org_id).exclude(pk=mt.pk).exists()
    ):
        raise _invalid("name", f"a machine type named {wanted['name']} already exists")
    changed = {k: v for k, v in wanted.items() if getattr(mt, k) != v}
    if not changed:
        return mt, False
    for k, v in changed.items():
        setattr(mt, k, v)
    if set(changed) & set(MachineType.BUILD_FIELDS):
        mt.version += 1
    mt.save()
    event_record(
        kind=EventKind.MACHINE_TYPE_UPDATED,
        org=mt.org_id,
        actor=actor,
        machine_type=mt.name,
        version=mt.version,
        fields=sorted(changed),
    )
    return mt, True


def grant_clean_quota(quota: dict[str, Any]) -> None:
    """A grant's quota fields as the catalog, the admin and an organization's own types take them."""
    unknown = set(quota) - set(OrgMachineType.QUOTA_FIELDS)
    if unknown:
        raise _invalid(sorted(unknown)[0], "unknown quota field")
    for key, value in quota.items():
        if key == "policy":
            if value not in Policy.values:
                raise _invalid("policy", f"must be one of {', '.join(Policy.values)}")
        elif value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise _invalid(key, "must be a whole number of at least 0")


def grant_check_owner(*, org: Organization, machine_type: MachineType) -> None:
    """An organization's own machine type is granted to it alone, and an operator's type is not
    granted beside an own type of the same name (an organization names each type it uses once)."""
    if machine_type.org_id is not None and machine_type.org_id != org.pk:
        raise _invalid("machine_type", f"machine type {machine_type.name} is another organization's own")
    if machine_type.org_id is None and MachineType.objects.filter(org=org, name=machine_type.name).exists():
        message = f"organization {org.slug} has a machine type of its own named {machine_type.name}"
        raise ValidationFailed(
            f"machine_type: {message}", fields={"machine_type": [message]}, code=ErrorCode.DUPLICATE_NAME
        )


def grant_check_privilege(*, org: Organization, machine_type: MachineType) -> None:
    if not org.has_privilege(machine_type.required_privilege):
        raise MissingPrivilege(
            f"machine type {machine_type.name} requires privilege {machine_type.required_privilege}, "
            f"which {org.slug} lacks"
        )


def grant_lock(
    *, org_id: OrgId, machine_type_id: MachineTypeId, nowait: bool = False, with_type: bool = False
) -> OrgMachineType | None:
    """Lock the grant row of (org, machine type) until the transaction ends, or None.

    The first lock in the one lock order (grant, pool, instance, job) that every path buying
    machines or admitting jobs takes. Only this row: a plain ``select_for_update().first()``
    would join (the default ordering) and lock the organization and machine type rows too,
    and every insert that references the organization would wait on it. ``nowait``: raise
    ``OperationalError`` instead of waiting when another transaction holds it. ``with_type``:
    its machine type read in the same statement (joined, not locked)."""
    rows = OrgMachineType.objects.select_for_update(of=("self",), nowait=nowait)
    if with_type:
        rows = rows.select_related("machine_type")
    return rows.filter(org_id=org_id, machine_type_id=machine_type_id).order_by().first()


def not_granted_message(*, org: Organization, machine_type: MachineType | Any) -> str:
    """``no grant for local-large in organization demo``: what to ask the operator for."""
    name: str | None
    if isinstance(machine_type, MachineType):
        name = machine_type.name
    else:  # a primary key
        name = MachineType.objects.filter(pk=machine_type).values_list("name", flat=True).first()
    return f"no grant for {name or machine_type} in organization {org.slug}"


def grant_for(*, org: Organization, machine_type: MachineType | Any) -> OrgMachineType:
    """The org's grant on a machine type, or NotFound (the type is not the org's to use)."""
    grant = (
        OrgMachineType.objects.filter(org=org, machine_type=machine_type)
        .select_related("machine_type")
        .first()
    )
    if grant is None:
        message = not_granted_message(org=org, machine_type=machine_type)
        raise NotFound(message, code=ErrorCode.MACHINE_TYPE_NOT_GRANTED)
    return grant


# ---- instance state machine -----------------------------------------------------------------

# The timestamp each state stamps when it is entered.
_STAMPS = {
    InstanceStatus.PROVISIONING: "provisioning_started_at",
    InstanceStatus.WARMING: "warming_started_at",
    InstanceStatus.READY: "ready_at",
    InstanceStatus.CLAIMED: "claimed_at",
    InstanceStatus.TERMINATING: "terminating_at",
    InstanceStatus.TERMINATED: "ended_at",
    InstanceStatus.FAILED: "ended_at",
    InstanceStatus.LOST: "ended_at",
}


def _record_billing(instance: MachineInstance, now: datetime) -> None:
    """Every instance records its billed seconds and cost when it ends."""
    started = instance.provisioning_started_at
    if started is None:  # never reached the provider: nothing billed
        billed, cost = 0, Decimal(0)
    else:
        mt = MachineType.objects.get(pk=instance.machine_type_id)
        billing = Billing(mt.billing_increment_seconds, mt.min_billed_seconds, mt.price_per_hour)
        runtime = (now - started).total_seconds()
        billed, cost = billing.billed_seconds(runtime), billing.cost(runtime)
    MachineInstance.objects.filter(pk=instance.pk).update(billed_seconds=billed, cost=cost)
    instance.billed_seconds, instance.cost = billed, cost


# Every instance status change: INSTANCE_STATES.move(instance_id, to=..., ...). An instance
# that ends records its billed seconds and cost in the same transaction.
INSTANCE_STATES = StateMachine(
    MachineInstance,
    INSTANCE_TRANSITIONS,
    "instance",
    kinds=EventKind,
    record=event_record,
    record_many=events_record,
    stamps=_STAMPS,
    on_enter={state: _record_billing for state in INSTANCE_TERMINAL},
)
