"""Forge jobs in: :func:`ci_job_apply` records what a delivery or a poll says about one job of
the forge, moving its record forward only (a duplicate or an older report changes nothing),
binding it to the runner of ours that took it, and asking for its class's convergence.

A forge gives a runner *any* pending job whose labels (tags) it has: a runner cannot be bound
to the job that made us start it, so a runner is bound when the forge says which one took which
job (its name, and its id where the forge gives one).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterable, Iterator
from typing import Any

from django.db import IntegrityError, transaction
from django.utils import timezone

from apps.ci.choices import Applied
from apps.ci.forge import Forge, JobReport, RunnerClassId
from apps.ci.reconcile import poll_soon
from apps.core.broker import enqueue_on_commit
from apps.events.services import event_record
from apps.jobs.models import Job

# ---- labels and tags -----------------------------------------------------------------------------


def class_matches(class_labels: Iterable[str], job_labels: Iterable[str], generic: frozenset[str]) -> bool:
    """A forge gives a job to a runner whose labels include all of the job's: a class covers a
    job whose labels are a subset of its own and name at least one that is not ``generic``
    (GitHub: self-hosted, linux, x64...; GitLab: none, but an untagged job is never ours)."""
    mine = set(class_labels)
    wanted = {label.lower() for label in job_labels}
    return bool(wanted) and wanted <= mine and bool(wanted & (mine - generic))


def match_class(classes: Iterable[Any], job_labels: Iterable[str], generic: frozenset[str]) -> Any:
    """The class for a job: among those covering it, the one with the fewest labels (the most
    specific), then by name. None: the job is meant for other runners."""
    wanted = list(job_labels)
    covering = [c for c in classes if class_matches(c.match_labels, wanted, generic)]
    return min(covering, key=lambda c: (len(c.match_labels), c.name)) if covering else None


# ---- records ---------------------------------------------------------------------------------------


def ci_job_apply(*, forge: Forge, endpoint: Any, report: JobReport, source: str) -> tuple[Any, Applied]:
    """Record what the forge says about one job. Returns (record, outcome); the record is None
    for a job no runner class of the org covers (it is meant for other runners)."""
    rules = forge.statuses
    status = report.status
    model = forge.ci_job
    where = {**forge.of_endpoint(endpoint), **report.key}
    with transaction.atomic():
        record = model.objects.select_for_update(no_key=True).filter(**where).first()
        if record is None:
            runner_class = match_class(
                forge.runner_class.objects.filter(org_id=endpoint.org_id), report.labels, forge.generic_labels
            )
            if runner_class is None:
                return None, Applied.NOT_COVERED
            try:
                with transaction.atomic():
                    record = model.objects.create(
                        **where,
                        org_id=endpoint.org_id,
                        runner_class=runner_class,
                        status=status,
                        **report.create,
                    )
            except IntegrityError:  # a concurrent delivery created it: apply on top of it
                record = model.objects.select_for_update(no_key=True).get(**where)
            else:
                event_record(
                    kind=forge.events.job_seen,
                    org=endpoint.org_id,
                    actor=forge.actor_for(source),
                    **record.event_data(),
                    runner_class=runner_class.name,
                    status=status,
                )
                _moved(forge, record, report, created=True, source=source)
                if source == "webhook" and status not in rules.pending:
                    # a job first heard of once it started or ended: its earlier deliveries were
                    # lost, so others may be too (the poll finds them)
                    poll_soon(forge=forge, endpoint_id=endpoint.pk, missed=True)
                return record, Applied.CREATED
        old, new = rules.rank[record.status], rules.rank[status]
        lateral = old == new and record.status in rules.pending and status != record.status
        if new < old or (new == old and not lateral):
            return record, Applied.STALE  # a duplicate, or older than what we know: never back
        record.status = status
        _moved(forge, record, report, created=False, source=source)
        return record, Applied.MOVED


def _moved(forge: Forge, record: Any, report: JobReport, *, created: bool, source: str) -> None:
    """Write the record's new state, bind our runner, record the event, converge its class.
    Inside the record's transaction."""
    rules = forge.statuses
    status = report.status
    now = timezone.now()
    fields: dict[str, Any] = {"status": status, "status_changed_at": now, **report.update}
    runner_name = report.runner_name
    if status in rules.started:
        if runner_name or not record.runner_name:  # a deleted runner reads null: the name stays
            fields["runner_name"] = runner_name[:200]
        fields["started_at"] = report.started_at or record.started_at or now
    if status in rules.done:
        fields["conclusion"] = report.conclusion[:32]
        fields["completed_at"] = report.completed_at or now
    ours, bound_now = (
        _bind(forge, record, runner_name, report.runner_id, report.runner_manager)
        if runner_name
        else (None, False)
    )
    if ours is not None:
        fields["job"] = ours.job_id
    forge.ci_job.objects.filter(pk=record.pk).update(**fields)
    kind = rules.events.get(status)
    if not created and kind is not None:
        event_record(
            kind=kind,
            org=record.org_id,
            job=ours.job_id if ours else None,
            actor=forge.actor_for(source),
            **record.event_data(),
            runner=runner_name or None,
            ours=ours is not None,
            conclusion=fields.get("conclusion") or None,
        )
    if bound_now and ours is not None and forge.tasks.finished:
        # Our runner has just taken its job (started or ended): its registration is deleted now,
        # so its token takes no other job (the forge lets the running job finish:
        # apps.gitlab.ops). Once, when the report binds it: the job's later reports name the
        # same runner, and a deletion that failed is the reconciler's (a bound runner it still
        # lists), not another call per report.
        enqueue_on_commit(forge.tasks.finished, str(ours.pk))
    if record.runner_class_id:
        converge_soon(forge, record.runner_class_id)


