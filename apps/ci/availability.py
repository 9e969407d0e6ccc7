"""Whether a forge answers an endpoint (a GitHub installation, a GitLab connection): while it
does not (an outage, a rate limit, our budget used up), the endpoint's runner jobs that have no
machine yet are held in the queue (apps.jobs.handoff.jobs_hold), so nothing is claimed or bought
for them; the first successful call (or the reconciler's probe once the pause is over) releases
them."""

from __future__ import annotations

import contextlib
import logging
from datetime import UTC, datetime, timedelta
from typing import Any

from celery import current_app
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from apps.ci.errors import ForgeRateLimited
from apps.ci.forge import EndpointId, Forge
from apps.core.broker import enqueue
from apps.events.services import event_record
from apps.jobs.choices import JobStatus
from apps.jobs.handoff import jobs_hold, jobs_unhold

log = logging.getLogger(__name__)

NOT_ON_A_MACHINE = [JobStatus.QUEUED, JobStatus.ACQUIRING_RESOURCES, JobStatus.WAITING_FOR_MACHINE]
UNAVAILABLE_BACKOFF = (15.0, 300.0)  # first and longest pause after the forge failed us


LIMIT_WORDS = ("rate limit", "budget", "limit", "cap")


def is_limit(reason: str) -> bool:
    """Whether a pause's reason is a limit (the forge's, or our pacing below it), not an outage."""
    return any(word in reason.lower() for word in LIMIT_WORDS)


def limit_reason(forge: Forge, reason: str, until: datetime | None) -> str:
    """A runner job's pending reason while a limit holds it: which limit, and until when."""
    when = f" until {until.astimezone(UTC):%H:%M:%S} UTC" if until else ""
    return f"waiting for {forge.title}'s limit{when}: {reason}"[:300]


def hold_reason(forge: Forge, endpoint: Any) -> str:
    """The pending reason of a runner job held because the forge is unavailable, limits us, or
    our pacing below its limits holds registrations ('' if none does)."""
    if not endpoint.is_available():
        reason = endpoint.unavailable_reason
        if is_limit(reason):
            return limit_reason(forge, reason, endpoint.unavailable_until)
        return f"{forge.title} unavailable: {reason}"[:300]
    if endpoint.is_paced():
        return limit_reason(forge, endpoint.paced_reason, endpoint.paced_until)
    return ""


def unavailable_backoff(failures: int) -> float:
    first, longest = UNAVAILABLE_BACKOFF
    return float(min(longest, first * 2 ** max(0, failures - 1)))


def endpoint_unavailable(
    *, forge: Forge, endpoint_id: EndpointId, reason: str, seconds: float | None = None
) -> None:
    now = timezone.now()
    model = forge.endpoint
    with transaction.atomic():
        row = model.objects.select_for_update(no_key=True).filter(pk=endpoint_id).first()
        if row is None:
            return
        was_available = row.is_available(now)
        failures = row.failures + 1
        wait = seconds if seconds is not None else unavailable_backoff(failures)
        until = now + timedelta(seconds=wait)
        if row.unavailable_until is not None and row.unavailable_until > until:
            until = row.unavailable_until
        model.objects.filter(pk=row.pk).update(
            failures=failures, unavailable_until=until, unavailable_reason=reason[:300]
        )
        if was_available:
            log.warning("%s unavailable for %s for %.0fs: %s", forge.title, row, wait, reason)
            event_record(
                kind=forge.events.unavailable,
                org=row.org_id,
                actor=forge.actor,
                reason=reason[:500],
                **row.event_ref(),
                until=until.isoformat(),
            )
        held = forge.runner.objects.filter(
            **forge.of_endpoint(row), job__status__in=NOT_ON_A_MACHINE
        ).values_list("job_id", flat=True)
        why = (
            limit_reason(forge, reason, until) if is_limit(reason) else f"{forge.title} unavailable: {reason}"
        )
        jobs_hold(job_ids=list(held), reason=why, actor=forge.actor)
    _probe_at(forge, row.pk, (until - now).total_seconds())


def endpoint_available(*, forge: Forge, endpoint_id: EndpointId) -> None:
    model = forge.endpoint
    with transaction.atomic():
        row = model.objects.select_for_update(no_key=True).filter(pk=endpoint_id).first()
        if row is None or (not row.failures and row.unavailable_until is None):
            return
        model.objects.filter(pk=row.pk).update(failures=0, unavailable_until=None, unavailable_reason="")
        if row.unavailable_until is not None:
            event_record(kind=forge.events.available, org=row.org_id, actor=forge.actor, **row.event_ref())
        held = (
            forge.runner.objects.filter(**forge.of_endpoint(row), job__status=JobStatus.QUEUED)
            .filter(Q(held_until__isnull=True) | Q(held_until__lte=timezone.now()))
            .values_list("job_id", flat=True)
        )
        jobs_unhold(job_ids=list(held))


