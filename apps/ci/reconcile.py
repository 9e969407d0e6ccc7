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
- **Listing the runners costs calls, so it is done when something of ours is unaccounted for**:
  a registered runner that took no job within two intervals (or its class's online timeout,
  if shorter: is it online, idle, busy?), a runner that took its job and must be deleted (the
  forge's ``finished`` task), a runner job that ended before its runner took a job (its
  registration may be left), a registration that replaced an earlier attempt's (its machine
  lost, or its task killed while it asked: the earlier one is named by no row; the hand-off
  clears ``runners_listed_at``), or the last listing older than :data:`LIST_EVERY`.
- **Missed webhooks**: the forge's pending and running jobs are polled (by the adapter) for
  jobs we never heard of, with a backoff (the interval doubles while a poll finds nothing, up to
  20 intervals and at most 10 minutes; it resets when one finds something, when a delivery
  comes after a quiet spell of :data:`QUIET_FOR`, and when a delivery names a job we never saw
  pending: :func:`poll_soon`). Our unfinished records are looked up one by one (a bounded
  number) only on evidence that a delivery was missed (:func:`suspects`): a job our runner took
  whose runner job has ended (its end was missed), or a pending job of a class whose runner
  sits online without a job (the forge has no such pending job: it may have ended). A webhook
  lost while the endpoint is busy delays its job by at most the backoff, and by one interval once
  there is such evidence.
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
from apps.jobs.choices import JOB_LIVE, JobStatus
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
MAX_POLL_INTERVALS = 20  # the poll's backoff: at most this many intervals (and MAX_POLL_INTERVAL)
MAX_STALE_LOOKUPS = 50
LIST_EVERY = timedelta(minutes=10)  # the runners are listed at least this often
QUIET_FOR = timedelta(minutes=5)  # a delivery after this long without one resets the poll
LAST_DELIVERY_STALE = timedelta(minutes=1)  # last_delivery_at is written at most this often


def interval(forge: Forge) -> float:
    return float(getattr(settings, forge.settings.reconcile_interval))


def max_poll_interval(forge: Forge) -> float:
    return min(MAX_POLL_INTERVAL, MAX_POLL_INTERVALS * interval(forge))


def poll_soon(
    *,
    forge: Forge,
    endpoint_id: EndpointId,
    now: datetime | None = None,
    missed: bool = False,
    last_delivery_at: datetime | None = None,
) -> None:
    """A delivery came. After a quiet spell (none for :data:`QUIET_FOR`), or naming a job we never
    saw pending (``missed``: an earlier delivery was lost), the poll comes back to the base
    interval, so a burst's lost webhooks are not left to a backoff a quiet spell had stretched to
    minutes; during a busy stretch the poll keeps its backoff (each delivery would otherwise
    bring it back to the interval, and a long burst would cost a poll a job). Conditional writes:
    no-ops (no row written, none locked) unless quiet or missed, and the delivery's time written
    at most once a minute. ``last_delivery_at``: what the caller read of the endpoint (a busy
    endpoint's delivery, read within the minute, needs neither write: no query at all)."""
    now = now or timezone.now()
    if not missed and last_delivery_at is not None and last_delivery_at >= now - LAST_DELIVERY_STALE:
        return
    base = interval(forge)
    soon = now + timedelta(seconds=base)
    rows = forge.endpoint.objects.filter(pk=endpoint_id)
    reset = {
        "poll_interval_seconds": base,
        # never later than it was: a poll already due sooner (or now: NULL) keeps its time
        "next_poll_at": Least(Coalesce(F("next_poll_at"), Value(now)), Value(soon)),
    }
    quiet = Q(last_delivery_at__isnull=True) | Q(last_delivery_at__lt=now - QUIET_FOR)
    due = Q(poll_interval_seconds__gt=base) | Q(next_poll_at__gt=soon)
    if missed:
        rows.filter(due).update(**reset)
    if not rows.filter(quiet).update(last_delivery_at=now, **reset):
        rows.filter(last_delivery_at__lt=now - LAST_DELIVERY_STALE).update(last_delivery_at=now)


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
            seen: dict[int, Listed] = {}
            listing = listing_due(forge, endpoint, now)
            if listing:
                seen = ops.listed(client, endpoint)
                report["runners_listed"] = 1
            report.update(_runners(forge, ops, endpoint, client, seen, now))
            # A listing counts once what it found is done: a deletion that failed, or one left
            # for a later pass (a registration of that machine in flight, a busy runner), lists
            # again at the next reconcile.
            if listing and not report.get("runners_deferred"):
                model.objects.filter(pk=endpoint_id).update(runners_listed_at=now)
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


