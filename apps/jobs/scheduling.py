"""Jobs: submission, admission within quotas, placement, release, requeue, retention.

Admission (like a Kueue ClusterQueue, per org machine type): a queued job is admitted only if
``max_concurrent_jobs`` and the cpu / memory / gpu quotas hold, counted from admitted jobs
under a row lock on the grant, so several schedulers at once never over-admit. Higher
priority first, FIFO within a priority; a blocked grant never blocks another (BestEffortFIFO).

Placement, in order: a warm pool of the org and machine type; an idle machine kept for reuse
(the one that last ran the same configuration first); a new machine if ``max_instances``
allows (policy ``speed`` at once, ``cost`` only when no paid machine will be free within
``max_wait_seconds``); otherwise wait with a ``pending_reason`` that names the limit.
"""

from __future__ import annotations

import contextlib
import logging
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Count, Q
from django.utils import timezone

from apps.core.broker import enqueue_on_commit
from apps.core.errors import Conflict, InvalidTransition, MissingPrivilege, NotFound, PoolEmpty
from apps.events.models import Event
from apps.events.services import event_record
from apps.jobs.choices import JOB_ADMITTED, JOB_LIVE, JOB_TERMINAL, JobStatus, Reuse
from apps.jobs.models import Job, JobConfiguration
from apps.jobs.services import job_claim_label, job_transition
from apps.machines import claims
from apps.machines.budgets import budget_bought, budget_check
from apps.machines.choices import INSTANCE_COUNTED, INSTANCE_TERMINAL, InstanceStatus, Policy
from apps.machines.lifecycle import instance_request, instance_terminate
from apps.machines.models import MachineInstance, MachineType, OrgMachineType
from apps.machines.services import grant_check_privilege, grant_lock, instance_transition
from apps.orgs.models import Organization
from apps.pools.choices import POOL_ACTIVE
from apps.pools.models import InstancePool
from apps.pools.services import pool_claim
from catacloud.policy import placement
from catacloud.policy.billing import Billing
from catacloud.policy.retention import should_retire

log = logging.getLogger(__name__)
J = JobStatus
S = InstanceStatus


# ---- submit and cancel ------------------------------------------------------------------------


def job_submit(
    *,
    org: Organization,
    config: JobConfiguration,
    env: dict[str, str] | None = None,
    user: Any = None,
    actor: str = "",
) -> Job:
    """Queue a run of ``config``. Privileges are checked now (403 missing_privilege)."""
    from apps.jobs.services import _check_env

    if config.org_id != org.pk:
        raise NotFound("job configuration not found")
    grant_check_privilege(org=org, machine_type=config.machine_type)
    for rt in config.resource_types.all():
        if not org.has_privilege(rt.required_privilege):
            raise MissingPrivilege(f"resource type {rt.id} requires privilege {rt.required_privilege}")
    if not OrgMachineType.objects.filter(org=org, machine_type=config.machine_type_id).exists():
        raise Conflict(
            "this configuration's machine type is no longer granted to the organization",
            code="machine_type_not_granted",
        )
    merged = {**config.env, **_check_env(env or {})}
    with transaction.atomic():
        job = Job.objects.create(
            org=org,
            config=config,
            machine_type_id=config.machine_type_id,
            command=config.command,
            env=merged,
            priority=config.priority,
            timeout_seconds=config.timeout_seconds,
            max_attempts=config.max_attempts,
            submitted_by=user if getattr(user, "pk", None) else None,
        )
        event_record(
            kind="job.queued", org=org, job=job, actor=actor, config=config.name, priority=job.priority
        )
        _schedule_after_commit()
    return job


