"""The reaper's rules for jobs and the machines they hold: every live state has a deadline.

- a job assigned to or running on a machine that is gone (terminated, failed, lost): at once,
  requeued with the machine's end cause;
- a job assigned but not started by its agent within CATACLOUD_ASSIGN_TIMEOUT: requeued
  (not_started, counts as an attempt) and its machine terminated;
- a machine still claimed for a job that ended CATACLOUD_UPLOAD_TIMEOUT ago (uploads-done
  never came): released; one claimed for a job that no longer exists: terminated.
(Running past its timeout is scheduling._time_out_jobs.)

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

from apps.core.errors import InvalidTransition
from apps.jobs.choices import JOB_TERMINAL, JobStatus
from apps.jobs.models import Job
from apps.machines.choices import INSTANCE_TERMINAL, InstanceStatus
from apps.machines.lifecycle import instance_terminate
from apps.machines.models import MachineInstance

J = JobStatus
S = InstanceStatus
BATCH = 500
CLAIM_PREFIX = "job:"


def jobs_converge(*, now: datetime) -> dict[str, int]:
    return {
        "requeued_gone_machine": requeue_jobs_on_gone_machines(),
        "requeued_not_started": requeue_unstarted(now=now),
        "released_claims": release_finished_claims(now=now),
    }


def requeue_jobs_on_gone_machines() -> int:
    """A job still assigned to or running on a machine that no longer exists goes back to
    the queue with the machine's end cause (the accelerator is instance_gone; this is the
    net under it)."""
    from apps.jobs.scheduling import job_requeue

    rows = list(
        Job.objects.filter(status__in=[J.ASSIGNED, J.RUNNING])
        .filter(Q(instance__isnull=True) | Q(instance__status__in=INSTANCE_TERMINAL))
        .values_list("pk", "instance__end_cause", "instance__failure_reason")[:BATCH]
    )
    count = 0
    for job_id, cause, detail in rows:
        with transaction.atomic():
            job = (
                Job.objects.select_for_update().filter(pk=job_id, status__in=[J.ASSIGNED, J.RUNNING]).first()
            )
            if job is None:
                continue
            job_requeue(job=job, cause=cause or "machine_lost", detail=(detail or "")[:200], actor="reaper")
        count += 1
    return count


def requeue_unstarted(*, now: datetime) -> int:
    """Assigned but never started by the machine's agent: requeue (not_started, counts as an
    attempt) and retire the machine. A late start is refused (the job is no longer its)."""
    from apps.jobs.scheduling import job_requeue

    cutoff = now - timedelta(seconds=settings.CATACLOUD_ASSIGN_TIMEOUT)
    rows = list(
        Job.objects.filter(status=J.ASSIGNED, status_changed_at__lt=cutoff).values_list("pk", "instance_id")[
            :BATCH
        ]
    )
    count = 0
    for job_id, instance_id in rows:
        with transaction.atomic():
            job = Job.objects.select_for_update().filter(pk=job_id, status=J.ASSIGNED).first()
            if job is None:
                continue
            job_requeue(
                job=job,
                cause="not_started",
                detail=f"its machine did not start it within {settings.CATACLOUD_ASSIGN_TIMEOUT:.0f}s",
                actor="reaper",
            )
            if instance_id:
                with contextlib.suppress(InvalidTransition):
                    instance_terminate(
                        instance_id=instance_id,
                        actor="reaper",
                        reason="did not start its assigned job",
                        cause="not_started",
                    )
        count += 1
    return count


def release_finished_claims(*, now: datetime) -> int:
    """Machines still claimed for a job that ended more than CATACLOUD_UPLOAD_TIMEOUT ago
    (uploads-done never came) are released; machines claimed for a job that no longer exists
    are terminated."""
    from apps.jobs.scheduling import instance_release

    claims = list(
        MachineInstance.objects.filter(status=S.CLAIMED, claimed_for__startswith=CLAIM_PREFIX).values_list(
            "pk", "claimed_for"
        )[: BATCH * 4]
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
            with contextlib.suppress(InvalidTransition):
                instance_terminate(
                    instance_id=instance_id,
                    actor="reaper",
                    reason="claimed for a job that no longer exists",
                    cause="claim_released",
                )
                count += 1
        elif job.status in JOB_TERMINAL and (job.finished_at is None or job.finished_at < upload_cutoff):
            count += instance_release(instance_id=instance_id, job=job)
    return count
