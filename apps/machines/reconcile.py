"""The reconciler: compare one provider account's machines with the database, both ways.

- a machine carrying this installation's label with no live row, older than the grace
  period → deleted (``reconcile.orphan_deleted``); so is a second machine carrying the label of
  a live row that records another machine (a create re-driven after the cloud forgot the first
  one's idempotency key, as after a database restore): one machine a row;
- a row stuck in ``provisioning`` with no provider id (the worker died between the cloud's
  create and our record) → adopted by its instance label (→ warming), or failed when no
  machine exists (``reconcile.adopted`` / ``reconcile.not_created``);
- a live row whose machine is gone → ``lost`` (its job is requeued, its pool refilled);
- a ``terminating`` row whose task was lost → its destruction is enqueued again.
Bounded batches; a rate-limited provider stops this pass (the next tick continues).
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from apps.core.actors import Actor
from apps.core.broker import enqueue
from apps.core.errors import InvalidTransition
from apps.events.kinds import EventKind
from apps.events.services import event_record
from apps.machines.choices import INSTANCE_LIVE, InstanceStatus, ProviderKind
from apps.machines.lifecycle import (
    TERMINATE_TASK,
    instance_gone,
    instance_mark_lost,
    owner_labels,
    provider_facts,
    provider_for,
)
from apps.machines.models import MachineInstance, ProviderAccount
from apps.machines.services import INSTANCE_STATES
from catacloud.providers import NotFound, Provider, ProviderError, ProviderMachine, RateLimited
from catacloud.providers.local import LocalProvider, end_processes, machine_processes

log = logging.getLogger(__name__)
BATCH = 200


@dataclass
class ReconcileReport:
    account: str
    orphans_deleted: list[str] = field(default_factory=list)
    adopted: list[str] = field(default_factory=list)
    not_created: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    retried_terminations: list[str] = field(default_factory=list)
    error: str = ""

    @property
    def actions(self) -> int:
        return sum(
            map(
                len,
                (self.orphans_deleted, self.adopted, self.not_created, self.lost, self.retried_terminations),
            )
        )


def reconcile_account(
    *, account: ProviderAccount, grace_seconds: float | None = None, restart: bool = False
) -> ReconcileReport:
    """Compare ``account``'s labelled machines with its live rows, both ways. ``restart``: the
    machines missing ended with the previous run of the control plane (local machines stop with
    `make dev`), which is not a failure."""
    grace = timedelta(seconds=settings.CATACLOUD_RECONCILE_GRACE if grace_seconds is None else grace_seconds)
    report = ReconcileReport(account=account.name)
    provider = provider_for(account)
    try:
        machines = provider.list(owner_labels())  # no transaction open
    except RateLimited as exc:
        report.error = f"rate limited: {exc}"
        return report
    except ProviderError as exc:
        report.error = f"{exc.code}: {exc}"
        log.warning("reconcile %s: cannot list machines: %s", account.name, exc.code)
        return report
    live_rows = _live_rows(account)
    by_instance, unowned = _match(machines, live_rows)
    now = timezone.now()
    _delete_unowned(provider, account, unowned, live_rows, now=now, grace=grace, report=report)
    _check_rows(live_rows, by_instance, now=now, grace=grace, restart=restart, report=report)
    return report


def _live_rows(account: ProviderAccount) -> dict[str, dict[str, Any]]:
    return {
        str(row["id"]): dict(row)
        for row in MachineInstance.objects.filter(provider_account=account, status__in=INSTANCE_LIVE).values(
            "id",
            "status",
            "provider_id",
            "created_at",
            "provisioning_started_at",
            "pool_id",
            "org_id",
            "provider_state",
            "public_ip",
            "private_ip",
        )
    }


def _match(
    machines: list[ProviderMachine], live_rows: dict[str, dict[str, Any]]
) -> tuple[dict[str, ProviderMachine], list[tuple[str, ProviderMachine]]]:
    """The machine each live row owns (the one it records or, while it records none, the one it
    may adopt), and the labelled machines nobody owns."""
    labelled: dict[str, list[ProviderMachine]] = {}
    for machine in machines:
        if machine.instance_id:
            labelled.setdefault(machine.instance_id, []).append(machine)
    by_instance: dict[str, ProviderMachine] = {}
    unowned: list[tuple[str, ProviderMachine]] = []
    for instance_id, found in labelled.items():
        row = live_rows.get(instance_id)
        recorded = row["provider_id"] if row is not None else ""
        owned = next((m for m in found if m.provider_id == recorded), None) if recorded else found[0]
        if row is not None and owned is not None:
            by_instance[instance_id] = owned
        unowned += [(instance_id, m) for m in found if row is None or (recorded and m is not owned)]
    return by_instance, unowned


def _delete_unowned(
    provider: Provider,
    account: ProviderAccount,
    unowned: list[tuple[str, ProviderMachine]],
    live_rows: dict[str, dict[str, Any]],
    *,
    now: datetime,
    grace: timedelta,
    report: ReconcileReport,
) -> None:
    """Cloud → database: machines nobody owns are deleted once older than the grace. A machine
    whose instance is another account's is that account's to judge: two accounts may see the
    same machines (two local accounts with one ``state_dir``, two Hetzner accounts with one
    project's token in two locations), and each would otherwise delete the other's."""
    window = [
        (instance_id, _uuid_or_none(instance_id), machine) for instance_id, machine in unowned[: BATCH * 5]
    ]
    foreign = {
        str(pk)
        for pk in MachineInstance.objects.filter(pk__in={u for _, u, _ in window if u is not None})
        .exclude(provider_account=account)
        .values_list("pk", flat=True)
    }
    for instance_id, uuid_id, machine in window:
        if len(report.orphans_deleted) >= BATCH:
            break
        if uuid_id in foreign:
            continue
        created = machine.created_at
        if created is not None and now - created < grace:
            continue  # possibly a creation still being recorded
        if created is None:
            made = MachineInstance.objects.filter(pk=instance_id).values("created_at").first()
            if made is not None and now - made["created_at"] < grace:
                continue
        try:
            provider.delete(machine.provider_id)
        except NotFound:
            pass
        except RateLimited:
            report.error = "rate limited while deleting"
            break
        except ProviderError as exc:
            log.warning("reconcile %s: delete %s failed: %s", account.name, machine.provider_id, exc.code)
            continue
        report.orphans_deleted.append(machine.provider_id)
        event_record(
            kind=EventKind.RECONCILE_ORPHAN_DELETED,
            actor=Actor.RECONCILER,
            reason="labelled machine with no live row"
            if instance_id not in live_rows
            else "a second machine for a row that records another",
            instance=_uuid_or_none(instance_id),
            provider_id=machine.provider_id,
            account=account.name,
        )


def _check_rows(
    live_rows: dict[str, dict[str, Any]],
    by_instance: dict[str, ProviderMachine],
    *,
    now: datetime,
    grace: timedelta,
    restart: bool,
    report: ReconcileReport,
) -> None:
    """Database → cloud: facts refreshed, creations adopted or failed, vanished machines lost,
    terminations finished or sent again."""
    for instance_id, row in list(live_rows.items())[: BATCH * 5]:
        at_provider = by_instance.get(instance_id)
        status = row["status"]
        if at_provider is not None and row["provider_id"] == at_provider.provider_id:
            facts = provider_facts(at_provider)
            if any(row[k] != facts[k] for k in ("provider_state", "public_ip", "private_ip")):
                # What the provider says now (not what the create answered), addresses too.
                MachineInstance.objects.filter(pk=instance_id, status__in=INSTANCE_LIVE).update(**facts)
        if status == InstanceStatus.PROVISIONING and not row["provider_id"]:
            started = row["provisioning_started_at"] or row["created_at"]
            if now - started < grace:
                continue
            if at_provider is not None:
                _adopt(instance_id, at_provider, report)
            else:
                _not_created(instance_id, report)
        elif (
            status in (InstanceStatus.WARMING, InstanceStatus.READY, InstanceStatus.CLAIMED)
            and at_provider is None
        ):
            lost = instance_mark_lost(
                instance_id=uuid.UUID(instance_id),
                actor=Actor.RECONCILER,
                reason=RESTART_LOST if restart else "the machine is gone at the provider",
                restart=restart,
            )
            if lost is not None:
                report.lost.append(instance_id)
        elif status == InstanceStatus.TERMINATING and row["provider_id"] and at_provider is None:
            # Deleted already but the task died before recording it.
            with contextlib.suppress(InvalidTransition), transaction.atomic():
                ended = INSTANCE_STATES.move(
                    uuid.UUID(instance_id),
                    to=InstanceStatus.TERMINATED,
                    from_=[InstanceStatus.TERMINATING],
                    actor=Actor.RECONCILER,
                    reason="machine already gone",
                )
                instance_gone(ended)
        elif status == InstanceStatus.TERMINATING and at_provider is not None:
            enqueue(TERMINATE_TASK, instance_id)
            report.retried_terminations.append(instance_id)


def _uuid_or_none(value: str) -> str | None:
    try:
        return str(uuid.UUID(value))
    except ValueError:
        return None


def _adopt(instance_id: str, machine: ProviderMachine, report: ReconcileReport) -> None:
    with transaction.atomic():
        updated = MachineInstance.objects.filter(
            pk=instance_id, status=InstanceStatus.PROVISIONING, provider_id=""
        ).update(provider_id=machine.provider_id, provider_state=machine.raw_state[:32])
        if not updated:
            return
        instance = MachineInstance.objects.get(pk=instance_id)
        INSTANCE_STATES.move(
            instance.pk,
            to=InstanceStatus.WARMING,
            from_=[InstanceStatus.PROVISIONING],
            actor=Actor.RECONCILER,
            reason="adopted by label after an interrupted provisioning",
            event=EventKind.POOL_MEMBER_PROVISIONED if instance.pool_id else EventKind.INSTANCE_PROVISIONED,
        )
        event_record(
            kind=EventKind.RECONCILE_ADOPTED,
            org=instance.org_id,
            pool=instance.pool_id,
            instance=instance,
            actor=Actor.RECONCILER,
            provider_id=machine.provider_id,
        )
    report.adopted.append(instance_id)


def _not_created(instance_id: str, report: ReconcileReport) -> None:
    from apps.machines.lifecycle import instance_fail

    instance_fail(
        instance_id=uuid.UUID(instance_id),
        reason="provisioning never created a machine",
        actor=Actor.RECONCILER,
    )
    event_record(kind=EventKind.RECONCILE_NOT_CREATED, instance=instance_id, actor=Actor.RECONCILER)
    report.not_created.append(instance_id)


def reconcile_all(*, grace_seconds: float | None = None) -> list[ReconcileReport]:
    """Reconcile every provider account that has or had machines."""
    accounts = ProviderAccount.objects.filter(
        Q(instances__isnull=False) | Q(machine_types__isnull=False)
    ).distinct()
    return [reconcile_account(account=a, grace_seconds=grace_seconds) for a in accounts]


RESTART_LOST = "its local machine ended with the previous `make dev`"


def reconcile_local_machines() -> list[ReconcileReport]:
    """At start (``make dev``): the local provider knows which of its machines still run, so
    rows whose machine died with the previous run become ``lost`` now, before a job is placed on
    one and waits out the heartbeat deadline. What a restart does, not a failure: their events
    say so (``restart: true``) and the dashboard's failures leave them out."""
    accounts = ProviderAccount.objects.filter(
        kind=ProviderKind.LOCAL, instances__status__in=INSTANCE_LIVE
    ).distinct()
    return [reconcile_account(account=a, restart=True) for a in accounts]


def end_local_leftovers(machines_root: Path) -> list[str]:
    """At start (``make dev``, before any worker runs): end the processes of local machines
    under ``machines_root`` (``$CATACLOUD_HOME/machines``) that no live row owns, found by their
    mark whether or not a record still names them (the rows of machines whose record says they
    are gone were marked lost by :func:`reconcile_local_machines`; their processes go now).
    Returns the instance ids ended."""
    found = machine_processes(machines_root)
    ids = set()
    for folder in found:
        with contextlib.suppress(ValueError):
            ids.add(str(uuid.UUID(Path(folder).name)))
    live = {
        str(pk)
        for pk in MachineInstance.objects.filter(pk__in=ids, status__in=INSTANCE_LIVE).values_list(
            "pk", flat=True
        )
    }
    ended = []
    for folder, processes in sorted(found.items()):
        instance_id = Path(folder).name
        if instance_id in live:
            continue  # its agent may still come back to this control plane
        config = {"state_dir": str(Path(folder).parent), "stop_timeout_seconds": 2}
        LocalProvider(config=config, credentials={}).delete(instance_id)  # its record, cgroup, uids
        end_processes(processes)  # a machine with no record left
        ended.append(instance_id)
    return ended
