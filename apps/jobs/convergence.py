"""The reaper's rules for jobs and the machines they hold: every live state has a deadline.

- a job assigned to or running on a machine that is gone (terminated, failed, lost): at once,
  requeued with the machine's end cause;
- a job assigned but not started by its agent within CATACLOUD_ASSIGN_TIMEOUT: requeued
  (not_started, counts as an attempt) and its machine terminated;
- a machine still claimed for a job that ended CATACLOUD_UPLOAD_TIMEOUT ago (uploads-done
  never came): released; one claimed for a job that no longer exists: terminated.
- a job running past its timeout whose agent never reported: timed out, machine terminated.

Each rule is one bounded query plus idempotent services; a repeat finds nothing to do.
"""

from __future__ import annotations

import contextlib
import uuid
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Q

from apps.core.actors import Actor
from apps.core.causes import Cause
from apps.core.errors import InvalidTransition
from apps.jobs.choices import JOB_TERMINAL, JobStatus
from apps.jobs.models import Job
from apps.jobs.reports import instance_release, job_requeue
from apps.jobs.services import JOB_STATES
from apps.machines.choices import INSTANCE_TERMINAL, InstanceStatus
from apps.machines.lifecycle import instance_terminate
from apps.machines.models import MachineInstance
from apps.resources.lifecycle import release_for_job

BATCH = 500
CLAIM_PREFIX = "job:"


def _terminate(instance_id: Any, *, reason: str, cause: Cause = Cause.MACHINE_TERMINATED) -> bool:
    """The reaper ends a job's machine; ``False`` when it is ending or gone already."""
    try:
        instance_terminate(instance_id=instance_id, actor=Actor.REAPER, reason=reason, cause=cause)
    except InvalidTransition:
        return False
    return True


def jobs_converge(*, now: datetime) -> dict[str, int]:
    return {
        "requeued_gone_machine": requeue_jobs_on_gone_machines(),
        "requeued_not_started": requeue_unstarted(now=now),
        "released_claims": release_finished_claims(now=now),
        "timed_out": jobs_time_out(now=now),
    }


def requeue_jobs_on_gone_machines() -> int:
    """A job still assigned to or running on a machine that no longer exists goes back to
    the queue with the machine's end cause (the accelerator is instance_gone; this is the
    net under it)."""

    rows = list(
        Job.objects.filter(status__in=[JobStatus.ASSIGNED, JobStatus.RUNNING])
        .filter(Q(instance__isnull=True) | Q(instance__status__in=INSTANCE_TERMINAL))
        .values_list("pk", "instance__end_cause", "instance__failure_reason")[:BATCH]
    )
    count = 0
    for job_id, cause, detail in rows:
        with transaction.atomic():
            job = (
                Job.objects.select_for_update()
                .filter(pk=job_id, status__in=[JobStatus.ASSIGNED, JobStatus.RUNNING])
                .first()
            )
            if job is None:
                continue
            job_requeue(
                job=job,
                cause=Cause.of(cause, Cause.MACHINE_LOST),
                detail=(detail or "")[:200],
                actor=Actor.REAPER,
            )
        count += 1
    return count


def requeue_unstarted(*, now: datetime) -> int:
    """Assigned but never started by the machine's agent: requeue (not_started, counts as an
    attempt) and retire the machine. A late start is refused (the job is no longer its)."""

    cutoff = now - timedelta(seconds=settings.CATACLOUD_ASSIGN_TIMEOUT)
    rows = list(
        Job.objects.filter(status=JobStatus.ASSIGNED, status_changed_at__lt=cutoff).values_list(
            "pk", "instance_id"
        )[:BATCH]
    )
    count = 0
    for job_id, instance_id in rows:
        with transaction.atomic():
            job = Job.objects.select_for_update().filter(pk=job_id, status=JobStatus.ASSIGNED).first()
            if job is None:
                continue
            job_requeue(
                job=job,
                cause=Cause.NOT_STARTED,
                detail=f"its machine did not start it within {settings.CATACLOUD_ASSIGN_TIMEOUT:.0f}s",
                actor=Actor.REAPER,
            )
            if instance_id:
                _terminate(instance_id, reason="did not start its assigned job", cause=Cause.NOT_STARTED)
        count += 1
    return count


def release_finished_claims(*, now: datetime) -> int:
    """Machines still claimed for a job that ended more than CATACLOUD_UPLOAD_TIMEOUT ago
    (uploads-done never came) are released; machines claimed for a job that no longer exists
    are terminated."""

    claims = list(
        MachineInstance.objects.filter(
            status=InstanceStatus.CLAIMED, claimed_for__startswith=CLAIM_PREFIX
        ).values_list("pk", "claimed_for")[: BATCH * 4]
    )
    by_job: dict[Any, Any] = {}
    for instance_id, claimed_for in claims:
        with contextlib.suppress(ValueError):
            by_job[uuid.UUID(claimed_for[len(CLAIM_PREFIX) :])] = instance_id
    if not by_job:
        return 0
    jobs = {j.pk: j for j in Job.objects.filter(pk__in=list(by_job)).select_related("config")}
    upload_cutoff = now - timedelta(seconds=settings.CATACLOUD_UPLOAD_TIMEOUT)
    count = 0
    for job_id, instance_id in by_job.items():
        job = jobs.get(job_id)
        if job is None:
            if _terminate(
                instance_id, reason="claimed for a job that no longer exists", cause=Cause.CLAIM_RELEASED
            ):
                count += 1
        elif job.status in JOB_TERMINAL and (job.finished_at is None or job.finished_at < upload_cutoff):
            count += instance_release(instance_id=instance_id, job=job)
    return count


def jobs_time_out(*, now: datetime) -> int:
    """The agent enforces timeouts; this catches jobs whose agent could not report."""
    grace = timedelta(seconds=max(60.0, settings.CATACLOUD_AGENT_LOST_AFTER))
    count = 0
    for job in Job.objects.filter(status=JobStatus.RUNNING, started_at__isnull=False).select_related(
        "config"
    )[:500]:
        if job.started_at is None or job.started_at + timedelta(seconds=job.timeout_seconds) + grace > now:
            continue
        with transaction.atomic():
            moved = JOB_STATES.try_move(
                job.pk,
                to=JobStatus.TIMED_OUT,
                from_=[JobStatus.RUNNING],
                actor=Actor.REAPER,
                reason="timeout passed without a report from the agent",
            )
            if moved is None:
                continue
            release_for_job(job_id=job.pk, reason="job timed out")
            if job.instance_id:
                _terminate(job.instance_id, reason="job timed out")
        count += 1
    return count