def job_cancel(*, job: Job, actor: str = "") -> Job:
    """Cancel in any live state: before a machine it ends at once (releasing what it holds);
    on a machine the agent kills the command and reports ``cancelled`` within seconds."""
    with transaction.atomic():
        locked = Job.objects.select_for_update().get(pk=job.pk)
        if locked.status not in JOB_LIVE:
            raise InvalidTransition("Job", job.pk, locked.status, "cancelled")
        machine_gone = locked.instance_id is None or (
            MachineInstance.objects.filter(pk=locked.instance_id, status__in=INSTANCE_TERMINAL).exists()
        )
        if locked.status in (J.ASSIGNED, J.RUNNING) and not machine_gone:
            # The agent kills the command and reports; if the machine goes away first, the
            # requeue that follows sees cancel_requested and ends the job cancelled.
            Job.objects.filter(pk=job.pk).update(cancel_requested=True)
            event_record(
                kind="job.cancel_requested",
                org=locked.org_id,
                job=job,
                actor=actor,
                instance=locked.instance_id,
            )
            instance_id = locked.instance_id
            transaction.on_commit(lambda: wake_agent(instance_id))
        else:
            job_transition(job_id=job.pk, to=J.CANCELLED, actor=actor, reason="cancelled before it ran")
            _release_resources(locked, reason="job cancelled")
            _schedule_after_commit()
    return Job.objects.get(pk=job.pk)


# ---- admission --------------------------------------------------------------------------------


@dataclass
class ScheduleReport:
    admitted: int = 0
    assigned: int = 0
    provisioned: int = 0
    waiting: int = 0


def schedule(*, limit: int = 500) -> ScheduleReport:
    report = ScheduleReport()
    report.admitted = admit(limit=limit)
    assigned, provisioned, waiting = place(limit=limit)
    report.assigned, report.provisioned, report.waiting = assigned, provisioned, waiting
    return report


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


def _budget_slots(org_id: Any, mt: MachineType, slots: int, now: datetime) -> tuple[int, str]:
    """Under a money budget, admit only the jobs that machines already paid for (ready or on
    their way, not yet spoken for by admitted jobs) or machines the budget still allows can
    take; the rest stay queued with the budget's sentence. No budget: ``slots`` unchanged."""
    check = budget_check(org_id=org_id, machine_type=mt, now=now, actor="scheduler")
    if check.allowed is None:
        return slots, ""
    paid_free = MachineInstance.objects.filter(
        org_id=org_id,
        machine_type=mt,
        machine_type_version=mt.version,
        status__in=[S.PENDING, S.PROVISIONING, S.WARMING, S.READY],
    ).count()
    spoken_for = Job.objects.filter(
        org_id=org_id, machine_type_id=mt.pk, status__in=[J.ACQUIRING_RESOURCES, J.WAITING_FOR_MACHINE]
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
        set(Job.objects.filter(status=J.QUEUED).values_list("org_id", "machine_type_id").distinct()), key=str
    )
    total = 0
    for org_id, mt_id in keys:
        if total >= limit:
            break
        total += _admit_for(org_id, mt_id, limit - total)
    return total