def listing_due(forge: Forge, endpoint: Any, now: datetime) -> bool:
    """Whether this reconcile lists the forge's runners (see the module's docstring): never
    listed, or not for :data:`LIST_EVERY`; a runner job of ours that ended since, its runner
    registered and given no job (its registration may be left); a registered runner of ours
    that took no job within two intervals (or its class's online timeout, if shorter) and is
    not a class runner's machine (whose runner's state says nothing of the machine); a runner
    that took its job and is to be deleted at the forge, while its job runs or once it ended
    (its one deletion, when the job's first report bound it, may have failed); where the forge
    removes a runner that ran its job (GitHub's just-in-time runners), a runner job that took one
    and did not succeed (a runner that crashed in it stays registered, offline)."""
    listed = endpoint.runners_listed_at
    if listed is None or listed <= now - LIST_EVERY:
        return True
    registered = forge.runner.objects.filter(
        **forge.of_endpoint(endpoint), **{f"{forge.runner_id_field}__isnull": False}
    )
    if forge.manager_field:
        registered = registered.filter(**{forge.manager_field: ""})
    # a runner job that ended since the last listing: before its runner took a job, its
    # registration may be left at the forge (an orphan); after, where runners are deleted once
    # they took their job (GitLab), that one deletion may have failed (a limit, an outage)
    ended = registered.filter(job__finished_at__gte=listed)
    if not forge.tasks.finished:  # a runner that ran its job to its end is gone (GitHub's JIT)
        ended = ended.filter(Q(**forge.unbound()) | ~Q(job__status=JobStatus.SUCCEEDED))
    if ended.exists():
        return True
    live = registered.filter(job__status__in=JOB_LIVE)
    if forge.tasks.finished and live.exclude(**forge.unbound()).exists():
        return True
    grace = 2 * interval(forge)
    waiting = live.filter(**forge.unbound(), registered_at__lt=now - timedelta(seconds=min(grace, 10.0)))
    for registered_at, online_timeout in waiting.values_list(
        "registered_at", "runner_class__online_timeout_seconds"
    ):
        if registered_at < now - timedelta(seconds=min(grace, online_timeout)):
            return True
    return False


def _runners(
    forge: Forge, ops: ForgeOps, endpoint: Any, client: Any, seen: dict[int, Listed], now: datetime
) -> dict[str, int]:
    deleted = recycled = idle = unregistered = deferred = 0
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
        # (Not for a runner job that has ended: its hand-off deletes what it made, or failed to.)
        registering = forge.runner.objects.filter(
            **forge.of_endpoint(endpoint),
            registering_instance=instance_id,
            registering_at__gt=now - REGISTERING_GRACE,
            job__status__in=JOB_LIVE,
            **{f"{forge.runner_id_field}__isnull": True},
        )
        held_now = forge.runner.objects.filter(**{forge.runner_id_field: rid}, job__status__in=JOB_LIVE)
        if listed.busy or registering.exists() or held_now.exists():
            deferred += 1  # the next reconcile lists again (not the 10-minute listing)
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
        "runners_deferred": deferred,
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
    found, listed, covered = ops.poll(forge, client, endpoint)
    looked = 0
    for record in suspects(forge, endpoint, now, covered)[: MAX_STALE_LOOKUPS * 2]:
        if ops.key_of(record) in listed or looked >= MAX_STALE_LOOKUPS:
            continue
        looked += 1
        found += ops.look_up(forge, client, record).found
    base = interval(forge)
    current = endpoint.poll_interval_seconds or base
    next_interval = base if found else min(max_poll_interval(forge), current * 2)
    forge.endpoint.objects.filter(pk=endpoint.pk).update(
        poll_interval_seconds=next_interval, next_poll_at=now + timedelta(seconds=next_interval)
    )
    return {"missed_jobs_found": found, "jobs_looked_up": looked}


def suspects(forge: Forge, endpoint: Any, now: datetime, covered: Any) -> Any:
    """Our unfinished records whose status we may have missed, oldest first: each look-up is a
    call, so only those with evidence (see the module's docstring). Records the poll would have
    listed (``covered``; the caller skips those it did list); started jobs our runner took whose
    runner job ended more than an interval ago (their end was missed); and pending jobs of a
    class one of whose runners has been online for two intervals without a job (the forge hands
    a pending job to an idle runner that may run it: if it gives none, a job we count as pending
    may have ended or been taken)."""
    base = timedelta(seconds=interval(forge))
    rules = forge.statuses
    records = forge.ci_job.objects.filter(
        **forge.of_endpoint(endpoint), status__in=rules.unfinished, status_changed_at__lt=now - base
    )
    ended = forge.runner.objects.filter(
        **forge.of_endpoint(endpoint), **{f"{forge.bound_field}__isnull": False}
    ).exclude(job__status__in=JOB_LIVE)
    idle = forge.runner.objects.filter(
        **forge.of_endpoint(endpoint),
        **forge.unbound(),
        job__status__in=JOB_LIVE,
        retire_requested_at__isnull=True,
        online_at__lt=now - 2 * base,
    )
    return records.filter(
        covered
        | Q(status__in=rules.started, pk__in=ended.values(forge.bound_field))
        | Q(status__in=rules.pending, runner_class_id__in=idle.values("runner_class_id"))
    ).order_by("status_changed_at")
