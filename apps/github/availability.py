"""Whether GitHub answers an installation: while it does not (an outage, a rate limit, our
budget used up), the installation's runner jobs that have no machine yet are held in the
queue (apps.jobs.handoff.jobs_hold), so nothing is claimed or bought for them; the first
successful call (or the reconciler's probe once the pause is over) releases them."""

from __future__ import annotations

import contextlib
import logging
from datetime import timedelta

from celery import current_app
from django.db import transaction
from django.utils import timezone

from apps.core.actors import Actor
from apps.core.ids import GitHubInstallationId
from apps.events.kinds import EventKind
from apps.events.services import event_record
from apps.github.messages import RECONCILE_TASK
from apps.github.models import GitHubInstallation, Runner
from apps.jobs.choices import JobStatus
from apps.jobs.handoff import jobs_hold, jobs_unhold

log = logging.getLogger(__name__)

NOT_ON_A_MACHINE = [JobStatus.QUEUED, JobStatus.ACQUIRING_RESOURCES, JobStatus.WAITING_FOR_MACHINE]


def hold_reason(installation: GitHubInstallation) -> str:
    """The pending reason of a runner job held because GitHub is unavailable ('' if it is not)."""
    if installation.is_available():
        return ""
    return f"GitHub unavailable: {installation.unavailable_reason}"[:300]


UNAVAILABLE_BACKOFF = (15.0, 300.0)  # first and longest pause after GitHub failed us


def unavailable_backoff(failures: int) -> float:
    first, longest = UNAVAILABLE_BACKOFF
    return float(min(longest, first * 2 ** max(0, failures - 1)))


def installation_unavailable(
    *, installation_id: GitHubInstallationId, reason: str, seconds: float | None = None
) -> None:
    now = timezone.now()
    with transaction.atomic():
        inst = GitHubInstallation.objects.select_for_update(no_key=True).filter(pk=installation_id).first()
        if inst is None:
            return
        was_available = inst.is_available(now)
        failures = inst.failures + 1
        wait = seconds if seconds is not None else unavailable_backoff(failures)
        until = now + timedelta(seconds=wait)
        if inst.unavailable_until is not None and inst.unavailable_until > until:
            until = inst.unavailable_until
        GitHubInstallation.objects.filter(pk=inst.pk).update(
            failures=failures, unavailable_until=until, unavailable_reason=reason[:300]
        )
        if was_available:
            log.warning("GitHub unavailable for %s for %.0fs: %s", inst, wait, reason)
            event_record(
                kind=EventKind.GITHUB_UNAVAILABLE,
                org=inst.org_id,
                actor=Actor.GITHUB,
                reason=reason[:500],
                installation=inst.installation_id,
                until=until.isoformat(),
            )
        held = Runner.objects.filter(installation=inst, job__status__in=NOT_ON_A_MACHINE).values_list(
            "job_id", flat=True
        )
        jobs_hold(job_ids=list(held), reason=f"GitHub unavailable: {reason}", actor=Actor.GITHUB)
    _probe_at(inst.pk, (until - now).total_seconds())


def installation_available(*, installation_id: GitHubInstallationId) -> None:
    with transaction.atomic():
        inst = GitHubInstallation.objects.select_for_update(no_key=True).filter(pk=installation_id).first()
        if inst is None or (not inst.failures and inst.unavailable_until is None):
            return
        GitHubInstallation.objects.filter(pk=inst.pk).update(
            failures=0, unavailable_until=None, unavailable_reason=""
        )
        if inst.unavailable_until is not None:
            event_record(
                kind=EventKind.GITHUB_AVAILABLE,
                org=inst.org_id,
                actor=Actor.GITHUB,
                installation=inst.installation_id,
            )
        held = Runner.objects.filter(installation=inst, job__status=JobStatus.QUEUED).values_list(
            "job_id", flat=True
        )
        jobs_unhold(job_ids=list(held))


def _probe_at(installation_pk: GitHubInstallationId, seconds: float) -> None:
    """Ask for a reconcile (which probes GitHub) when the pause ends: a message that only
    makes it sooner (the reaper's tick finds the installation too)."""

    def send() -> None:
        with contextlib.suppress(Exception):
            current_app.send_task(
                RECONCILE_TASK, args=(str(installation_pk),), countdown=max(0.5, seconds), retry=False
            )

    transaction.on_commit(send)
