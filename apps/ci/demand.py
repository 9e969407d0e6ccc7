"""Runners out: each runner class is converged level-triggered. Its demand is its pending forge
jobs, its supply the live runners not yet given a job (and not being retired); a deficit starts
runners (Catacloud jobs: admission, quotas, budgets, placement as for any job), a surplus
retires the runners furthest from running (not yet on a machine first), so there are never more
runners than pending jobs. A job that another runner took, or that was cancelled while pending,
leaves the demand: one of ours is retired and its machine released.
"""

from __future__ import annotations

import logging
from typing import Any

from django.db import transaction
from django.utils import timezone

from apps.ci.availability import NOT_ON_A_MACHINE, hold_reason
from apps.ci.dispatch import retire_soon
from apps.ci.forge import Forge, RunnerClassId, ops_of
from apps.ci.records import converge_soon
from apps.jobs.choices import JOB_LIVE, JobStatus
from apps.jobs.handoff import awaits_handoff
from apps.jobs.models import Job
from apps.jobs.scheduler import schedule_grant_now
from apps.jobs.submission import job_cancel, job_submit

log = logging.getLogger(__name__)

# Runner jobs created in one convergence beyond this are scheduled by one pass after commit
# instead of each in its own submit.
SCHEDULE_EACH_UP_TO = 4
# At most this many runner jobs are started by one convergence (one transaction holding the
# class's lock); a larger deficit is worked off by the next one, sent at once.
MAX_STARTS = 100


def _retire_rank(runner: Any) -> tuple[int, float]:
    """Retire first what is furthest from running a job: no machine yet, then a machine but no
    registration, then registered runners (the most recent first)."""
    job = runner.job
    if job.status in NOT_ON_A_MACHINE:
        stage = 0
    elif awaits_handoff(job):
        stage = 1
    else:
        stage = 2
    return stage, -runner.created_at.timestamp()


def supply_of(forge: Forge, runner_class: Any) -> Any:
    """The class's live runners not given a job and not being retired."""
    return forge.runner.objects.filter(
        runner_class=runner_class,
        **forge.unbound(),
        retire_requested_at__isnull=True,
        job__status__in=JOB_LIVE,
    )


def class_converge(*, forge: Forge, runner_class_id: RunnerClassId) -> dict[str, int]:
    """Bring one runner class's live, unbound runners to its number of pending forge jobs."""
    now = timezone.now()
    more = False
    with transaction.atomic():
        rc = (
            forge.runner_class.objects.select_for_update(of=("self",), no_key=True)
            .select_related("org", "job_config")
            .filter(pk=runner_class_id)
            .order_by()
            .first()
        )
        if rc is None or rc.job_config is None:
            return {"started": 0, "retired": 0}
        queued = forge.ci_job.objects.filter(runner_class=rc, status=forge.statuses.demand)
        supply = supply_of(forge, rc)
        deficit = queued.count() - supply.count()
        started = retired = 0
        if deficit > 0:
            batch = min(deficit, MAX_STARTS)
            more = deficit > batch
            # the jobs no live runner was started for first (their labels name the runner job)
            todo = list(
                queued.exclude(pk__in=supply.exclude(created_for=None).values("created_for"))
                .select_related(forge.endpoint_field)
                .order_by("seen_at")[:batch]
            )
            if len(todo) < batch:  # more runners than distinct jobs to start them for: any pending one
                taken = [w.pk for w in todo]
                rest = queued.exclude(pk__in=taken).select_related(forge.endpoint_field).order_by("seen_at")
                todo += list(rest[: batch - len(todo)])
            each = batch <= SCHEDULE_EACH_UP_TO
            ops = ops_of(forge)
            for record in todo:
                endpoint = forge.endpoint_of(record)
                job = job_submit(
                    org=rc.org,
                    config=rc.job_config,
                    env=ops.runner_env(record),
                    actor=forge.actor,
                    labels=record.job_labels(),
                    handoff_by=forge.name,
                    hold_reason=hold_reason(forge, endpoint),
                    schedule_now=each,
                )
                forge.runner.objects.create(
                    job=job, org=rc.org, **forge.of_endpoint(endpoint), runner_class=rc, created_for=record
                )
                started += 1
            if not each:
                org_id, mt_id = rc.org_id, rc.machine_type_id
                transaction.on_commit(lambda: schedule_grant_now(org_id=org_id, machine_type_id=mt_id))
        elif deficit < 0:
            for runner in sorted(supply.select_related("job"), key=_retire_rank)[:-deficit]:
                if _retire_rank(runner)[0] < 2:
                    job_cancel(job=runner.job, actor=forge.actor)  # no runner registered: ends at once
                else:
                    forge.runner.objects.filter(pk=runner.pk).update(retire_requested_at=now)
                    retire_soon(forge, runner.pk)
                retired += 1
        if more:
            converge_soon(forge, rc.pk)
    if started or retired:
        log.info(
            "%s runner class %s: deficit %d, %d started, %d retired", forge, rc, deficit, started, retired
        )
    return {"started": started, "retired": retired}


def classes_converge(*, forge: Forge) -> dict[str, int]:
    """Every class with pending jobs or live unbound runners (the reaper's safety net)."""
    ids = set(
        forge.ci_job.objects.filter(status=forge.statuses.demand, runner_class__isnull=False).values_list(
            "runner_class_id", flat=True
        )
    ) | set(
        forge.runner.objects.filter(
            **forge.unbound(), retire_requested_at__isnull=True, job__status__in=JOB_LIVE
        ).values_list("runner_class_id", flat=True)
    )
    totals = {"started": 0, "retired": 0}
    for class_id in ids:
        for key, value in class_converge(forge=forge, runner_class_id=class_id).items():
            totals[key] += value
    return totals


def erase_ended_secrets(*, forge: Forge) -> int:
    """The runner secret of an ended runner job is no use to anyone: erase it."""
    return (
        Job.objects.filter(
            **{f"{forge.job_relation}__isnull": False},
            status__in=[s for s in JobStatus if s not in JOB_LIVE],
        )
        .exclude(secret_env_encrypted="")
        .update(secret_env_encrypted="")
    )
