"""Workflow jobs in, runners out.

GitHub gives a runner *any* queued job whose labels it has: a runner cannot be bound to the job
that made us start it. So each runner class is converged level-triggered: its demand is its
queued workflow jobs, its supply the live runners not yet given a job (and not being retired);
a deficit starts runners (Catacloud jobs: admission, quotas, budgets, placement as for any
job), a surplus retires the runners furthest from running (not yet on a machine first), so
there are never more runners than queued jobs. A job that another runner took, or that was
cancelled while queued, leaves the demand: one of ours is retired and its machine released.

:func:`workflow_job_apply` moves a workflow job record forward only (a duplicate or an older
delivery changes nothing) and binds it to the runner of ours that took it (``runner_name``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from django.db import IntegrityError, transaction
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from apps.core.actors import Actor
from apps.core.broker import enqueue_on_commit
from apps.core.ids import RunnerClassId
from apps.events.kinds import EventKind
from apps.events.services import event_record
from apps.github.availability import NOT_ON_A_MACHINE, hold_reason
from apps.github.choices import STATUS_RANK, WORKFLOW_JOB_PENDING, Applied, WorkflowJobStatus
from apps.github.dispatch import retire_soon
from apps.github.messages import CONVERGE_TASK
from apps.github.models import GitHubInstallation, Runner, RunnerClass, WorkflowJob
from apps.github.services import match_class
from apps.jobs.choices import JOB_LIVE, JobStatus
from apps.jobs.handoff import awaits_handoff
from apps.jobs.models import Job
from apps.jobs.scheduler import schedule_grant_now
from apps.jobs.submission import job_cancel, job_submit

log = logging.getLogger(__name__)

# GitHub's REST statuses that mean "not started yet" (the poll may see these).
_PENDING_ALIASES = {"requested": WorkflowJobStatus.QUEUED, "pending": WorkflowJobStatus.QUEUED}


def _status(value: Any) -> str | None:
    value = _PENDING_ALIASES.get(str(value), str(value))
    return value if value in WorkflowJobStatus.values else None


def _when(value: Any) -> datetime | None:
    return parse_datetime(value) if isinstance(value, str) else None


def workflow_job_apply(
    *,
    installation: GitHubInstallation,
    job: Mapping[str, Any],
    status: str | None,
    repository: str,
    source: str,
) -> tuple[WorkflowJob | None, Applied]:
    """Record what GitHub says about one workflow job (a ``workflow_job`` delivery's
    ``workflow_job``, or a job the reconciler polled). Returns (record, outcome); the record is
    None for a job no runner class of the org covers (it is meant for other runners)."""
    status = _status(status or job.get("status"))
    if status is None:
        return None, Applied.UNKNOWN_STATUS
    try:
        github_id, run_attempt, run_id = int(job["id"]), int(job.get("run_attempt") or 1), int(job["run_id"])
    except (KeyError, TypeError, ValueError):
        return None, Applied.NOT_A_WORKFLOW_JOB
    labels = [str(label) for label in job.get("labels") or []]
    with transaction.atomic():
        record = (
            WorkflowJob.objects.select_for_update(no_key=True)
            .filter(installation=installation, github_id=github_id, run_attempt=run_attempt)
            .first()
        )
        if record is None:
            runner_class = match_class(RunnerClass.objects.filter(org_id=installation.org_id), labels)
            if runner_class is None:
                return None, Applied.NOT_COVERED
            try:
                with transaction.atomic():
                    record = WorkflowJob.objects.create(
                        installation=installation,
                        org_id=installation.org_id,
                        runner_class=runner_class,
                        github_id=github_id,
                        run_attempt=run_attempt,
                        run_id=run_id,
                        repository=repository[:200],
                        workflow=str(job.get("workflow_name") or "")[:300],
                        name=str(job.get("name") or "")[:300],
                        labels=labels,
                        status=status,
                    )
            except IntegrityError:  # a concurrent delivery created it: apply on top of it
                record = WorkflowJob.objects.select_for_update(no_key=True).get(
                    installation=installation, github_id=github_id, run_attempt=run_attempt
                )
            else:
                event_record(
                    kind=EventKind.GITHUB_JOB_QUEUED,
                    org=installation.org_id,
                    actor=Actor.github(source),
                    repository=record.repository,
                    workflow=record.workflow,
                    job_name=record.name,
                    github_job=github_id,
                    run_attempt=run_attempt,
                    runner_class=runner_class.name,
                    status=status,
                )
                _moved(record, status, job, source, created=True)
                return record, Applied.CREATED
        old, new = STATUS_RANK[record.status], STATUS_RANK[status]  # type: ignore[index]
        lateral = old == new and record.status in WORKFLOW_JOB_PENDING and status != record.status
        if new < old or (new == old and not lateral):
            return record, Applied.STALE  # a duplicate, or older than what we know: never back
        record.status = status
        _moved(record, status, job, source, created=False)
        return record, Applied.MOVED


def _moved(record: WorkflowJob, status: str, job: Mapping[str, Any], source: str, *, created: bool) -> None:
    """Write the record's new state, bind our runner, record the event, converge its class.
    Inside the record's transaction."""
    now = timezone.now()
    fields: dict[str, Any] = {"status": status, "status_changed_at": now}
    runner_name = str(job.get("runner_name") or "")
    if status in (WorkflowJobStatus.IN_PROGRESS, WorkflowJobStatus.COMPLETED):
        fields["runner_name"] = runner_name[:200]
        fields["started_at"] = _when(job.get("started_at")) or record.started_at or now
    if status == WorkflowJobStatus.COMPLETED:
        fields["conclusion"] = str(job.get("conclusion") or "")[:32]
        fields["completed_at"] = _when(job.get("completed_at")) or now
    ours = _bind(record, runner_name, job.get("runner_id")) if runner_name else None
    if ours is not None:
        fields["job"] = ours.job_id
    WorkflowJob.objects.filter(pk=record.pk).update(**fields)
    if not created and status != WorkflowJobStatus.WAITING:
        kind = {
            WorkflowJobStatus.QUEUED: EventKind.GITHUB_JOB_QUEUED,
            WorkflowJobStatus.IN_PROGRESS: EventKind.GITHUB_JOB_STARTED,
            WorkflowJobStatus.COMPLETED: EventKind.GITHUB_JOB_COMPLETED,
        }[WorkflowJobStatus(status)]
        event_record(
            kind=kind,
            org=record.org_id,
            job=ours.job_id if ours else None,
            actor=Actor.github(source),
            repository=record.repository,
            workflow=record.workflow,
            job_name=record.name,
            github_job=record.github_id,
            run_attempt=record.run_attempt,
            runner=runner_name or None,
            ours=ours is not None,
            conclusion=fields.get("conclusion") or None,
        )
    if record.runner_class_id:
        converge_soon(record.runner_class_id)


