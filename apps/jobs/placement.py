"""Placement: admitted jobs waiting for a machine get one, paid capacity first
(catacloud.policy.placement.ORDER): an idle machine kept for reuse (one whose image store holds
the job's image first, then the one that last ran the same configuration), then a member of a
warm pool of the org and machine type (a pool whose ``images`` hold the job's, and a member
that holds it, first); a new
machine only for the jobs that the machines already paid for cannot serve
(catacloud.policy.placement.machines_to_buy: policy ``speed`` at once, ``cost`` only when no
paid machine will be free within ``max_wait_seconds``), within ``max_instances`` and the budget;
otherwise the job waits with a ``pending_reason`` that names the limit.

What it counts comes from one view (apps.machines.selectors.paid_capacity), read without row
locks after the claims: a ready machine the claim skipped because another transaction held its
row at that instant (SKIP LOCKED hides a row, it does not make it absent) is paid capacity, not
a reason to buy; the job gets it at the next scheduling pass, which this pass enqueues."""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime, timedelta
from typing import Any

from django.db import transaction
from django.db.models import F, Window
from django.db.models.functions import RowNumber
from django.utils import timezone

from apps.core import (
    hooks,
    tracing,
)
from apps.core.actors import Actor
from apps.core.errors import InvalidTransition, PoolEmpty
from apps.core.ids import OrgId
from apps.core.locks import machine_releases_lock
from apps.events.kinds import EventKind
from apps.jobs.choices import JobStatus, Reuse
from apps.jobs.dispatch import schedule_after_commit, wake_agent
from apps.jobs.models import Job
from apps.jobs.services import JOB_STATES, job_claim_label
from apps.machines import capacity, claims
from apps.machines.budgets import budget_bought, budget_check
from apps.machines.choices import InstanceStatus, Policy, ProviderKind
from apps.machines.hosts import NoHostRoom, hosts_room, no_room_reason
from apps.machines.lifecycle import instance_request
from apps.machines.models import MachineInstance, MachineType, OrgMachineType
from apps.machines.selectors import paid_capacity
from apps.machines.services import grant_lock
from apps.pools.choices import POOL_ACTIVE
from apps.pools.models import InstancePool
from apps.pools.services import pool_claim
from apps.resources.lifecycle import release_for_job
from catacloud.agent.reference import parse
from catacloud.policy import placement


def place(
    *, limit: int = 500, grant: tuple[Any, Any] | None = None, locked: OrgMachineType | None = None
) -> tuple[int, int, int]:
    """Give waiting jobs machines (only ``grant``'s, an (org, machine type) pair, when given).
    Returns (assigned, machines requested, still waiting). ``locked``: ``grant``'s row, already
    locked by the caller's transaction (``grant_lock(with_type=True)``)."""
    assigned = requested = waiting = 0
    now = timezone.now()
    waiting_jobs = Job.objects.filter(status=JobStatus.WAITING_FOR_MACHINE)
    if grant is not None:
        waiting_jobs = waiting_jobs.filter(org_id=grant[0], machine_type_id=grant[1])
    # No savepoint of its own inside a caller's transaction (the submit's: two round trips
    # less); a failure here ends the caller's transaction or savepoint, which no caller continues.
    with transaction.atomic(savepoint=False):
        jobs = list(
            waiting_jobs.order_by("-priority", "admitted_at")
            .select_for_update(skip_locked=True, of=("self",))
            .select_related("config")[:limit]
        )
        by_key: dict[tuple, list[Job]] = defaultdict(list)
        for job in jobs:
            by_key[(job.org_id, job.machine_type_id)].append(job)
        # Lock order: the grants first (each serialises counting and buying machines of its
        # org and machine type with pool refills), all of them, in one order, before anything
        # else: a buy locks the org's budgets, which a pool refill of another of these types
        # takes after its own grant (one grant at a time, budgets between, deadlocked with it).
        # Then instances (the claims below).
        grants = {
            key: locked
            if locked is not None and key == grant
            else grant_lock(org_id=key[0], machine_type_id=key[1], with_type=True)
            for key in sorted(by_key, key=lambda key: (str(key[0]), str(key[1])))
        }
        for (org_id, mt_id), group in by_key.items():
            held = grants[(org_id, mt_id)]
            mt = held.machine_type if held is not None else MachineType.objects.get(pk=mt_id)
            pools = list(
                InstancePool.objects.filter(
                    org_id=org_id, machine_type_id=mt_id, status__in=POOL_ACTIVE
                ).values_list("pk", "images")
            )
            remaining: list[Job] = []
            for job in group:
                with tracing.span("placement", traceparent=job.traceparent, job=str(job.pk)) as span:
                    instance = _claim_for(job, mt, _image_pools_first(pools, job.image))
                    if span is not None:
                        span.set_attribute("instance", str(instance.pk) if instance else "")
                    if instance is None:
                        remaining.append(job)
                        continue
                    _assign(job, instance)
                assigned += 1
            remaining = _overflow(remaining, mt, now)
            if remaining and capacity.is_cooling(mt, now):  # the provider has none: buy none
                # The machines of it already booting serve the first jobs; the others move on.
                paid = paid_capacity(org_id=org_id, machine_type=mt)
                coming = paid.booting + paid.pool_booting
                remaining = remaining[:coming] + _fall_over(remaining[coming:], mt, now)
                waiting += len(remaining)
            elif remaining:
                requested += _provision_or_wait(held, org_id, mt, [p for p, _ in pools], remaining, now)
                waiting += len(remaining)
    return assigned, requested, waiting


