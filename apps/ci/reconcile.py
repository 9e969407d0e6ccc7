"""The reconciler, per endpoint, every ``CATACLOUD_<FORGE>_RECONCILE_INTERVAL`` seconds (30 by
default; sent by the reaper's tick): the forge's view compared with ours, both ways.

- **Runners**: a runner named ``catacloud-<instance>`` (an instance of this database) that no
  live runner job holds (its machine or job is gone) is deleted, unless it is busy or its
  registration is in flight; one that took its job and is still registered (its deletion's
  message or call lost) is deleted, where the forge deletes runners once they have their job
  (GitLab: ``Forge.tasks.finished``); a handed-off runner that has not come online within its class's
  ``online_timeout_seconds`` has its machine recycled (terminated: the job is requeued on
  another machine); a runner online and idle past ``idle_timeout_seconds`` is retired (deleted
  at the forge, its job cancelled, its machine released).
- **Missed webhooks**: the forge's pending and running jobs are polled (by the adapter) for
  jobs we never heard of or whose status we missed, then our unfinished records the poll did not
  list are looked up one by one (a bounded number), with a backoff (the interval doubles, up to
  10 minutes, while a poll finds nothing; it resets when one finds something, and when a
  delivery comes: :func:`poll_soon`). A webhook lost while the endpoint is busy delays its job
  by at most one interval; one lost after a quiet spell, by at most the backoff.
"""

from __future__ import annotations

import contextlib
import logging
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import F, Q, Value
from django.db.models.functions import Coalesce, Least
from django.utils import timezone

from apps.ci.choices import Handoff
from apps.ci.dispatch import instance_of, retire_soon, runner_unregister
from apps.ci.errors import ForgeError
from apps.ci.forge import EndpointId, Forge, ForgeOps, Listed, ops_of
from apps.core.broker import enqueue
from apps.core.causes import Cause
from apps.core.errors import InvalidTransition
from apps.events.services import event_record
from apps.jobs.choices import JOB_LIVE
from apps.machines.lifecycle import instance_terminate
from apps.machines.models import MachineInstance

log = logging.getLogger(__name__)
# A reconcile that died (its worker killed) keeps its endpoint's claim at most CLAIM_FOR; a live
# one renews it before each forge call, at most every CLAIM_RENEW (one call, its retries
# included, takes well under CLAIM_FOR - CLAIM_RENEW), so two never run at once. A reconcile
# that finds its claim taken (it was slower than that) stops.
CLAIM_FOR = timedelta(seconds=60)
CLAIM_RENEW = timedelta(seconds=10)
REGISTERING_GRACE = timedelta(minutes=2)
MAX_POLL_INTERVAL = 600.0
MAX_STALE_LOOKUPS = 50


def interval(forge: Forge) -> float:
    return float(getattr(settings, forge.settings.reconcile_interval))


def poll_soon(*, forge: Forge, endpoint_id: EndpointId, now: datetime | None = None) -> None:
    """A delivery came: the endpoint is busy, so a webhook lost now (the forge gave up on our
    answer, or its own redelivery list has moved on) is found at the base interval, not at the
    end of a backoff a quiet spell had stretched to minutes. One conditional write: a no-op
    while the poll already runs at the base interval."""
    now = now or timezone.now()
    base = interval(forge)
    soon = now + timedelta(seconds=base)
    # never later than it was: a poll already due sooner (or now: NULL) keeps its time
    forge.endpoint.objects.filter(pk=endpoint_id).filter(
        Q(poll_interval_seconds__gt=base) | Q(next_poll_at__gt=soon)
    ).update(
        poll_interval_seconds=base,
        next_poll_at=Least(Coalesce(F("next_poll_at"), Value(now)), Value(soon)),
    )


def reconciles_due(*, forge: Forge, now: datetime) -> int:
    """Send a reconcile for every endpoint whose last one is older than the interval."""
    due = forge.endpoint.objects.filter(
        Q(reconciled_at__isnull=True) | Q(reconciled_at__lt=now - timedelta(seconds=interval(forge)))
    ).values_list("pk", flat=True)
    sent = 0
    for pk in due:
        sent += enqueue(forge.tasks.reconcile, str(pk))
    return sent


