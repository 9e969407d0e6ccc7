"""Cordon, drain, uncordon, revoke and loss of enrolled hosts (apps.machines.hosts says what a
host and its slots are): the operations that end slots, through the machines' life cycle, so a
job on an ended slot is requeued as on any machine that ends (never run twice)."""

from __future__ import annotations

import contextlib
from datetime import timedelta
from decimal import Decimal, InvalidOperation
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from apps.core.actors import Actor
from apps.core.causes import Cause
from apps.core.errors import Conflict, ErrorCode, InvalidTransition, ValidationFailed
from apps.events.kinds import EventKind
from apps.events.services import event_record
from apps.machines.choices import INSTANCE_LIVE, HostStatus, InstanceStatus
from apps.machines.hosts import clean_labels, host_available
from apps.machines.lifecycle import instance_terminate
from apps.machines.models import Host, MachineInstance

# ---- cordon, drain, revoke, loss ----------------------------------------------------------------


def _end_slots(host: Host, *, actor: Actor, reason: str, idle_only: bool, cause: Any) -> int:
    ended = 0
    slots = MachineInstance.objects.filter(host=host, status__in=INSTANCE_LIVE).exclude(
        status=InstanceStatus.TERMINATING
    )
    if idle_only:
        slots = slots.exclude(status=InstanceStatus.CLAIMED)
    for slot_id in slots.values_list("pk", flat=True):
        with contextlib.suppress(InvalidTransition):
            instance_terminate(instance_id=slot_id, actor=actor, reason=reason, cause=cause)
            ended += 1
    return ended


def host_cordon(*, host_id: Any, actor: Actor = Actor.UNNAMED, drain_seconds: int | None = None) -> Host:
    """No new slot on the host; its idle slots end. ``drain_seconds``: its busy slots end (their
    jobs requeued) once that long has passed and they still run (0: at once)."""
    now = timezone.now()
    with transaction.atomic():
        host = Host.objects.select_for_update().get(pk=host_id)
        if host.status == HostStatus.REVOKED:
            raise Conflict("this host is revoked", code=ErrorCode.INVALID_STATE)
        first = host.cordoned_at is None
        host.cordoned_at = host.cordoned_at or now
        if drain_seconds is not None:
            host.drain_deadline = now + timedelta(seconds=max(0, drain_seconds))
        host.save(update_fields=["cordoned_at", "drain_deadline"])
        if first or drain_seconds is not None:
            event_record(
                kind=EventKind.HOST_DRAINING if drain_seconds is not None else EventKind.HOST_CORDONED,
                org=host.org_id,
                actor=actor,
                host=str(host.pk),
                **({"deadline": host.drain_deadline.isoformat()} if host.drain_deadline else {}),
            )
        _end_slots(host, actor=actor, reason="host cordoned", idle_only=True, cause=Cause.HOST_DRAINED)
    if drain_seconds == 0:
        host_drain_due(now=now + timedelta(seconds=1))
    return host


def host_uncordon(*, host_id: Any, actor: Actor = Actor.UNNAMED) -> Host:
    with transaction.atomic():
        host = Host.objects.select_for_update().get(pk=host_id)
        if host.status == HostStatus.REVOKED:
            raise Conflict("this host is revoked", code=ErrorCode.INVALID_STATE)
        if host.cordoned_at is not None:
            host.cordoned_at = None
            host.drain_deadline = None
            host.save(update_fields=["cordoned_at", "drain_deadline"])
            event_record(kind=EventKind.HOST_UNCORDONED, org=host.org_id, actor=actor, host=str(host.pk))
    host_available(host)  # waiting jobs may go there now
    return host


def host_update(
    *, host_id: Any, actor: Actor = Actor.UNNAMED, monthly_price: Any = ..., labels: Any = ...
) -> Host:
    """What an operator sets on a host: its monthly price (cost attribution only; None clears
    it) and its labels (which machine types' slots it takes: a slot already on it stays)."""
    with transaction.atomic():
        host = Host.objects.select_for_update().get(pk=host_id)
        changed: dict[str, Any] = {}
        if monthly_price is not ...:
            try:
                price = None if monthly_price in (None, "") else Decimal(str(monthly_price))
            except InvalidOperation:
                raise ValidationFailed.field("monthly_price", "a number, or empty") from None
            if price is not None and (price < 0 or price >= Decimal("1e10")):
                raise ValidationFailed.field("monthly_price", "from 0 to 9999999999.99")
            host.monthly_price = price
            changed["monthly_price"] = None if price is None else str(price)
        if labels is not ...:
            host.labels = clean_labels(labels)
            changed["labels"] = host.labels
        if changed:
            host.save(update_fields=[k for k in ("monthly_price", "labels") if k in changed])
            event_record(
                kind=EventKind.HOST_UPDATED, org=host.org_id, actor=actor, host=str(host.pk), **changed
            )
    return host


def host_revoke(*, host_id: Any, actor: Actor = Actor.UNNAMED) -> Host:
    """The host's credential is refused from now on and its slots end (their jobs requeued)."""
    with transaction.atomic():
        host = Host.objects.select_for_update().get(pk=host_id)
        if host.status != HostStatus.REVOKED:
            host.status = HostStatus.REVOKED
            host.status_changed_at = timezone.now()
            host.save(update_fields=["status", "status_changed_at"])
            event_record(kind=EventKind.HOST_REVOKED, org=host.org_id, actor=actor, host=str(host.pk))
        _end_slots(host, actor=actor, reason="host revoked", idle_only=False, cause=Cause.HOST_DRAINED)
    return host


def host_drain_due(*, now: Any = None) -> int:
    """The reaper, level-triggered: the idle slots of every cordoned, lost or revoked host end
    (a busy slot that went back to ready after its job since the cordon, say), and the busy
    slots of hosts whose drain deadline passed end too (their jobs requeued). Slots ended."""
    now = now or timezone.now()
    ended = 0
    closed = Host.objects.filter(Q(cordoned_at__isnull=False) | ~Q(status=HostStatus.ACTIVE))
    for host in closed.filter(slots__status__in=INSTANCE_LIVE).distinct():
        due = host.drain_deadline is not None and host.drain_deadline <= now
        state = "cordoned" if host.status == HostStatus.ACTIVE else host.status
        reason = "host drained: its deadline passed" if due else f"host {state}: it takes no new work"
        ended += _end_slots(
            host, actor=Actor.REAPER, reason=reason, idle_only=not due, cause=Cause.HOST_DRAINED
        )
    return ended


def hosts_lost(*, now: Any = None, listening_since: Any = None) -> int:
    """The reaper: active hosts silent for longer than the machine heartbeat deadline are lost
    (their slots' own agents stopped too: the machines' deadline requeues their jobs). Silence
    counts only since the control plane listened (``listening_since``, as for machines)."""
    now = now or timezone.now()
    cutoff = now - timedelta(seconds=settings.CATACLOUD_AGENT_LOST_AFTER)
    if listening_since is not None and listening_since > cutoff:
        return 0
    lost = 0
    for host in Host.objects.filter(status=HostStatus.ACTIVE, last_seen_at__lt=cutoff):
        with transaction.atomic():
            if Host.objects.filter(pk=host.pk, status=HostStatus.ACTIVE, last_seen_at__lt=cutoff).update(
                status=HostStatus.LOST, status_changed_at=now
            ):
                event_record(
                    kind=EventKind.HOST_LOST,
                    org=host.org_id,
                    actor=Actor.REAPER,
                    host=str(host.pk),
                    last_seen_at=host.last_seen_at.isoformat() if host.last_seen_at else None,
                )
                lost += 1
    return lost