def _overflow(jobs: list[Job], mt: MachineType, now: datetime) -> list[Job]:
    """Jobs whose configuration overflows (owned capacity first, the cloud for the burst) and
    that waited for a machine of ``mt`` past their bound go to its overflow machine type:
    queued again, to be admitted under that type's grant (its quotas and budgets). The others
    stay, returned."""
    staying = []
    for job in jobs:
        config = job.config
        bound = config.overflow_after_seconds
        if (
            config.overflow_machine_type_id is None
            or bound is None
            or job.machine_type_id == config.overflow_machine_type_id
            or job.admitted_at is None
            or (now - job.admitted_at).total_seconds() < bound
        ):
            staying.append(job)
            continue
        _requeue_on(
            job,
            config.overflow_machine_type_id,
            f"no machine of {mt.name} within {bound} s: overflowed to its overflow machine type",
            EventKind.JOB_OVERFLOWED,
            {"from": str(mt.pk), "to": str(config.overflow_machine_type_id), "after": bound},
        )
    return staying


def _requeue_on(job: Job, machine_type_id: Any, reason: str, event: EventKind, data: dict[str, Any]) -> None:
    """Back to the queue bound to another machine type, to be admitted under its grant (its
    quotas and budgets), the resources it held released; a scheduling pass after commit."""
    JOB_STATES.move(
        job.pk,
        to=JobStatus.QUEUED,
        from_=[JobStatus.WAITING_FOR_MACHINE],
        actor=Actor.SCHEDULER,
        reason=reason,
        event=event,
        machine_type_id=machine_type_id,
        admitted_at=None,
        pending_reason=reason[:300],
        event_data=data,
    )
    release_for_job(job_id=job.pk, reason=f"job moved to another machine type: {reason}"[:200])
    schedule_after_commit()


def _fall_over(jobs: list[Job], mt: MachineType, now: datetime) -> list[Job]:
    """``mt`` is cooling down after a provider's capacity error: each job whose configuration
    has another candidate not cooling down goes to the cheapest such (queued again, admitted
    under that type's grant: its quotas and budgets). The others stay, returned, their pending
    reason naming every candidate's cool-down."""
    staying = []
    by_config: dict[Any, list[MachineType]] = {}
    for job in jobs:
        if job.config_id not in by_config:
            by_config[job.config_id] = capacity.candidates(org_id=job.org_id, config=job.config)
        others = [c for c in by_config[job.config_id] if c.pk != mt.pk]
        to = capacity.choose(others, now)
        if to is None:
            staying.append(job)
            reason = capacity.cooling_reason([mt, *others])
            if job.pending_reason != reason:
                Job.objects.filter(pk=job.pk).update(pending_reason=reason)
            continue
        _requeue_on(
            job,
            to.pk,
            f"no capacity for {mt.name} ({mt.capacity_error}): fell over to {to.name}",
            EventKind.JOB_FELL_OVER,
            {"from": mt.name, "to": to.name, "error": mt.capacity_error},
        )
    return staying