def endpoint_reconcile(
    *, forge: Forge, endpoint_id: EndpointId, now: datetime | None = None
) -> dict[str, int]:
    """One reconcile of one endpoint (skipped while another holds it)."""
    now = now or timezone.now()
    model = forge.endpoint
    claimed = (
        model.objects.filter(pk=endpoint_id)
        .filter(Q(reconcile_claimed_at__isnull=True) | Q(reconcile_claimed_at__lt=now - CLAIM_FOR))
        .update(reconcile_claimed_at=now)
    )
    if not claimed:
        return {"skipped": 1}
    claim = _Claim(model, endpoint_id, now)
    report: dict[str, int] = {}
    try:
        endpoint = model.objects.select_related(*forge.endpoint_related).get(pk=endpoint_id)
        ops = ops_of(forge)
        client = ops.client(endpoint)
        client.before_call = claim.renew
        try:
            seen = ops.listed(client, endpoint)
            report.update(_runners(forge, ops, endpoint, client, seen, now))
            if endpoint.next_poll_at is None or endpoint.next_poll_at <= now:
                report.update(_poll(forge, ops, endpoint, client, now))
            report.update(ops.reconcile_extra(forge, client, endpoint, now))
        except ForgeError as exc:  # recorded by the client (availability); the next tick retries
            log.info("reconcile of %s stopped: %s", endpoint, exc.detail)
            report[f"{forge.name}_errors"] = 1
        model.objects.filter(pk=endpoint_id).update(reconciled_at=timezone.now())
    except ClaimLost:
        log.warning("reconcile of %s stopped: its claim lapsed and another took it", endpoint_id)
        report["claim_lost"] = 1
    finally:
        claim.release()
    return report


class ClaimLost(Exception):
    """The reconcile's claim lapsed and another reconcile holds the endpoint now."""


class _Claim:
    """An endpoint's reconcile claim, renewed while the reconcile runs; only while it is still
    ours (the value we wrote) is it renewed or released."""

    def __init__(self, model: Any, endpoint_id: EndpointId, at: datetime) -> None:
        self.model, self.endpoint_id, self.at = model, endpoint_id, at

    def _ours(self) -> Any:
        return self.model.objects.filter(pk=self.endpoint_id, reconcile_claimed_at=self.at)

    def renew(self) -> None:
        now = timezone.now()
        if now - self.at >= CLAIM_RENEW:
            if not self._ours().update(reconcile_claimed_at=now):
                raise ClaimLost(str(self.endpoint_id))
            self.at = now

    def release(self) -> None:
        self._ours().update(reconcile_claimed_at=None)


def _runners(
    forge: Forge, ops: ForgeOps, endpoint: Any, client: Any, seen: dict[int, Listed], now: datetime
) -> dict[str, int]:
    deleted = recycled = idle = unregistered = 0
    rows, live = _live(forge, endpoint)
    ours = {rid: listed for rid, listed in seen.items() if instance_of(listed.name)}
    known = set(
        str(pk)
        for pk in MachineInstance.objects.filter(
            pk__in=[instance_of(listed.name) for listed in ours.values()]
        ).values_list("pk", flat=True)
    )
    for rid, listed in ours.items():
        instance_id = instance_of(listed.name)
        if instance_id not in known:
            continue  # another Catacloud installation's machine: not ours to touch
        runner = live.get(rid)
        if runner is not None:
            if runner.online_at is None and (listed.online or listed.busy):
                forge.runner.objects.filter(pk=runner.pk).update(online_at=now)
                runner.online_at = now
            if forge.bound_id_of(runner) and forge.tasks.finished:
                unregistered += runner_unregister(forge=forge, job_id=runner.job_id) == Handoff.UNREGISTERED
            continue
        # A registration of this machine asked for lately may be this very runner, its id not
        # recorded yet (in flight), or recorded since ``live`` was read: left for a later pass.
        registering = forge.runner.objects.filter(
            **forge.of_endpoint(endpoint),
            registering_instance=instance_id,
            registering_at__gt=now - REGISTERING_GRACE,
            **{f"{forge.runner_id_field}__isnull": True},
        )
        held_now = forge.runner.objects.filter(**{forge.runner_id_field: rid}, job__status__in=JOB_LIVE)
        if listed.busy or registering.exists() or held_now.exists():
            continue
        if ops.delete_listed(client, listed):
            deleted += 1
            with transaction.atomic():
                event_record(
                    kind=forge.events.runner_deleted,
                    org=endpoint.org_id,
                    instance=instance_id,
                    actor=forge.reconciler_actor,
                    runner=listed.name,
                    runner_id=rid,
                    reason="no live runner job holds it (its machine or job is gone)",
                )
    for runner in rows:
        rid = forge.runner_id_of(runner) or 0
        if forge.bound_id_of(runner) or runner.job.instance_id is None or runner.registered_at is None:
            continue
        rc = runner.runner_class
        listed_now = seen.get(rid)
        if runner.online_at is None:
            if runner.registered_at < now - timedelta(seconds=rc.online_timeout_seconds):
                recycled += _recycle(forge, runner)
        elif (
            not (listed_now is not None and listed_now.busy)
            and runner.retire_requested_at is None
            and runner.online_at < now - timedelta(seconds=rc.idle_timeout_seconds)
        ):
            forge.runner.objects.filter(pk=runner.pk).update(retire_requested_at=now)
            retire_soon(forge, runner.pk)
            idle += 1
    return {
        "runners_deleted": deleted,
        "runners_recycled": recycled,
        "runners_idle_retired": idle,
        "runners_with_their_job_deleted": unregistered,
    }


