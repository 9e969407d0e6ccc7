"""The reaper's rules for machine instances: every live state has a deadline.

Each rule finds the rows past their deadline with one query (bounded batch) and acts on
each with the same idempotent services a task would call. A lost Celery message therefore
delays a row by at most its deadline plus one reaper tick.

| state        | deadline (from status_changed_at)         | the reaper                        |
|--------------|-------------------------------------------|-----------------------------------|
| pending      | CATACLOUD_REDRIVE_AFTER                   | provisions it itself (a repair)   |
| provisioning | CATACLOUD_REDRIVE_AFTER                   | provisions it itself (a repair)   |
| pending..warming | pool warmup_grace / CATACLOUD_BOOT_TIMEOUT | terminates it           |
| claimed      | lease_expires_at (acquire lease_seconds)  | terminates it (claim released)    |
| terminating  | CATACLOUD_REDRIVE_AFTER                   | destroys it itself (a repair)     |

A re-drive never rides the broker that lost the first message: the row goes to the reaper's
``Repairs`` (apps/core/repairs.py), which calls the task's service in the reaper's process.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import F
from django.db.models.functions import Coalesce

from apps.core.actors import Actor
from apps.core.causes import Cause
from apps.core.errors import InvalidTransition
from apps.core.ids import InstanceId
from apps.core.repairs import Repairs
from apps.events.kinds import EventKind
from apps.events.services import event_record
from apps.machines.choices import InstanceStatus
from apps.machines.lifecycle import instance_destroy, instance_fail, instance_provision, instance_terminate
from apps.machines.models import MachineInstance
from catacloud.providers import ProviderError

log = logging.getLogger(__name__)
BATCH = 500
BOOTING = [InstanceStatus.PENDING, InstanceStatus.PROVISIONING, InstanceStatus.WARMING]


def instances_converge(*, now: datetime, repairs: Repairs) -> dict[str, int]:
    return {
        "redriven_provision": redrive_provisioning(now=now, repairs=repairs),
        "redriven_terminate": redrive_terminating(now=now, repairs=repairs),
        "stuck": terminate_stuck(now=now),
        "leases_expired": expire_leases(now=now),
    }


def redrive_provisioning(*, now: datetime, repairs: Repairs) -> int:
    """Pending or provisioning past the re-drive deadline: its task was lost (or is backing
    off); the reaper provisions it itself. instance_provision is idempotent (the provider
    adopts by name or client token), so a task still alive meanwhile does no harm."""
    cutoff = now - timedelta(seconds=settings.CATACLOUD_REDRIVE_AFTER)
    ids = MachineInstance.objects.filter(
        status__in=[InstanceStatus.PENDING, InstanceStatus.PROVISIONING],
        status_changed_at__lt=cutoff,
        provider_id="",
    ).values_list("pk", flat=True)[:BATCH]
    count = 0
    for instance_id in ids:
        count += repairs.submit(f"instance-provision:{instance_id}", provision_again, instance_id)
    return count


def provision_again(instance_id: InstanceId) -> None:
    """The provision task's service as a repair: a refusal fails the instance (as the task's
    last retry does); a transient error is left for the next tick."""
    try:
        instance_provision(instance_id=instance_id)
    except ProviderError as exc:
        if exc.retryable:
            raise
        instance_fail(instance_id=instance_id, reason=f"{exc.code}: {exc}")


def destroy_again(instance_id: InstanceId) -> None:
    instance_destroy(instance_id=instance_id)


def redrive_terminating(*, now: datetime, repairs: Repairs) -> int:
    cutoff = now - timedelta(seconds=settings.CATACLOUD_REDRIVE_AFTER)
    ids = MachineInstance.objects.filter(
        status=InstanceStatus.TERMINATING, status_changed_at__lt=cutoff
    ).values_list("pk", flat=True)[:BATCH]
    count = 0
    for instance_id in ids:
        count += repairs.submit(f"instance-destroy:{instance_id}", destroy_again, instance_id)
    return count


def terminate_stuck(*, now: datetime) -> int:
    """Machines that did not become ready in time (pool members: their pool's
    warmup_grace_seconds; others: CATACLOUD_BOOT_TIMEOUT), counted from the provisioning
    start (or the request, for a machine still pending)."""
    default_grace = settings.CATACLOUD_BOOT_TIMEOUT
    rows = (
        MachineInstance.objects.filter(status__in=BOOTING)
        .annotate(
            grace=F("pool__warmup_grace_seconds"), since=Coalesce("provisioning_started_at", "created_at")
        )
        .order_by("since")
        .values("pk", "since", "grace", "pool_id", "org_id")[: BATCH * 4]
    )
    count = 0
    for row in rows:
        grace = row["grace"] if row["pool_id"] and row["grace"] is not None else default_grace
        if now - row["since"] <= timedelta(seconds=grace):
            continue
        reason = f"not ready within {grace:.0f}s"
        try:
            instance_terminate(
                instance_id=row["pk"], actor=Actor.REAPER, reason=reason, cause=Cause.BOOT_TIMEOUT
            )
        except InvalidTransition:
            continue
        event_record(
            kind=EventKind.POOL_MEMBER_STUCK if row["pool_id"] else EventKind.INSTANCE_STUCK,
            org=row["org_id"],
            pool=row["pool_id"],
            instance=row["pk"],
            actor=Actor.REAPER,
            reason=reason,
        )
        count += 1
        if count >= BATCH:
            break
    return count


def expire_leases(*, now: datetime) -> int:
    """Claims acquired with ``lease_seconds`` end when the lease does: the machine is
    terminated (a used machine never returns to a pool) and its pool refills."""
    rows = MachineInstance.objects.filter(status=InstanceStatus.CLAIMED, lease_expires_at__lt=now).values(
        "pk", "org_id", "pool_id", "claim_id", "claimed_by"
    )[:BATCH]
    count = 0
    for row in rows:
        try:
            instance_terminate(
                instance_id=row["pk"],
                actor=Actor.REAPER,
                reason="claim lease expired",
                cause=Cause.LEASE_EXPIRED,
            )
        except InvalidTransition:
            continue
        event_record(
            kind=EventKind.INSTANCE_LEASE_EXPIRED,
            org=row["org_id"],
            pool=row["pool_id"],
            instance=row["pk"],
            actor=Actor.REAPER,
            claim_id=str(row["claim_id"]),
            acquired_by=row["claimed_by"],
        )
        count += 1
    return count