def _image_pools_first(pools: list[tuple[Any, list[str]]], image: str) -> list[Any]:
    """The pools' ids, those whose members hold ``image`` (their ``images``) first."""
    return [pk for pk, images in sorted(pools, key=lambda p: not (image and image in (p[1] or [])))]


def job_image_key(job: Job) -> str | None:
    """What a machine's ``images`` holds when it holds this job's image: the digest its first
    attempt resolved (pinned), else the reference it names; None without an image."""
    if not job.image:
        return None
    if job.image_digest:
        return str(parse(job.image).pinned(job.image_digest))
    return job.image


def _claim_for(job: Job, mt: MachineType, pools: list[Any]) -> MachineInstance | None:
    """A paid machine for ``job``, in placement's order, or None."""
    who = job_claim_label(job.pk)
    image = job_image_key(job)
    for source in placement.ORDER:
        if source == placement.IDLE:
            _, instance = claims.claim(
                claims.IDLE_SQL,
                actor=Actor.SCHEDULER,
                by="scheduler",
                for_=who,
                job_id=job.pk,
                org=str(job.org_id),
                mt=str(mt.pk),
                version=mt.version,
                config=str(job.config_id),
                last_config=str(job.config_id),
                image=image,
            )
            if instance is not None:
                return instance
            continue
        for pool_id in pools:
            try:
                return pool_claim(
                    pool_id=pool_id,
                    acquired_by="scheduler",
                    acquired_for=who,
                    actor=Actor.SCHEDULER,
                    job_id=job.pk,
                    image=image,
                    config_id=job.config_id,
                ).instance
            except (PoolEmpty, InvalidTransition):
                continue
    return None


def _assign(job: Job, instance: MachineInstance) -> None:
    """Assigned now (its ``assigned_at`` the moment of its claim, not the pass's start)."""
    JOB_STATES.move_locked(  # placement holds the job locked (FOR UPDATE)
        job.pk,
        refs={"org": job.org_id, "job": job.pk, "instance": instance.pk},
        to=JobStatus.ASSIGNED,
        from_=[JobStatus.WAITING_FOR_MACHINE],
        actor=Actor.SCHEDULER,
        instance=instance,
        pending_reason="",
        assigned_at=timezone.now(),
        event_data={"pool": str(instance.pool_id) if instance.pool_id else None},
    )
    instance_id, job_id, traceparent = instance.pk, job.pk, job.traceparent
    if job.handoff_by:  # its integration hands it to the agent (apps.jobs.handoff)
        transaction.on_commit(lambda: hooks.job_needs_handoff(job_id=job_id))
    else:
        transaction.on_commit(lambda: wake_agent(instance_id, traceparent=traceparent))