def _live(forge: Forge, endpoint: Any) -> tuple[list[Any], dict[int | None, Any]]:
    """The endpoint's live registered runners, and those of them the forge's runner id names
    alone (a class runner's machines share its id, GitLab's class runner mode: not matched)."""
    rows = list(
        forge.runner.objects.filter(
            **forge.of_endpoint(endpoint),
            job__status__in=JOB_LIVE,
            **{f"{forge.runner_id_field}__isnull": False},
        ).select_related("job", "runner_class")
    )
    shared = forge.manager_field
    return rows, {forge.runner_id_of(r): r for r in rows if not (shared and getattr(r, shared))}


def _recycle(forge: Forge, runner: Any) -> int:
    """A runner that never came online: its machine is terminated (the job is requeued on
    another one; the registration left behind is deleted by a later pass)."""
    instance_id = runner.job.instance_id
    with transaction.atomic():
        event_record(
            kind=forge.events.runner_recycled,
            org=runner.org_id,
            job=runner.job_id,
            instance=instance_id,
            actor=forge.reconciler_actor,
            runner=runner.name,
            reason=f"not online {runner.runner_class.online_timeout_seconds}s after its handoff",
        )
        if instance_id is None:  # no machine to terminate
            return 0
        with contextlib.suppress(InvalidTransition):
            instance_terminate(
                instance_id=instance_id,
                actor=forge.reconciler_actor,
                reason=f"its {forge.title} runner never came online",
                cause=Cause.RUNNER_OFFLINE,
            )
            return 1
    return 0


def _poll(forge: Forge, ops: ForgeOps, endpoint: Any, client: Any, now: datetime) -> dict[str, int]:
    """Jobs we missed: the forge's pending and running jobs, then our unfinished records the
    forge no longer lists as such (looked up one by one, a bounded number)."""
    found, listed = ops.poll(forge, client, endpoint)
    stale = forge.ci_job.objects.filter(
        **forge.of_endpoint(endpoint),
        status__in=forge.statuses.unfinished,
        status_changed_at__lt=now - timedelta(seconds=interval(forge)),
    ).order_by("status_changed_at")
    looked = 0
    for record in stale[: MAX_STALE_LOOKUPS * 2]:
        if ops.key_of(record) in listed or looked >= MAX_STALE_LOOKUPS:
            continue
        looked += 1
        found += ops.look_up(forge, client, record).found
    base = interval(forge)
    current = endpoint.poll_interval_seconds or base
    next_interval = base if found else min(MAX_POLL_INTERVAL, current * 2)
    forge.endpoint.objects.filter(pk=endpoint.pk).update(
        poll_interval_seconds=next_interval, next_poll_at=now + timedelta(seconds=next_interval)
    )
    return {"missed_jobs_found": found, "jobs_looked_up": looked}