def _bind(record: WorkflowJob, runner_name: str, runner_id: object) -> Runner | None:  # GitHub's id
    """Our runner that took this job is no longer supply, and its Catacloud job now says which
    workflow job it runs (costs by repository and workflow). Found by GitHub's runner id when
    the delivery has one: a machine's runners share its name (the next one may be registered
    before the previous one's ``completed`` arrives), their ids differ."""
    runners = Runner.objects.select_for_update(of=("self",), no_key=True).filter(
        installation_id=record.installation_id, name=runner_name
    )
    if isinstance(runner_id, int):
        runners = runners.filter(github_runner_id=runner_id)
    runner = runners.order_by("-registered_at").first()
    if runner is None:
        return None
    if runner.workflow_job_id is None:
        Runner.objects.filter(pk=runner.pk).update(
            workflow_job=record, online_at=runner.online_at or timezone.now()
        )
        Job.objects.filter(pk=runner.job_id).update(labels=record.job_labels())
    return runner


def converge_soon(runner_class_id: RunnerClassId) -> None:
    """Ask for the class's convergence after commit. Each delivery asks; a convergence is a
    few counting queries, so a burst's many are cheap, and the reaper converges every class
    each tick whatever happens to the messages."""
    enqueue_on_commit(CONVERGE_TASK, str(runner_class_id))


def _retire_rank(runner: Runner) -> tuple[int, float]:
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


