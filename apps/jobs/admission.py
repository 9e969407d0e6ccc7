"""Admission (like a Kueue ClusterQueue, per org machine type): a queued job is admitted only if
``max_concurrent_jobs`` and the cpu / memory / gpu quotas (and the org's money budget) hold,
counted from admitted jobs under a row lock on the grant, so several schedulers at once never
over-admit. Higher priority first, FIFO within a priority; a blocked grant never blocks
another (BestEffortFIFO)."""

from __future__ import annotations

import time
from datetime import datetime

from django.db import transaction
from django.db.models import OuterRef
from django.utils import timezone

from apps.core import tracing
from apps.core.actors import Actor
from apps.core.ids import MachineTypeId, OrgId
from apps.events.kinds import EventKind
from apps.jobs.choices import JOB_ADMITTED, JobStatus
from apps.jobs.dispatch import acquire_after_commit
from apps.jobs.models import Job, needs_resources
from apps.jobs.services import JOB_STATES
from apps.machines.budgets import budget_check
from apps.machines.choices import InstanceStatus
from apps.machines.models import MachineInstance, MachineType, OrgMachineType
from apps.machines.services import grant_lock


def _quota_reason(grant: OrgMachineType, mt: MachineType, running: int) -> str:
    if running + 1 > grant.max_concurrent_jobs:
        return f"max_concurrent_jobs {running}/{grant.max_concurrent_jobs}"
    for quota, per_job, name, unit in (
        (grant.cpu_quota, mt.cpus, "cpu quota", ""),
        (grant.memory_quota_mb, mt.memory_mb, "memory quota", " MiB"),
        (grant.gpu_quota, mt.gpus, "gpu quota", ""),
    ):
        if quota is not None and per_job and (running + 1) * per_job > quota:
            return f"{name} {running * per_job}/{quota}{unit} in use"
    return ""


