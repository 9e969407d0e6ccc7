"""Whether a forge answers an endpoint (a GitHub installation, a GitLab connection): while it
does not (an outage, a rate limit, our budget used up), the endpoint's runner jobs that have no
machine yet are held in the queue (apps.jobs.handoff.jobs_hold), so nothing is claimed or bought
for them; the first successful call (or the reconciler's probe once the pause is over) releases
them."""

from __future__ import annotations

import contextlib
import logging
from datetime import timedelta
from typing import Any

from celery import current_app
from django.db import transaction
from django.utils import timezone

from apps.ci.forge import EndpointId, Forge
from apps.events.services import event_record
from apps.jobs.choices import JobStatus
from apps.jobs.handoff import jobs_hold, jobs_unhold

log = logging.getLogger(__name__)

NOT_ON_A_MACHINE = [JobStatus.QUEUED, JobStatus.ACQUIRING_RESOURCES, JobStatus.WAITING_FOR_MACHINE]
UNAVAILABLE_BACKOFF = (15.0, 300.0)  # first and longest pause after the forge failed us


def hold_reason(forge: Forge, endpoint: Any) -> str:
    """The pending reason of a runner job held because the forge is unavailable ('' if it is not)."""
    if endpoint.is_available():
        return ""
    return f"{forge.title} unavailable: {endpoint.unavailable_reason}"[:300]


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
        jobs_hold(job_ids=list(held), reason=f"{forge.title} unavailable: {reason}", actor=forge.actor)
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
        held = forge.runner.objects.filter(
            **forge.of_endpoint(row), job__status=JobStatus.QUEUED
        ).values_list("job_id", flat=True)
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