def _probe_at(forge: Forge, endpoint_pk: EndpointId, seconds: float) -> None:
    """Ask for a reconcile (which probes the forge) when the pause ends: a message that only
    makes it sooner (the reaper's tick finds the endpoint too)."""

    def send() -> None:
        with contextlib.suppress(Exception):
            current_app.send_task(
                forge.tasks.reconcile, args=(str(endpoint_pk),), countdown=max(0.5, seconds), retry=False
            )

    transaction.on_commit(send)


def endpoint_limited(*, forge: Forge, endpoint_id: EndpointId, limited: ForgeRateLimited, call: str) -> None:
    """Record a limit answer (``<forge>.rate_limited``: which call, the wait, whether secondary)."""
    org_id = forge.endpoint.objects.filter(pk=endpoint_id).values_list("org_id", flat=True).first()
    if org_id is None:
        return
    with transaction.atomic():
        event_record(
            kind=forge.events.rate_limited,
            org=org_id,
            actor=forge.actor,
            reason=limited.detail[:500],
            call=call[:200],
            status=limited.status,
            secondary=limited.secondary,
            wait_seconds=round(limited.retry_after, 1),
        )


def endpoint_paced(*, forge: Forge, endpoint_id: EndpointId, reason: str, seconds: float) -> None:
    """Runner registrations wait ``seconds`` for a window of our pacing (below a documented limit)
    to turn: the endpoint's runner jobs not on a machine are held until then, every other call
    goes on. Recorded (``<forge>.rate_limited``, paced) when it begins."""
    now = timezone.now()
    until = now + timedelta(seconds=seconds)
    model = forge.endpoint
    with transaction.atomic():
        row = model.objects.select_for_update(no_key=True).filter(pk=endpoint_id).first()
        if row is None:
            return
        began = not row.is_paced(now)
        if row.paced_until is not None and row.paced_until > until:
            until = row.paced_until
        model.objects.filter(pk=row.pk).update(paced_until=until, paced_reason=reason[:300])
        if began:
            event_record(
                kind=forge.events.rate_limited,
                org=row.org_id,
                actor=forge.actor,
                reason=reason[:500],
                paced=True,
                until=until.isoformat(),
                **row.event_ref(),
            )
        held = forge.runner.objects.filter(**forge.of_endpoint(row), job__status__in=NOT_ON_A_MACHINE)
        held.update(held_until=until)
        release_when_over(forge, until)
        jobs_hold(
            job_ids=list(held.values_list("job_id", flat=True)),
            reason=limit_reason(forge, reason, until),
            actor=forge.actor,
        )


# The task that releases a forge's held runner jobs when their wait is over (apps.ci.tasks), and
# the longest wait it is sent for: a longer one (an hourly window) is left to the reaper's tick,
# a message held that long being delivered again past the broker's visibility timeout.
HELD_RELEASE_TASK = "apps.ci.tasks.held_release_task"
RELEASE_AT_MOST = 300.0
RELEASE_MARGIN = 0.2  # after the wait: held_until <= now holds when it runs


def release_when_over(forge: Forge, until: datetime) -> None:
    """Once this transaction commits, send the release of the forge's held runner jobs for the
    moment their wait is over (``until``), so admission takes them then, not at the reaper's
    next tick (a minute later by default); the reaper still releases any whose message was lost."""
    seconds = (until - timezone.now()).total_seconds() + RELEASE_MARGIN
    if 0 < seconds <= RELEASE_AT_MOST:
        transaction.on_commit(lambda: enqueue(HELD_RELEASE_TASK, forge.name, countdown=seconds))


def held_release(*, forge: Forge, now: datetime) -> int:
    """Runner jobs held by a limit whose wait is over: released (admission takes them again; a
    registration still over its window holds them again, for the window's rest)."""
    due = forge.runner.objects.filter(held_until__lte=now, job__status=JobStatus.QUEUED)
    ids = list(due.values_list("job_id", flat=True)[:500])
    if not ids:
        return 0
    forge.runner.objects.filter(job_id__in=ids).update(held_until=None)
    return jobs_unhold(job_ids=ids)
