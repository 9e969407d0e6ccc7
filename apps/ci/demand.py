"""Runners out: each runner class is converged level-triggered. Its demand is its pending forge
jobs, its supply the live runners not yet given a job (and not being retired); a deficit starts
runners (Catacloud jobs: admission, quotas, budgets, placement as for any job), a surplus
retires the runners furthest from running (not yet on a machine first), so there are never more
runners than pending jobs. A job that another runner took, or that was cancelled while pending,
leaves the demand: one of ours is retired and its machine released.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from django.db import transaction
from django.db.models import Count, Q
from django.utils import timezone

from apps.ci.availability import NOT_ON_A_MACHINE, hold_reason
from apps.ci.dispatch import handoffs_inline, retire_soon
from apps.ci.forge import Forge, RunnerClassId, ops_of
from apps.ci.records import converge_soon
from apps.core.broker import enqueue
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


@dataclass
class _Scope:
    """One scope of a class (the runners that can take a job of it: the repository or project
    its runners register in, or "" for the class's organization or group): its pending jobs
    and its free runners, and the field values (of the forge's ``scope_fields``) that are it."""

    values: list[dict[str, Any]] = field(default_factory=list)
    demand: int = 0
    supply: int = 0

    def where(self, prefix: str = "") -> Q:
        """The rows of this scope (``prefix``: through a relation, e.g. a runner's created_for)."""
        q = Q(pk__in=[])
        for values in self.values:
            q |= Q(**{f"{prefix}{k}": v for k, v in values.items()})
        return q


def scopes_of(forge: Forge, rc: Any, queued: Any, supply: Any) -> dict[str, _Scope]:
    """The class's pending jobs and free runners counted per scope: a project's (repository's)
    runner serves its own project only, so a runner started for project A is no supply for B
    (a grouped query each; the forge's ``scope_of`` names a row's scope)."""
    ops = ops_of(forge)
    fields_ = list(ops.scope_fields)
    scopes: dict[str, _Scope] = {}
    for row in queued.values(*fields_).annotate(n=Count("pk")).order_by():
        n = row.pop("n")
        scope = scopes.setdefault(ops.scope_of(rc, row), _Scope())
        scope.values.append(row)
        scope.demand += n
    through = [f"created_for__{f}" for f in fields_]
    for row in supply.values(*through).annotate(n=Count("pk")).order_by():
        n = row.pop("n")
        values = {f: row[f"created_for__{f}"] for f in fields_}
        key = ops.scope_of(rc, values) if row[through[0]] is not None else ""
        scope = scopes.setdefault(key, _Scope())
        scope.supply += n
        if row[through[0]] is not None:
            scope.values.append(values)
    return scopes


def _start(forge: Forge, rc: Any, scope: _Scope, queued: Any, supply: Any, n: int, each: bool) -> int:
    """Start ``n`` runner jobs for the scope's pending jobs (those no live runner was started
    for first: the runner job's labels name its job); held while the forge limits us."""
    mine = queued.filter(scope.where())
    todo = list(
        mine.exclude(pk__in=supply.exclude(created_for=None).values("created_for"))
        .select_related(forge.endpoint_field)
        .order_by("seen_at")[:n]
    )
    if len(todo) < n:  # more runners than distinct jobs to start them for: any pending one
        rest = mine.exclude(pk__in=[w.pk for w in todo]).select_related(forge.endpoint_field)
        todo += list(rest.order_by("seen_at")[: n - len(todo)])
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
            job=job,
            org=rc.org,
            **forge.of_endpoint(endpoint),
            runner_class=rc,
            created_for=record,
            held_until=endpoint.paced_until if endpoint.is_paced() else None,
        )
    return len(todo)


def _retire(forge: Forge, key: str, scope: _Scope, supply: Any, n: int, now: Any) -> int:
    """Retire ``n`` of the scope's free runners, those furthest from running first (a runner
    whose job record is gone counts in the unscoped scope, "")."""
    where = scope.where("created_for__")
    mine = supply.filter(where | Q(created_for__isnull=True) if key == "" else where)
    retired = 0
    for runner in sorted(mine.select_related("job"), key=_retire_rank)[:n]:
        if _retire_rank(runner)[0] < 2:
            job_cancel(job=runner.job, actor=forge.actor)  # no runner registered: ends at once
        else:
            forge.runner.objects.filter(pk=runner.pk).update(retire_requested_at=now)
            retire_soon(forge, runner.pk)
        retired += 1
    return retired


def class_converge(*, forge: Forge, runner_class_id: RunnerClassId) -> dict[str, int]:
    """Bring one runner class's live, unbound runners to its pending forge jobs, scope by scope
    (at most :data:`MAX_STARTS` started at once; the rest by the next convergence, sent at
    once). A blocked class (its runner refused to start) starts none."""
    now = timezone.now()
    started = retired = 0
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
        scopes = scopes_of(forge, rc, queued, supply)
        deficits = {k: s.demand - s.supply for k, s in scopes.items()}
        wanted = 0 if rc.blocked_at is not None else sum(d for d in deficits.values() if d > 0)
        each = min(wanted, MAX_STARTS) <= SCHEDULE_EACH_UP_TO
        for key, scope in sorted(scopes.items()):
            deficit = deficits[key]
            if deficit > 0 and rc.blocked_at is None and started < MAX_STARTS:
                started += _start(forge, rc, scope, queued, supply, min(deficit, MAX_STARTS - started), each)
            elif deficit < 0:
                retired += _retire(forge, key, scope, supply, -deficit, now)
        if started and not each:
            org_id, mt_id = rc.org_id, rc.machine_type_id
            transaction.on_commit(lambda: schedule_grant_now(org_id=org_id, machine_type_id=mt_id))
        if wanted > started:
            converge_soon(forge, rc.pk)
    if started or retired:
        log.info("%s runner class %s: %d started, %d retired", forge, rc, started, retired)
    return {"started": started, "retired": retired}


def converge_here(*, forge: Forge, runner_class_ids: list[RunnerClassId]) -> None:
    """Converge these classes in this task (apps.ci.records.converges_inline), handing off the
    first runner job placed here too (apps.ci.dispatch.handoffs_inline); a failure leaves the
    class to its convergence task."""
    for runner_class_id in runner_class_ids:
        try:
            with handoffs_inline():
                class_converge(forge=forge, runner_class_id=runner_class_id)
        except Exception:
            log.exception(
                "converging %s runner class %s in place failed; its task will", forge, runner_class_id
            )
            enqueue(forge.tasks.converge, str(runner_class_id))


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