def _admit_for(org_id: Any, mt_id: Any, limit: int) -> int:
    now = timezone.now()
    queued = Job.objects.filter(org_id=org_id, machine_type_id=mt_id, status=J.QUEUED)
    with transaction.atomic():
        grant = grant_lock(org_id=org_id, machine_type_id=mt_id)
        if grant is None:
            queued.exclude(pending_reason="machine type no longer granted").update(
                pending_reason="machine type no longer granted"
            )
            return 0
        mt = MachineType.objects.get(pk=mt_id)
        running = Job.objects.filter(org_id=org_id, machine_type_id=mt_id, status__in=JOB_ADMITTED).count()
        slots = min(_slots(grant, mt, running), limit)
        budget_reason = ""
        if slots:
            slots, budget_reason = _budget_slots(org_id, mt, slots, now)
        jobs = (
            list(
                queued.order_by("-priority", "queued_at")
                .select_for_update(skip_locked=True)
                .values("pk", "config_id")[:slots]
            )
            if slots
            else []
        )
        if jobs:
            with_resources = set(
                JobConfiguration.resource_types.through.objects.filter(
                    jobconfiguration_id__in={j["config_id"] for j in jobs}
                ).values_list("jobconfiguration_id", flat=True)
            )
            # One UPDATE per target state and one INSERT for the batch: these rows are locked
            # by us, so the compare-and-set cannot lose (the count is checked all the same).
            plain = [j["pk"] for j in jobs if j["config_id"] not in with_resources]
            needing = [j["pk"] for j in jobs if j["config_id"] in with_resources]
            updated = Job.objects.filter(pk__in=plain, status=J.QUEUED).update(
                status=J.WAITING_FOR_MACHINE,
                admitted_at=now,
                status_changed_at=now,
                pending_reason="waiting for a machine",
            )
            updated += Job.objects.filter(pk__in=needing, status=J.QUEUED).update(
                status=J.ACQUIRING_RESOURCES,
                admitted_at=now,
                status_changed_at=now,
                pending_reason="acquiring resources",
            )
            assert updated == len(jobs), "admission lost a compare-and-set on rows it had locked"
            Event.objects.bulk_create(
                Event(
                    kind="job.admitted",
                    org_id=org_id,
                    job_id=pk,
                    actor="scheduler",
                    data={"status": J.ACQUIRING_RESOURCES if pk in needing else J.WAITING_FOR_MACHINE},
                )
                for pk in plain + needing
            )
            if needing:
                _acquire_resources_after_commit(needing)
        reason = _quota_reason(grant, mt, running + len(jobs)) or budget_reason
        if reason:
            queued.exclude(pending_reason=reason).update(pending_reason=reason)
    return len(jobs)


# ---- placement --------------------------------------------------------------------------------


def place(*, limit: int = 500) -> tuple[int, int, int]:
    """Give waiting jobs machines. Returns (assigned, machines requested, still waiting)."""
    assigned = requested = waiting = 0
    now = timezone.now()
    with transaction.atomic():
        jobs = list(
            Job.objects.filter(status=J.WAITING_FOR_MACHINE)
            .order_by("-priority", "admitted_at")
            .select_for_update(skip_locked=True, of=("self",))
            .select_related("config")[:limit]
        )
        by_key: dict[tuple, list[Job]] = defaultdict(list)
        for job in jobs:
            by_key[(job.org_id, job.machine_type_id)].append(job)
        for (org_id, mt_id), group in by_key.items():
            # Lock order: the grant first (it serialises counting and buying machines of this
            # org and machine type with pool refills), then instances (the claims below).
            grant = grant_lock(org_id=org_id, machine_type_id=mt_id)
            mt = MachineType.objects.get(pk=mt_id)
            pools = list(
                InstancePool.objects.filter(
                    org_id=org_id, machine_type_id=mt_id, status__in=POOL_ACTIVE
                ).values_list("pk", flat=True)
            )
            remaining: list[Job] = []
            for job in group:
                instance = _claim_for(job, mt, pools)
                if instance is None:
                    remaining.append(job)
                    continue
                _assign(job, instance, now)
                assigned += 1
            if remaining:
                requested += _provision_or_wait(grant, org_id, mt, pools, remaining, now)
                waiting += len(remaining)
    return assigned, requested, waiting


def _claim_for(job: Job, mt: MachineType, pools: list[Any]) -> MachineInstance | None:
    who = job_claim_label(job.pk)
    for pool_id in pools:
        try:
            return pool_claim(
                pool_id=pool_id, acquired_by="scheduler", acquired_for=who, actor="scheduler", job_id=job.pk
            ).instance
        except (PoolEmpty, InvalidTransition):
            continue
    _, instance = claims.claim(
        claims.IDLE_SQL,
        actor="scheduler",
        by="scheduler",
        for_=who,
        job_id=job.pk,
        org=str(job.org_id),
        mt=str(mt.pk),
        version=mt.version,
        config=str(job.config_id),
    )
    return instance


