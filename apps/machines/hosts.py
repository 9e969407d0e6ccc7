"""Enrolled hosts: machines the user owns (bare metal, long-lived VMs), beside bought ones.

An admin makes an **enrolment token** (scoped to an organization, or shared by the operator;
with labels; single-use or bounded in uses and time; shown once, stored hashed). The host's
agent (``catacloud host``) exchanges it for a credential of the host's own, then reports what it
has and which slots it runs, and is answered what to start and stop.

A **slot** is a machine instance whose ``host`` is set: its machine type (a provider account of
kind ``hosts``) says how much of a host one job takes (cpus, memory, disk) and which labels the
host must carry. A slot is requested as any machine is (placement, a pool's refill), under the
grant lock; the host is chosen then, under the host rows' locks (lock order: grant, hosts,
instance), among the eligible hosts with room (the least busy first), so a host never runs
more than its capacity. Nothing is bought: the slot's driver (``apps.machines.hostdriver``)
records nothing at a provider; the host's next exchange starts it (a sandbox of the slot's size
on the host whose agent enrolls with the slot's bootstrap token), and from then on the slot is a
machine like any other (jobs, reuse, pools, loss, the reconciler).

A host scoped to an organization runs only that organization's slots; a shared one any granted
organization's, each in its own sandbox. **Cordon** stops new slots on a host (its idle slots
end); **drain** cordons and, after a deadline, ends its busy slots (their jobs requeued);
**uncordon** takes it back. A host whose agent stops reporting is **lost** after the machine
heartbeat deadline (its slots, whose agents stopped too, are lost and their jobs requeued by the
machines' own deadline); it is active again when its agent returns, without a new enrolment.
**Revoking** a host refuses its calls and ends its slots (jobs requeued).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.db import transaction
from django.db.models import Count, F, Q, Sum
from django.utils import timezone

from apps.core import broker, hooks
from apps.core.actors import Actor
from apps.core.crypto import hash_token, new_token
from apps.core.errors import ErrorCode, Unauthenticated, ValidationFailed
from apps.core.selectors import installation_id
from apps.events.kinds import EventKind
from apps.events.services import event_record
from apps.machines.bootstrap import token_for
from apps.machines.choices import INSTANCE_LIVE, HostStatus, InstanceStatus, ProviderKind
from apps.machines.models import (
    EnrolmentToken,
    Host,
    MachineInstance,
    MachineType,
    OrgMachineType,
    ProviderAccount,
)
from catacloud.protocol import HostCapacity, HostReport, SlotStart
from catacloud.providers.base import LABEL_INSTALLATION, LABEL_INSTANCE, LABEL_ORG, LABEL_POOL

ENROLMENT_PREFIX = "ce"  # enrolment tokens
HOST_TOKEN_PREFIX = "ch"  # a host's own credential
MAX_LABELS = 32
MAX_TTL_SECONDS = 366 * 86400
# What a host reports of itself becomes labels a machine type may select on.
REPORTED_LABELS = ("arch",)
# Slots a host holds: everything live but terminating ones whose sandbox the host stopped.
_HOLDING = INSTANCE_LIVE


class NoHostRoom(Exception):
    """No eligible host has room for one more slot of this machine type (its pending reason)."""


# ---- enrolment tokens ------------------------------------------------------------------------


def clean_labels(value: object, field: str = "labels") -> dict[str, str]:
    """Labels as ``{str: str}``: at most :data:`MAX_LABELS`, short keys and values."""
    if not isinstance(value, Mapping):
        raise ValidationFailed.field(field, "must be an object of strings")
    labels = {}
    for key, item in value.items():
        if not isinstance(key, str) or not isinstance(item, str | int) or isinstance(item, bool):
            raise ValidationFailed.field(field, "each label is a string")
        if not (0 < len(key) <= 63 and len(str(item)) <= 63):
            raise ValidationFailed.field(field, "keys of 1-63, values of 0-63 characters")
        if "\x00" in key or "\x00" in str(item):
            raise ValidationFailed.field(field, "a label holds no NUL character")
        labels[key] = str(item)
    if len(labels) > MAX_LABELS:
        raise ValidationFailed.field(field, f"at most {MAX_LABELS} labels")
    return labels


def enrolment_token_create(
    *,
    provider_account: ProviderAccount,
    org: Any = None,
    labels: Mapping[str, Any] | None = None,
    max_uses: int = 1,
    ttl_seconds: int = 86400,
    description: str = "",
    actor: Actor = Actor.UNNAMED,
) -> tuple[EnrolmentToken, str]:
    """A token hosts enroll with (returned once; stored hashed)."""
    if provider_account.kind != ProviderKind.HOSTS:
        raise ValidationFailed.field(
            "provider_account",
            f"provider account {provider_account.name} is not for enrolled hosts (its kind is "
            f"{provider_account.kind}; make one of kind hosts)",
        )
    if not (isinstance(max_uses, int) and 1 <= max_uses <= 10_000):
        raise ValidationFailed.field("max_uses", "a whole number from 1 to 10000")
    if not (isinstance(ttl_seconds, int) and 60 <= ttl_seconds <= MAX_TTL_SECONDS):
        raise ValidationFailed.field("ttl_seconds", "from 60 seconds to a year")
    secret = new_token(ENROLMENT_PREFIX)
    with transaction.atomic():
        token = EnrolmentToken.objects.create(
            provider_account=provider_account,
            org_id=getattr(org, "pk", org),
            labels=clean_labels(labels or {}),
            description=description[:200],
            token_hash=hash_token(secret),
            prefix=secret[:10],
            max_uses=max_uses,
            expires_at=timezone.now() + timedelta(seconds=ttl_seconds),
            created_by=str(actor)[:200],
        )
        event_record(
            kind=EventKind.ENROLMENT_TOKEN_CREATED,
            org=token.org_id,
            actor=actor,
            token=str(token.pk),
            prefix=token.prefix,
            labels=token.labels,
            max_uses=max_uses,
            expires_at=token.expires_at.isoformat(),
        )
    return token, secret


def enrolment_token_revoke(*, token_id: Any, actor: Actor = Actor.UNNAMED) -> EnrolmentToken:
    """No host enrolls with it any more (hosts that did keep their own credential)."""
    with transaction.atomic():
        token = EnrolmentToken.objects.select_for_update().get(pk=token_id)
        if token.revoked_at is None:
            token.revoked_at = timezone.now()
            token.save(update_fields=["revoked_at"])
            event_record(
                kind=EventKind.ENROLMENT_TOKEN_REVOKED, org=token.org_id, actor=actor, token=str(token.pk)
            )
    return token


# ---- enrolment and the host's exchange ---------------------------------------------------------


def host_enroll(
    *, enrolment_token: str, hostname: str, capacity: HostCapacity, agent_version: str = ""
) -> tuple[Host, str]:
    """A host's credential for a live enrolment token (returned once, stored hashed); 401
    ``invalid_enrolment_token`` for a forged, expired, revoked or used-up one."""
    refused = Unauthenticated(
        "this enrolment token is not valid (unknown, expired, revoked or used up)",
        code=ErrorCode.INVALID_ENROLMENT_TOKEN,
    )
    if not enrolment_token.startswith(f"{ENROLMENT_PREFIX}_"):
        raise refused
    secret = new_token(HOST_TOKEN_PREFIX)
    now = timezone.now()
    with transaction.atomic():
        used = EnrolmentToken.objects.filter(
            token_hash=hash_token(enrolment_token),
            revoked_at__isnull=True,
            expires_at__gt=now,
            uses__lt=F("max_uses"),
        ).update(uses=F("uses") + 1)
        if not used:
            raise refused
        token = EnrolmentToken.objects.get(token_hash=hash_token(enrolment_token))
        reported = {"arch": capacity.arch} if capacity.arch else {}
        host = Host.objects.create(
            name=hostname[:200] or "host",
            provider_account_id=token.provider_account_id,
            org_id=token.org_id,
            enrolment=token,
            labels={**reported, **token.labels},
            agent_token_hash=hash_token(secret),
            agent_version=agent_version[:32],
            last_seen_at=now,
            **_capacity_fields(capacity),
        )
        event_record(
            kind=EventKind.HOST_ENROLLED,
            org=host.org_id,
            actor=Actor.host(host.pk),
            host=str(host.pk),
            name=host.name,
            labels=host.labels,
            capacity=capacity.to_json(),
            token=str(token.pk),
        )
    host_available(host)  # jobs waiting for a slot may go there now
    return host, secret


def host_available(host: Host) -> None:
    """A host can take slots now (enrolled, back, uncordoned): a scheduling pass after commit for
    every grant whose jobs may run there (its organization's, or every one for a shared host)."""
    types = MachineType.objects.filter(provider_account_id=host.provider_account_id).values_list(
        "pk", flat=True
    )
    grants = OrgMachineType.objects.filter(machine_type_id__in=list(types))
    if host.org_id is not None:
        grants = grants.filter(org_id=host.org_id)
    for org_id, mt_id in grants.values_list("org_id", "machine_type_id"):
        hooks.machine_available(org_id=org_id, machine_type_id=mt_id)


def _capacity_fields(capacity: HostCapacity) -> dict[str, Any]:
    return {
        "cpus": max(1, int(capacity.cpus)),
        "memory_mb": max(1, int(capacity.memory_mb)),
        "disk_gb": max(0, int(capacity.disk_gb)),
        "gpus": max(0, int(capacity.gpus)),
        "arch": capacity.arch[:32],
    }


def host_for_token(token: str) -> Host | None:
    """The enrolled, not revoked host whose agent holds ``token``."""
    if not token.startswith(f"{HOST_TOKEN_PREFIX}_"):
        return None
    return (
        Host.objects.filter(agent_token_hash=hash_token(token))
        .exclude(status=HostStatus.REVOKED)
        .select_related("provider_account")
        .first()
    )


@dataclass(frozen=True)
class Orders:
    """What a host is told: the slots to start, those to stop, whether it is cordoned."""

    start: list[SlotStart]
    stop: list[str]
    cordoned: bool


def host_exchange(*, host: Host, report: HostReport) -> Orders:
    """Record what the host runs (and has), bring a lost host back, and answer what it starts
    and stops: level-triggered, each answer says it all again until the host's report shows it."""
    now = timezone.now()
    running = [str(i) for i in report.running[:4096]]
    fields: dict[str, Any] = {"last_seen_at": now, "running": running}
    if report.capacity is not None:
        fields.update(_capacity_fields(report.capacity))
    Host.objects.filter(pk=host.pk).update(**fields)
    if host.status == HostStatus.LOST:
        with transaction.atomic():
            if Host.objects.filter(pk=host.pk, status=HostStatus.LOST).update(
                status=HostStatus.ACTIVE, status_changed_at=now
            ):
                event_record(
                    kind=EventKind.HOST_RETURNED,
                    org=host.org_id,
                    actor=Actor.host(host.pk),
                    host=str(host.pk),
                )
                host_available(host)
    return _orders(host, running)


def _orders(host: Host, running: Sequence[str]) -> Orders:
    slots = {
        str(row["pk"]): row
        for row in MachineInstance.objects.filter(host=host, status__in=INSTANCE_LIVE).values(
            "pk",
            "status",
            "agent_token_hash",
            "org_id",
            "pool_id",
            "machine_type__cpus",
            "machine_type__memory_mb",
            "machine_type__disk_gb",
            "machine_type__gpus",
        )
    }
    start = [
        SlotStart(
            instance_id=slot_id,
            bootstrap_token=token_for(row["pk"]),
            cpus=row["machine_type__cpus"],
            memory_mb=row["machine_type__memory_mb"],
            disk_gb=row["machine_type__disk_gb"],
            gpus=row["machine_type__gpus"],
            labels=_slot_labels(row),
        )
        for slot_id, row in slots.items()
        # asked for (its driver ran), its agent not enrolled yet, not running: (again) start it
        if row["status"] in (InstanceStatus.PROVISIONING, InstanceStatus.WARMING)
        and not row["agent_token_hash"]
        and slot_id not in running
    ]
    stop = [
        slot_id
        for slot_id in running
        if slot_id not in slots or slots[slot_id]["status"] == InstanceStatus.TERMINATING
    ]
    return Orders(start=start, stop=stop, cordoned=host.cordoned)


def _slot_labels(row: Mapping[str, Any]) -> dict[str, str]:
    return {
        LABEL_INSTALLATION: installation_id(),
        LABEL_INSTANCE: str(row["pk"]),
        LABEL_ORG: str(row["org_id"]),
        LABEL_POOL: str(row["pool_id"]) if row["pool_id"] else "none",
    }


# The pub/sub channel a host's exchange waits on (apps.control.agent.wakeups: one namespace with
# the machines' own, which are UUIDs).
HOST_WAKE = "host-{}"


def host_wake(host_id: Any) -> None:
    """Wake the host's waiting exchange (best effort: it looks again at its timeout)."""
    broker.wake(HOST_WAKE.format(host_id), "slots")


# ---- where a slot goes ---------------------------------------------------------------------------


def _eligible(org_id: Any, mt: MachineType) -> Any:
    """Hosts a slot of ``mt`` for ``org_id`` may run on: active, not cordoned, of the type's
    account, the org's own or shared, carrying every label the type asks for."""
    hosts = Host.objects.filter(
        provider_account_id=mt.provider_account_id, status=HostStatus.ACTIVE, cordoned_at__isnull=True
    ).filter(Q(org__isnull=True) | Q(org_id=org_id))
    if mt.host_labels:
        hosts = hosts.filter(labels__contains=mt.host_labels)
    return hosts


def _used(host_ids: Iterable[Any]) -> dict[Any, Mapping[str, Any]]:
    """What the slots of each host take: its live ones, and ended ones its host still reports
    running (their sandbox not stopped yet: it still holds the host's cpus and memory). Two
    queries, however many hosts."""
    ids = list(host_ids)
    still_running = [
        slot
        for running in Host.objects.filter(pk__in=ids).values_list("running", flat=True)
        for slot in running or []
        if _is_uuid(slot)
    ]
    rows = (
        MachineInstance.objects.filter(host_id__in=ids)
        .filter(Q(status__in=_HOLDING) | Q(pk__in=still_running))
        .values("host_id")
        .annotate(
            cpus=Sum("machine_type__cpus"),
            memory_mb=Sum("machine_type__memory_mb"),
            disk_gb=Sum("machine_type__disk_gb"),
            gpus=Sum("machine_type__gpus"),
            slots=Count("pk"),
        )
    )
    return {row["host_id"]: row for row in rows}


def _is_uuid(value: object) -> bool:
    try:
        uuid.UUID(str(value))
    except ValueError:
        return False
    return True


def hosts_usage(host_ids: Iterable[Any]) -> dict[Any, Mapping[str, Any]]:
    """What each host's live slots take now: cpus, memory_mb, disk_gb, gpus and slots (their
    count); a host with none is left out."""
    return _used(host_ids)


def _room(host: Host, used: Mapping[str, Any] | None, mt: MachineType) -> int:
    """How many more slots of ``mt`` fit on ``host``."""
    used = used or {}
    fits = [
        (host.cpus - (used.get("cpus") or 0)) // max(1, mt.cpus),
        (host.memory_mb - (used.get("memory_mb") or 0)) // max(1, mt.memory_mb),
    ]
    if mt.gpus:
        fits.append((host.gpus - (used.get("gpus") or 0)) // mt.gpus)
    if mt.disk_gb and host.disk_gb:
        fits.append((host.disk_gb - (used.get("disk_gb") or 0)) // mt.disk_gb)
    return max(0, min(fits))


def hosts_room(*, org_id: Any, machine_type: MachineType) -> int:
    """Slots of ``machine_type`` the org's eligible hosts could still take (no locks: placement
    caps what it asks for with it; the slot's request decides under the hosts' locks)."""
    hosts = list(_eligible(org_id, machine_type))
    used = _used(h.pk for h in hosts)
    return sum(_room(h, used.get(h.pk), machine_type) for h in hosts)


def slot_host(*, org_id: Any, machine_type: MachineType) -> Host:
    """The host a new slot goes to: the eligible host with room that is least busy, locked (in
    id order) until the caller's transaction ends, so two requests never fill one host past its
    capacity. Raises :class:`NoHostRoom`."""
    hosts = list(_eligible(org_id, machine_type).order_by("pk").select_for_update(of=("self",)))
    used = _used(h.pk for h in hosts)
    best = None
    for host in hosts:
        room = _room(host, used.get(host.pk), machine_type)
        if room <= 0:
            continue
        busy = (used.get(host.pk) or {}).get("cpus") or 0
        key = (busy / max(1, host.cpus), str(host.pk))
        if best is None or key < best[0]:
            best = (key, host)
    if best is None:
        raise NoHostRoom(no_room_reason(org_id=org_id, machine_type=machine_type, hosts=len(hosts)))
    return best[1]


def no_room_reason(*, org_id: Any, machine_type: MachineType, hosts: int | None = None) -> str:
    """A waiting job's pending reason when every eligible host is full (or none is there)."""
    if hosts is None:
        hosts = _eligible(org_id, machine_type).count()
    if not hosts:
        wanted = f" with labels {machine_type.host_labels}" if machine_type.host_labels else ""
        return f"no enrolled host{wanted} can take {machine_type.name} now (none active and uncordoned)"
    return f"every slot of {machine_type.name} on its {hosts} host(s) is busy"