# Runner jobs created in one convergence beyond this are scheduled by one pass after commit
# instead of each in its own submit.
SCHEDULE_EACH_UP_TO = 4


# At most this many runner jobs are started by one convergence (one transaction holding the
# class's lock); a larger deficit is worked off by the next one, sent at once.
MAX_STARTS = 100


def class_converge(*, runner_class_id: RunnerClassId) -> dict[str, int]:
    """Bring one runner class's live, unbound runners to its number of queued workflow jobs."""
    now = timezone.now()
    more = False
    with transaction.atomic():
        rc = (
            RunnerClass.objects.select_for_update(of=("self",), no_key=True)
            .select_related("org", "job_config")
            .filter(pk=runner_class_id)
            .order_by()
            .first()
        )
        if rc is None or rc.job_config is None:
            return {"started": 0, "retired": 0}
        queued = WorkflowJob.objects.filter(runner_class=rc, status=WorkflowJobStatus.QUEUED)
        supply = Runner.objects.filter(
            runner_class=rc,
            workflow_job__isnull=True,
            retire_requested_at__isnull=True,
            job__status__in=JOB_LIVE,
        )
        deficit = queued.count() - supply.count()
        started = retired = 0
        if deficit > 0:
            batch = min(deficit, MAX_STARTS)
            more = deficit > batch
            # the jobs no live runner was started for first (their labels name the runner job)
            todo = list(
                queued.exclude(pk__in=supply.exclude(created_for=None).values("created_for"))
                .select_related("installation")
                .order_by("seen_at")[:batch]
            )
            if len(todo) < batch:  # more runners than distinct jobs to start them for: any queued one
                taken = [w.pk for w in todo]
                rest = queued.exclude(pk__in=taken).select_related("installation").order_by("seen_at")
                todo += list(rest[: batch - len(todo)])
            each = batch <= SCHEDULE_EACH_UP_TO
            for record in todo:
                job = job_submit(
                    org=rc.org,
                    config=rc.job_config,
                    actor=Actor.GITHUB,
                    labels=record.job_labels(),
                    handoff_by="github",
                    hold_reason=hold_reason(record.installation),
                    schedule_now=each,
                )
                Runner.objects.create(
                    job=job, org=rc.org, installation=record.installation, runner_class=rc, created_for=record
                )
                started += 1
            if not each:
                org_id, mt_id = rc.org_id, rc.machine_type_id
                transaction.on_commit(lambda: schedule_grant_now(org_id=org_id, machine_type_id=mt_id))
        elif deficit < 0:
            for runner in sorted(supply.select_related("job"), key=_retire_rank)[:-deficit]:
                if _retire_rank(runner)[0] < 2:
                    job_cancel(job=runner.job, actor=Actor.GITHUB)  # no runner registered: ends at once
                else:
                    Runner.objects.filter(pk=runner.pk).update(retire_requested_at=now)
                    retire_soon(runner.pk)
                retired += 1
        if more:
            converge_soon(rc.pk)
    if started or retired:
        log.info("runner class %s: deficit %d, %d started, %d retired", rc, deficit, started, retired)
    return {"started": started, "retired": retired}


def classes_converge() -> dict[str, int]:
    """Every class with queued jobs or live unbound runners (the reaper's safety net)."""
    ids = set(
        WorkflowJob.objects.filter(status=WorkflowJobStatus.QUEUED, runner_class__isnull=False).values_list(
            "runner_class_id", flat=True
        )
    ) | set(
        Runner.objects.filter(
            workflow_job__isnull=True, retire_requested_at__isnull=True, job__status__in=JOB_LIVE
        ).values_list("runner_class_id", flat=True)
    )
    totals = {"started": 0, "retired": 0}
    for class_id in ids:
        for key, value in class_converge(runner_class_id=class_id).items():
            totals[key] += value
    return totals


def erase_ended_secrets() -> int:
    """The runner configuration of an ended runner job is no use to anyone: erase it."""
    return (
        Job.objects.filter(runner__isnull=False, status__in=[s for s in JobStatus if s not in JOB_LIVE])
        .exclude(secret_env_encrypted="")
        .update(secret_env_encrypted="")
    )