def _assign(job: Job, instance: MachineInstance, now: datetime) -> None:
    job_transition(
        job_id=job.pk,
        to=J.ASSIGNED,
        from_=[J.WAITING_FOR_MACHINE],
        actor="scheduler",
        instance=instance,
        pending_reason="",
        assigned_at=now,
        event_data={"pool": str(instance.pool_id) if instance.pool_id else None},
    )
    MachineInstance.objects.filter(pk=instance.pk).update(last_config=job.config_id)
    from apps.jobs.metrics import observe_wait

    observe_wait(job, now)
    instance_id = instance.pk
    transaction.on_commit(lambda: wake_agent(instance_id))


def _provision_or_wait(
    grant: OrgMachineType | None,
    org_id: Any,
    mt: MachineType,
    pools: list[Any],
    jobs: list[Job],
    now: datetime,
) -> int:
    """Buy machines for waiting jobs within max_instances. The caller holds the grant's row
    lock, so the count below cannot race another placement or a pool refill."""
    if grant is None:
        _set_reason(jobs, "machine type no longer granted")
        return 0
    live = MachineInstance.objects.filter(org_id=org_id, machine_type=mt, status__in=INSTANCE_COUNTED)
    counts = live.aggregate(
        # Every machine that costs money counts, terminating ones too (they still bill).
        total=Count("id"),
        coming=Count("id", filter=Q(pool__isnull=True, status__in=[S.PENDING, S.PROVISIONING, S.WARMING])),
        busy=Count("id", filter=Q(pool__isnull=True, status=S.CLAIMED)),
    )
    max_wait = timedelta(seconds=grant.max_wait_seconds)
    supply = placement.Supply(
        total=counts["total"],
        coming=counts["coming"],
        busy=counts["busy"],
        free_soon=_free_soon(grant, mt, now) if grant.policy == Policy.COST else 0,
        max_instances=grant.max_instances,
    )
    overdue = sum(1 for job in jobs if job.admitted_at and now - job.admitted_at >= max_wait)
    n = placement.machines_to_buy(waiting=len(jobs), overdue=overdue, supply=supply, policy=grant.policy)
    budget_reason = ""
    if n:
        # Money: buy only what the org's budgets allow (machines already paid still run jobs).
        check = budget_check(org_id=org_id, machine_type=mt, now=now, actor="scheduler")
        if check.cap(n) < n:
            n = check.cap(n)
            budget_reason = check.reason_after(n)
        budget_bought(check, n, now=now, actor="scheduler")
    for _ in range(n):
        instance_request(org=org_id, machine_type=mt, actor="scheduler", reason="a job is waiting")
    reason = placement.pending_reason(
        waiting=len(jobs),
        bought=n,
        supply=supply,
        policy=grant.policy,
        has_pool=bool(pools),
        max_wait_seconds=grant.max_wait_seconds,
    )
    if budget_reason and not (supply.coming + n):
        reason = budget_reason
    _set_reason(jobs, reason)
    return n


def _free_soon(grant: OrgMachineType, mt: MachineType, now: datetime) -> int:
    """Busy reusable machines expected free within max_wait_seconds: a machine is expected
    free when its job's typical run time (median of recent runs of its configuration) ends."""
    horizon = now + timedelta(seconds=grant.max_wait_seconds)
    soon = 0
    for running in Job.objects.filter(
        instance__pool__isnull=True,
        instance__status=S.CLAIMED,
        instance__org_id=grant.org_id,
        instance__machine_type=mt,
        status__in=[J.ASSIGNED, J.RUNNING],
    ).select_related("config"):
        if running.config.reuse != Reuse.REUSE:
            continue
        expected = (running.started_at or running.assigned_at or now) + _typical_runtime(running.config_id)
        if expected <= horizon:
            soon += 1
    return soon