def _bind(
    forge: Forge, record: Any, runner_name: str, runner_id: object, manager: str = ""
) -> tuple[Any, bool]:
    """Our runner that took this job is no longer supply, and its Catacloud job now says which
    forge job it runs (costs by repository and workflow). Found by the forge's runner id when
    the report has one: a machine's runners share its name (the next one may be registered
    before the previous one's completion arrives), their ids differ."""
    runners = forge.runner.objects.select_for_update(of=("self",), no_key=True).filter(
        **{f"{forge.endpoint_field}_id": getattr(record, f"{forge.endpoint_field}_id")}, name=runner_name
    )
    if isinstance(runner_id, int):
        runners = runners.filter(**{forge.runner_id_field: runner_id})
    if forge.manager_field:
        # a class runner's machines share its name and id: its runner manager tells them apart
        runners = (
            runners.filter(**{forge.manager_field: manager})
            if manager
            else runners.filter(**{forge.manager_field: ""})
        )
    runner = runners.order_by("-registered_at").first()
    if runner is None:
        return None, False
    if forge.bound_id_of(runner) is not None:
        return runner, False
    forge.runner.objects.filter(pk=runner.pk).update(
        **{forge.bound_field: record}, online_at=runner.online_at or timezone.now()
    )
    Job.objects.filter(pk=runner.job_id).update(labels=record.job_labels())
    return runner, True


# The classes a task running inside :func:`converges_inline` converges itself (None: outside).
_CONVERGE_HERE: contextvars.ContextVar[list[RunnerClassId] | None] = contextvars.ContextVar(
    "ci_converge_inline", default=None
)


@contextlib.contextmanager
def converges_inline() -> Iterator[list[RunnerClassId]]:
    """Within it (a worker's task that acts on a delivery: GitLab's look-up of a new job's tags),
    the first class to converge is not sent to a convergence task: once the delivery's
    transaction committed, its id is added to the list yielded, for the task to converge itself
    (apps.ci.demand.converge_here) and save the job that made the demand the queue's hops."""
    wanted: list[RunnerClassId] = []
    token = _CONVERGE_HERE.set(wanted)
    try:
        yield wanted
    finally:
        _CONVERGE_HERE.reset(token)


def converge_soon(forge: Forge, runner_class_id: RunnerClassId) -> None:
    """Ask for the class's convergence after commit. Each delivery asks; a convergence is a
    few counting queries, so a burst's many are cheap, and the reaper converges every class
    each tick whatever happens to the messages."""
    wanted = _CONVERGE_HERE.get()
    if wanted is not None:
        _CONVERGE_HERE.set(None)  # the first class only; any other goes to its task
        transaction.on_commit(lambda: wanted.append(runner_class_id))
        return
    enqueue_on_commit(forge.tasks.converge, str(runner_class_id))