def _slots(grant: OrgMachineType, mt: MachineType, running: int) -> int:
    """How many more jobs of this grant may be admitted now."""
    slots = grant.max_concurrent_jobs - running
    for quota, per_job in (
        (grant.cpu_quota, mt.cpus),
        (grant.memory_quota_mb, mt.memory_mb),
        (grant.gpu_quota, mt.gpus),
    ):
        if quota is not None and per_job:
            slots = min(slots, quota // per_job - running)
    return max(0, slots)


def _budget_slots(org_id: OrgId, mt: MachineType, slots: int, now: datetime) -> tuple[int, str]:
    """Under a money budget, admit only the jobs that machines already paid for (ready or on
    their way, not yet spoken for by admitted jobs) or machines the budget still allows can
    take; the rest stay queued with the budget's sentence. No budget: ``slots`` unchanged."""
    check = budget_check(org_id=org_id, machine_type=mt, now=now, actor=Actor.SCHEDULER)
    if check.allowed is None:
        return slots, ""
    paid_free = MachineInstance.objects.filter(
        org_id=org_id,
        machine_type=mt,
        machine_type_version=mt.version,
        status__in=[
            InstanceStatus.PENDING,
            InstanceStatus.PROVISIONING,
            InstanceStatus.WARMING,
            InstanceStatus.READY,
        ],
    ).count()
    spoken_for = Job.objects.filter(
        org_id=org_id,
        machine_type_id=mt.pk,
        status__in=[JobStatus.ACQUIRING_RESOURCES, JobStatus.WAITING_FOR_MACHINE],
    ).count()
    room = max(0, check.allowed + paid_free - spoken_for)
    if room >= slots:
        return slots, ""
    # the jobs let in now will have placement buy this many: the sentence counts them
    buying = min(check.allowed, max(0, room - max(0, paid_free - spoken_for)))
    return room, check.reason_after(buying)


def admit(*, limit: int = 1000) -> int:
    """Admit queued jobs whose quotas hold, grant by grant. Returns how many were admitted.

    Per grant: lock the grant row, count its admitted jobs, take as many queued jobs as fit
    (priority, then FIFO; SKIP LOCKED), and give the rest a pending_reason naming the limit.
    A full grant never holds back another grant's jobs.
    """
    keys = sorted(
        set(Job.objects.filter(status=JobStatus.QUEUED).values_list("org_id", "machine_type_id").distinct()),
        key=str,
    )
    total = 0
    for org_id, mt_id in keys:
        if total >= limit:
            break
        total += _admit_for(org_id, mt_id, limit - total)
    return total


def admit_grant(
    *, org_id: OrgId, machine_type_id: MachineTypeId, limit: int, locked: OrgMachineType | None = None
) -> int:
    """Admit the queued jobs of one grant that fit (in priority, then FIFO, order). ``locked``:
    the grant, already locked by the caller's transaction (``grant_lock(with_type=True)``)."""
    return _admit_for(org_id, machine_type_id, limit, locked=locked)


def _admit_for(
    org_id: OrgId, mt_id: MachineTypeId, limit: int, *, locked: OrgMachineType | None = None
) -> int:
    now = timezone.now()
    began = time.time()
    # Held jobs (apps.jobs.handoff.jobs_hold) keep their hold reason and are not admitted.
    queued = Job.objects.filter(org_id=org_id, machine_type_id=mt_id, status=JobStatus.QUEUED, hold_reason="")
    # No savepoint of its own inside a caller's transaction (two round trips less on a submit):
    # a failure here ends the caller's transaction or savepoint, which no caller continues.
    with transaction.atomic(savepoint=False):
        grant = locked or grant_lock(org_id=org_id, machine_type_id=mt_id, with_type=True)
        if grant is None:
            queued.exclude(pending_reason="machine type no longer granted").update(
                pending_reason="machine type no longer granted"
            )
            return 0
        mt = grant.machine_type
        running = Job.objects.filter(org_id=org_id, machine_type_id=mt_id, status__in=JOB_ADMITTED).count()
        slots = min(_slots(grant, mt, running), limit)
        budget_reason = ""
        if slots:
            slots, budget_reason = _budget_slots(org_id, mt, slots, now)
        jobs = (
            list(
                queued.order_by("-priority", "queued_at")
                .select_for_update(skip_locked=True)
                # whether its configuration needs resources, in the statement that locks it
                .annotate(needs_resources=needs_resources(OuterRef("config_id")))
                .values("pk", "traceparent", "needs_resources")[:slots]
            )
            if slots
            else []
        )
        if jobs:
            # The state machine's bulk move, one per target state: one UPDATE and one INSERT of
            # job.admitted events each. These rows are locked by us, so the compare-and-set
            # cannot lose (the count is checked all the same: never half a batch).
            plain = [j["pk"] for j in jobs if not j["needs_resources"]]
            needing = [j["pk"] for j in jobs if j["needs_resources"]]
            # When they were admitted: now, not when this pass began (a job submitted while the
            # pass waited for the grant's lock would read as admitted before it was queued).
            moved = timezone.now()
            for pks, to, pending in (
                (plain, JobStatus.WAITING_FOR_MACHINE, "waiting for a machine"),
                (needing, JobStatus.ACQUIRING_RESOURCES, "acquiring resources"),
            ):
                JOB_STATES.move_many(
                    pks,
                    to=to,
                    from_=[JobStatus.QUEUED],
                    refs=lambda pk: {"org": org_id, "job": pk},
                    actor=Actor.SCHEDULER,
                    event=EventKind.JOB_ADMITTED,
                    now=moved,
                    admitted_at=moved,
                    status_changed_at=moved,
                    pending_reason=pending,
                )
            if needing:
                acquire_after_commit(needing)
            for j in jobs:  # one span in each job's trace (a no-op when tracing is off)
                tracing.record("admission", traceparent=j["traceparent"], start=began, batch=len(jobs))
        reason = _quota_reason(grant, mt, running + len(jobs)) or budget_reason
        if reason:
            queued.exclude(pending_reason=reason).update(pending_reason=reason)
    return len(jobs)