def _typical_runtime(config_id: Any) -> timedelta:
    recent = list(
        Job.objects.filter(config_id=config_id, status=J.SUCCEEDED, started_at__isnull=False)
        .order_by("-finished_at")
        .values_list("started_at", "finished_at")[:20]
    )
    if not recent:
        return timedelta(hours=1)  # unknown: assume it will not be free soon
    durations = sorted(f - s for s, f in recent)
    return durations[len(durations) // 2]


def _set_reason(jobs: list[Job], reason: str) -> None:
    ids = [j.pk for j in jobs if j.pending_reason != reason]
    if ids:
        Job.objects.filter(pk__in=ids).update(pending_reason=reason)


# ---- the agent's side of a job ----------------------------------------------------------------


def job_started(*, instance: MachineInstance, job_id: Any) -> Job:
    """The agent starts the command. The job must still be assigned to this very machine: a
    job is never run by two machines at once, even when a lost agent comes back."""
    try:
        return job_transition(
            job_id=job_id,
            to=J.RUNNING,
            from_=[J.ASSIGNED],
            actor=f"agent:{instance.pk}",
            where={"instance": instance},
        )
    except InvalidTransition:
        raise Conflict(
            "this job is not (or no longer) assigned to this machine", code="not_assigned"
        ) from None


OUTCOMES = {"succeeded": J.SUCCEEDED, "failed": J.FAILED, "timed_out": J.TIMED_OUT, "cancelled": J.CANCELLED}


def job_finished(
    *,
    instance: MachineInstance,
    job_id: Any,
    outcome: str,
    exit_code: int | None,
    reason: str = "",
    uploads_pending: int | None = None,
) -> Job:
    """The agent reports the end of a job; the machine is kept for reuse or destroyed.

    With ``uploads_pending`` (agents that upload outputs) the machine stays held for the job
    until the agent's ``uploads-done``: the job's status is final at once, its outputs follow.
    A repeated report changes nothing and answers the status already recorded. A job that
    did not succeed on a machine being taken away (terminated, drained) was stopped, not
    failed: it goes back to the queue with the machine's cause.
    """
    with transaction.atomic():
        job = (
            Job.objects.select_for_update(of=("self",))
            .select_related("config")
            .filter(pk=job_id, instance=instance)
            .first()
        )
        if job is not None and job.status in JOB_TERMINAL:
            return job  # a retried report: already recorded
        if job is None or job.status not in (J.ASSIGNED, J.RUNNING):
            raise Conflict("this job is not (or no longer) running on this machine", code="not_assigned")
        status = J.CANCELLED if job.cancel_requested else OUTCOMES[outcome]
        if status == J.SUCCEEDED and exit_code not in (0, None):
            status = J.FAILED
        machine = MachineInstance.objects.filter(pk=instance.pk).values("status", "end_cause").first()
        stopped = status not in (J.SUCCEEDED, J.CANCELLED) or (
            status == J.CANCELLED and not job.cancel_requested
        )
        if stopped and machine and machine["status"] != S.CLAIMED:
            return job_requeue(
                job=job,
                cause=machine["end_cause"] or "machine_terminated",
                detail=reason,
                actor=f"agent:{instance.pk}",
            )
        job = job_transition(
            job_id=job.pk,
            to=status,
            actor=f"agent:{instance.pk}",
            reason=reason,
            exit_code=exit_code,
            failure_reason=reason if status != J.SUCCEEDED else "",
            pending_reason="",
            event_data={"exit_code": exit_code, "attempt": job.attempt},
        )
        _release_resources(job, reason=f"job {status}")
        if uploads_pending is None:
            instance_release(instance_id=instance.pk, job=job)
        _schedule_after_commit()
    return job


def instance_release(*, instance_id: Any, job: Job) -> bool:
    """After a job: keep the machine for the next job (reuse, current version) or destroy it.

    Acts only on the claim that belongs to ``job`` (a late or repeated report about an older
    job never releases a machine another job holds now); returns whether it acted."""
    with transaction.atomic():
        instance = (
            MachineInstance.objects.select_for_update(of=("self",))
            .select_related("machine_type")
            .filter(pk=instance_id)
            .first()
        )
        if (
            instance is None
            or instance.status != S.CLAIMED
            or instance.claimed_for != job_claim_label(job.pk)
        ):
            return False
        reuse = (
            job.config.reuse == Reuse.REUSE and instance.machine_type_version == instance.machine_type.version
        )
        if reuse:
            instance_transition(
                instance_id=instance_id,
                to=S.READY,
                from_=[S.CLAIMED],
                actor="scheduler",
                reason="kept for reuse while its paid period lasts",
                event="instance.released",
                pool=None,
                claim_id=None,
                claimed_by="",
                claimed_for="",
                lease_expires_at=None,
                last_config=job.config_id,
            )
        else:
            instance_terminate(
                instance_id=instance_id,
                actor="scheduler",
                reason="ephemeral job finished"
                if job.config.reuse == Reuse.EPHEMERAL
                else "outdated machine type version",
                cause="job_finished",
            )
    return True


# Requeues the operator caused: they do not use up the job's max_attempts.
FREE_REQUEUE_CAUSES = frozenset({"machine_terminated", "pool_drained"})


def job_requeue(*, job: Job, cause: str, actor: str, detail: str = "") -> Job:
    """Back to ``queued`` with ``attempt + 1`` and ``requeue_reason = cause`` (machine_lost,
    machine_terminated, pool_drained, not_started, spot_interruption). Requeues the operator
    caused (terminate, drain) are free; the others count against ``max_attempts``, and when
    none is left the job fails with the reason. A cancel requested meanwhile wins."""
    reason = f"{cause}: {detail}" if detail else cause
    free = cause in FREE_REQUEUE_CAUSES
    used = job.attempt - job.free_requeues
    if job.cancel_requested:
        job = job_transition(job_id=job.pk, to=J.CANCELLED, actor=actor, reason=f"cancelled; {reason}")
    elif not free and used >= job.max_attempts:
        job = job_transition(
            job_id=job.pk,
            to=J.FAILED,
            actor=actor,
            reason=f"{reason}; no attempts left ({used}/{job.max_attempts})",
            failure_reason=f"{reason} (attempt {used} of {job.max_attempts})",
            requeue_reason=cause[:32],
        )
    else:
        job = job_transition(
            job_id=job.pk,
            to=J.QUEUED,
            actor=actor,
            reason=reason,
            event="job.requeued",
            attempt=job.attempt + 1,
            free_requeues=job.free_requeues + (1 if free else 0),
            requeue_reason=cause[:32],
            instance=None,
            pending_reason=f"requeued ({reason})"[:300],
            admitted_at=None,
            assigned_at=None,
            started_at=None,
            queued_at=job.queued_at,
            event_data={"attempt": job.attempt + 1, "cause": cause, "counts": not free},
        )
    _release_resources(job, reason="job requeued")
    _schedule_after_commit()
    return job


def jobs_requeue_for_instance(*, instance: MachineInstance, cause: str, detail: str = "") -> int:
    """Requeue the jobs still assigned to or running on ``instance`` (its machine is gone)."""
    count = 0
    with transaction.atomic():
        for job in Job.objects.select_for_update().filter(
            instance_id=instance.pk, status__in=[J.ASSIGNED, J.RUNNING]
        ):
            job_requeue(job=job, cause=cause, detail=detail, actor="reaper")
            count += 1
    return count


def job_interrupted(*, instance: MachineInstance, detail: str) -> None:
    """The agent saw a spot interruption notice: requeue its job now and retire the machine."""
    with transaction.atomic():
        for job in Job.objects.select_for_update().filter(
            instance=instance, status__in=[J.ASSIGNED, J.RUNNING]
        ):
            job_requeue(job=job, cause="spot_interruption", detail=detail[:200], actor=f"agent:{instance.pk}")
        event_record(
            kind="instance.interrupted",
            org=instance.org_id,
            instance=instance,
            actor=f"agent:{instance.pk}",
            reason=detail[:500],
        )
        with contextlib.suppress(InvalidTransition):
            instance_terminate(
                instance_id=instance.pk,
                actor=f"agent:{instance.pk}",
                reason="spot interruption",
                cause="spot_interruption",
            )


# ---- safety net (the reaper's periodic pass) ----------------------------------------------------


def scheduler_safety_net(*, now: datetime) -> dict[str, int]:
    from apps.jobs.convergence import jobs_converge
    from apps.resources.acquisition import resources_safety_net

    converged = jobs_converge(now=now)
    timed_out = _time_out_jobs(now)
    retired = retire_idle_machines(now=now)
    resources = resources_safety_net(now=now)
    from apps.jobs.artifacts import artifacts_expire

    expired = artifacts_expire(now=now)
    report = schedule()
    return {
        "timed_out": timed_out,
        "retired_idle": retired,
        "admitted": report.admitted,
        "assigned": report.assigned,
        "artifacts_expired": expired,
        **converged,
        **resources,
    }


def _time_out_jobs(now: datetime) -> int:
    """The agent enforces timeouts; this catches jobs whose agent could not report."""
    grace = timedelta(seconds=max(60.0, settings.CATACLOUD_AGENT_LOST_AFTER))
    count = 0
    for job in Job.objects.filter(status=J.RUNNING, started_at__isnull=False).select_related("config")[:500]:
        if job.started_at + timedelta(seconds=job.timeout_seconds) + grace > now:
            continue
        with transaction.atomic():
            try:
                job_transition(
                    job_id=job.pk,
                    to=J.TIMED_OUT,
                    from_=[J.RUNNING],
                    actor="reaper",
                    reason="timeout passed without a report from the agent",
                )
            except InvalidTransition:
                continue
            _release_resources(job, reason="job timed out")
            if job.instance_id:
                with contextlib.suppress(InvalidTransition):
                    instance_terminate(instance_id=job.instance_id, actor="reaper", reason="job timed out")
        count += 1
    return count


def retire_idle_machines(*, now: datetime) -> int:
    """Billing-aware retention: an idle machine kept for reuse lives until just before its
    current paid period ends (every started hour on Hetzner; per second after a 60 s minimum
    on EC2), then it is destroyed. The margin covers the time between reaper ticks."""
    margin = settings.CATACLOUD_RETENTION_MARGIN
    count = 0
    idle = MachineInstance.objects.filter(pool__isnull=True, status=S.READY).select_related("machine_type")[
        :1000
    ]
    for instance in idle:
        mt = instance.machine_type
        started = instance.provisioning_started_at or instance.created_at
        runtime = (now - started).total_seconds()
        billing = Billing(mt.billing_increment_seconds, mt.min_billed_seconds, mt.price_per_hour)
        outdated = instance.machine_type_version < mt.version
        if not outdated and not should_retire(
            billing=billing, runtime_seconds=runtime, margin_seconds=margin
        ):
            continue
        left = billing.seconds_left_in_paid_period(runtime)
        try:
            instance_terminate(
                instance_id=instance.pk,
                actor="reaper",
                reason="outdated machine type version"
                if outdated
                else f"idle at the end of its paid period ({left:.0f}s left)",
            )
        except InvalidTransition:
            continue
        count += 1
    return count


# ---- plumbing -----------------------------------------------------------------------------------


def wake_agent(instance_id: Any) -> None:
    """Tell a long-polling agent to look again (a message, never state: the DB is the truth)."""
    from apps.jobs.agent import wake

    wake(instance_id)


def _schedule_after_commit() -> None:
    from apps.jobs.tasks import schedule_task

    enqueue_on_commit(schedule_task)


def _acquire_resources_after_commit(job_ids: list[Any]) -> None:
    from apps.resources.acquisition import acquire_after_commit

    acquire_after_commit(job_ids)


def _release_resources(job: Job, *, reason: str) -> None:
    from apps.resources.acquisition import release_for_job

    release_for_job(job_id=job.pk, reason=reason)