def _provision_or_wait(
    grant: OrgMachineType | None,
    org_id: OrgId,
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
    max_wait = timedelta(seconds=grant.max_wait_seconds)
    # The grant's releases being committed finish first: a machine a job's end keeps for the
    # next job is counted below (held: the next pass gives it out), never bought again beside it.
    machine_releases_lock(org_id=org_id, machine_type_id=mt.pk, shared=False)
    paid = paid_capacity(org_id=org_id, machine_type=mt)
    supply = placement.Supply(
        total=paid.counted,
        coming=paid.booting,
        pool_coming=paid.pool_booting,
        # Every ready machine is still here after the claims above took what they could:
        # the ones left were held by another transaction at that instant.
        held=paid.idle + paid.pool_ready,
        busy=paid.busy,
        free_soon=_free_soon(grant, mt, now) if grant.policy == Policy.COST else 0,
        max_instances=grant.max_instances,
    )
    if supply.held:
        schedule_after_commit()  # the held machines are free again within milliseconds
    overdue = sum(1 for job in jobs if job.admitted_at and now - job.admitted_at >= max_wait)
    n = placement.machines_to_buy(waiting=len(jobs), overdue=overdue, supply=supply, policy=grant.policy)
    budget_reason = ""
    if n:
        # Money: buy only what the org's budgets allow (machines already paid still run jobs).
        check = budget_check(org_id=org_id, machine_type=mt, now=now, actor=Actor.SCHEDULER)
        if check.cap(n) < n:
            n = check.cap(n)
            budget_reason = check.reason_after(n)
        budget_bought(check, n, now=now, actor=Actor.SCHEDULER)
    wanted = n
    n = _request(org_id, mt, n)
    reason = placement.pending_reason(
        waiting=len(jobs),
        bought=n,
        supply=supply,
        policy=grant.policy,
        has_pool=bool(pools),
        max_wait_seconds=grant.max_wait_seconds,
    )
    if budget_reason and not (supply.on_the_way + n):
        reason = budget_reason
    elif n < wanted and not (supply.on_the_way + n):  # an enrolled host type: every host is full
        reason = no_room_reason(org_id=org_id, machine_type=mt)
    _set_reason(jobs, reason)
    return n


def _request(org_id: OrgId, mt: MachineType, n: int) -> int:
    """Request ``n`` machines; of an enrolled host type, as many as its hosts have room for (the
    slot's request decides under the hosts' locks). How many were requested."""
    if n and mt.provider_account.kind == ProviderKind.HOSTS:
        n = min(n, hosts_room(org_id=org_id, machine_type=mt))
    for done in range(n):
        try:
            instance_request(org=org_id, machine_type=mt, actor=Actor.SCHEDULER, reason="a job is waiting")
        except NoHostRoom:
            return done
    return n


def _free_soon(grant: OrgMachineType, mt: MachineType, now: datetime) -> int:
    """Busy reusable machines expected free within max_wait_seconds (pool members a job took
    too: they come back outside the pool): a machine is expected free when its job's typical
    run time (catacloud.policy.placement.typical_runtime of its configuration's latest runs)
    ends. Two queries, however many jobs run."""
    running = [
        (job["config_id"], job["started_at"] or job["assigned_at"] or now)
        for job in Job.objects.filter(
            instance__status=InstanceStatus.CLAIMED,
            instance__org_id=grant.org_id,
            instance__machine_type=mt,
            status__in=[JobStatus.ASSIGNED, JobStatus.RUNNING],
            config__reuse=Reuse.REUSE,
        ).values("config_id", "started_at", "assigned_at")
    ]
    if not running:
        return 0
    recent: dict[Any, list[float]] = defaultdict(list)
    for config_id, started, finished in (
        Job.objects.filter(
            config_id__in={config_id for config_id, _ in running},
            status=JobStatus.SUCCEEDED,
            started_at__isnull=False,
            finished_at__isnull=False,
        )
        .annotate(
            recency=Window(RowNumber(), partition_by=[F("config_id")], order_by=F("finished_at").desc())
        )
        .filter(recency__lte=placement.RECENT_RUNS)
        .values_list("config_id", "started_at", "finished_at")
    ):
        if started is not None and finished is not None:  # filtered above; the type cannot tell
            recent[config_id].append((finished - started).total_seconds())
    horizon = (now + timedelta(seconds=grant.max_wait_seconds)).timestamp()
    return placement.free_soon(
        (
            (started.timestamp(), placement.typical_runtime(recent[config_id]))
            for config_id, started in running
        ),
        horizon,
    )


def _set_reason(jobs: list[Job], reason: str) -> None:
    ids = [j.pk for j in jobs if j.pending_reason != reason]
    if ids:
        Job.objects.filter(pk__in=ids).update(pending_reason=reason)
