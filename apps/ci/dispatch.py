"""Dispatch: a runner job assigned to a machine gets a runner created at its forge for that
machine, handed to the machine's agent as a secret; a runner no longer needed is deleted at the
forge and its job cancelled; a runner that took its job is deleted as soon as the forge says so
(GitLab: a runner created with ``POST /user/runners`` stays registered until it is deleted, and
takes jobs for whoever holds its token; its running job goes on without it).

The runner is named ``catacloud-<instance id>``. The intent (which machine it is for) is
committed before the call; the runner's id after it. The secret (GitHub's just-in-time
configuration, GitLab's ``glrt-`` token) goes only into the job's encrypted secret env
(apps.jobs.handoff): never into a log line, an event or an API answer, and it is erased when
the job ends.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from apps.ci.availability import (
    NOT_ON_A_MACHINE,
    endpoint_paced,
    hold_reason,
    limit_reason,
    release_when_over,
)
from apps.ci.choices import Handoff
from apps.ci.errors import ForgeBusy, ForgeError, ForgeRateLimited, ForgeRefused, ForgeUnavailable
from apps.ci.forge import Forge, ForgeOps, RunnerId, forge_named, ops_of
from apps.core.broker import enqueue, enqueue_on_commit
from apps.core.errors import ErrorCode, InvalidTransition
from apps.core.ids import InstanceId, JobId
from apps.events.services import event_record
from apps.jobs.choices import JOB_LIVE
from apps.jobs.handoff import awaits_handoff, job_handed_off, job_handoff_failed
from apps.jobs.models import Job
from apps.jobs.submission import job_cancel

log = logging.getLogger(__name__)
NAME_PREFIX = "catacloud-"
# How long a runner's deletion claim (``unregister_claimed_at``) keeps others off it.
UNREGISTER_LEASE = timedelta(minutes=1)


def runner_name(instance_id: InstanceId, suffix: str = "") -> str:
    return f"{NAME_PREFIX}{instance_id}{('-' + suffix) if suffix else ''}"


def instance_of(name: str) -> str | None:
    """The instance id in a runner name of ours (``catacloud-<uuid>[-suffix]``), else None."""
    if not name.startswith(NAME_PREFIX):
        return None
    rest = name[len(NAME_PREFIX) :]
    candidate = rest[:36]
    return candidate if len(candidate) == 36 and candidate.count("-") == 4 else None


# How many hand-offs a task running inside :func:`handoffs_inline` still does itself.
_INLINE: contextvars.ContextVar[int] = contextvars.ContextVar("ci_handoffs_inline", default=0)


@contextlib.contextmanager
def handoffs_inline(n: int = 1) -> Iterator[None]:
    """Within it (a worker's convergence task), the first ``n`` runner jobs placed are handed off
    right there, after their placement committed, instead of in a task of their own: the job
    that made the demand gets its runner one queue hop sooner. The others go to tasks as
    usual, so a burst's registrations still spread over the workers."""
    token = _INLINE.set(n)
    try:
        yield
    finally:
        _INLINE.reset(token)


def runner_handoff_soon(*, job_id: JobId) -> None:
    """The ``job_needs_handoff`` hook: the job's forge (its ``handoff_by``) hands it off in a
    task, as that needs a call to the forge; or here, inside :func:`handoffs_inline` and with no
    transaction open (the hook runs once the placement committed), falling back to the task if
    it fails."""
    by = Job.objects.filter(pk=job_id).values_list("handoff_by", flat=True).first()
    forge = forge_named(by or "")
    if forge is None:
        log.error("job %s is handed off by %r, which no registered forge is", job_id, by)
        return
    left = _INLINE.get()
    if left > 0 and not transaction.get_connection().in_atomic_block:
        _INLINE.set(left - 1)
        try:
            runner_handoff(forge=forge, job_id=job_id)
            return
        except Exception:
            log.exception("handing off job %s in place failed; its task will", job_id)
    enqueue(forge.tasks.handoff, str(job_id))


def load_runner(forge: Forge, job_id: JobId) -> Any:
    endpoint = forge.endpoint_field
    return (
        forge.runner.objects.select_related(
            "job",
            "runner_class",
            *(f"{endpoint}__{r}" for r in forge.endpoint_related),
            endpoint,
            "created_for",
        )
        .filter(job_id=job_id)
        .first()
    )


def runner_handoff(*, forge: Forge, job_id: JobId) -> Handoff:
    """Create a runner at the forge for the machine the job is assigned to and hand its secret
    to the agent. Idempotent: a job already handed off (or no longer assigned) is left alone."""
    runner = load_runner(forge, job_id)
    if runner is None or not awaits_handoff(runner.job):
        return Handoff.NOTHING_TO_DO
    job, endpoint, rc = runner.job, forge.endpoint_of(runner), runner.runner_class
    instance_id = job.instance_id
    if instance_id is None:  # awaits_handoff: assigned, so on a machine
        return Handoff.NOTHING_TO_DO
    name = runner_name(instance_id)
    # An earlier attempt's registration (its machine lost, or its task killed while it asked) is
    # named by no row once this one is recorded: only a listing finds it.
    replaces = runner.registering_at is not None or bool(forge.runner_id_of(runner))
    forge.runner.objects.filter(pk=runner.pk).update(
        name=name, registering_instance=instance_id, registering_at=timezone.now()
    )
    ops = ops_of(forge)
    client = ops.client(endpoint)
    try:
        created = ops.register(client, runner, name)
    except (ForgeUnavailable, ForgeRateLimited) as exc:
        return _handoff_waits(forge, runner, exc)
    except ForgeRefused as exc:
        with transaction.atomic():
            if job_handoff_failed(
                job_id=job.pk,
                instance_id=instance_id,
                cause=forge.refused_cause,
                detail=f"{forge.title} refused the runner registration: {exc.detail}",
                actor=forge.actor,
                permanent=True,
            ):
                event_record(
                    kind=forge.events.runner_refused,
                    org=job.org_id,
                    job=job,
                    instance=instance_id,
                    actor=forge.actor,
                    reason=exc.detail[:500],
                    runner_class=rc.name,
                )
        return Handoff.REFUSED
    with transaction.atomic():
        handed = job_handed_off(
            job_id=job.pk, instance_id=instance_id, secret_env=created.secret_env, actor=forge.actor
        )
        if handed:
            now = timezone.now()
            forge.runner.objects.filter(pk=runner.pk).update(
                name=created.name,
                **{forge.runner_id_field: created.runner_id},
                **created.fields,
                registered_instance=instance_id,
                registered_at=now,
                online_at=now if created.shared else None,
                # a new registration (this attempt's) has taken no job: an earlier attempt's
                # runner may have, before its machine was lost
                **{forge.bound_field: None},
            )
            if replaces:  # the earlier one is deleted once it is idle
                list_runners_next(forge, endpoint.pk)
            event_record(
                kind=forge.events.runner_registered,
                org=job.org_id,
                job=job,
                instance=instance_id,
                actor=forge.actor,
                runner=created.name,
                runner_id=created.runner_id,
                runner_class=rc.name,
                **{forge.labels_field: rc.match_labels},
            )
    if not handed:  # the job moved on while we asked: the runner is nobody's
        _delete_quietly(forge, ops, client, runner, created.runner_id)
        return Handoff.JOB_MOVED_ON
    return Handoff.HANDED_OFF


def _handoff_waits(forge: Forge, runner: Any, exc: ForgeError) -> Handoff:
    """The forge is down or limits us: the job goes back to the queue, held with a pending
    reason naming why (the limit, and until when), its machine released. A limit of our pacing
    holds the endpoint's registrations until its window turns (a runner cap: this one only)."""
    job, endpoint = runner.job, forge.endpoint_of(runner)
    held_until = None
    if isinstance(exc, ForgeRateLimited) and exc.paced:
        held_until = timezone.now() + timedelta(seconds=exc.retry_after)
        if not exc.scoped:
            endpoint_paced(forge=forge, endpoint_id=endpoint.pk, reason=exc.detail, seconds=exc.retry_after)
    endpoint.refresh_from_db(
        fields=["unavailable_until", "unavailable_reason", "paced_until", "paced_reason"]
    )
    reason = (
        limit_reason(forge, exc.detail, held_until)
        if held_until is not None and isinstance(exc, ForgeRateLimited) and exc.scoped
        else hold_reason(forge, endpoint) or f"{forge.title} unavailable: {exc.detail}"
    )
    with transaction.atomic():
        if job_handoff_failed(
            job_id=job.pk,
            instance_id=job.instance_id,
            cause=forge.unavailable_cause,
            detail=exc.detail,
            actor=forge.actor,
            hold_reason=reason[:300],
        ):
            forge.runner.objects.filter(pk=runner.pk).update(held_until=held_until)
            if held_until is not None:
                release_when_over(forge, held_until)
    return forge.unavailable_outcome


def _delete_quietly(forge: Forge, ops: ForgeOps, client: Any, runner: Any, runner_id: int) -> None:
    try:
        ops.delete(client, runner, runner_id)
    except ForgeError as exc:  # no row records it
        log.info("runner %s not deleted now (%s); the reconciler will", runner_id, exc.detail)
        list_runners_next(forge, forge.endpoint_of(runner).pk)


def list_runners_next(forge: Forge, endpoint_id: Any) -> None:
    """A registration of ours that no row names may be left at the forge: the endpoint's next
    reconcile lists its runners (and deletes it), instead of the 10-minute listing."""
    forge.endpoint.objects.filter(pk=endpoint_id).update(runners_listed_at=None)


def runner_retire(*, forge: Forge, job_id: JobId) -> Handoff:
    """A runner no longer needed (demand fell, or idle past its deadline): delete it at the
    forge (refused while it runs a job: then it stays, bound to that job once the forge says
    so), then cancel its Catacloud job (the agent stops it; the machine follows retention)."""
    runner = load_runner(forge, job_id)
    if runner is None or runner.job.status not in JOB_LIVE or forge.bound_id_of(runner):
        return Handoff.NOTHING_TO_DO
    job = runner.job
    runner_id = forge.runner_id_of(runner)
    if runner_id and not awaits_handoff(job) and job.handed_off_to:
        ops = ops_of(forge)
        try:
            ops.retire(ops.client(forge.endpoint_of(runner)), runner)
        except ForgeBusy:  # the forge gave it a job; the job's report binds it
            forge.runner.objects.filter(pk=runner.pk).update(retire_requested_at=None)
            return Handoff.BUSY
        except (ForgeUnavailable, ForgeRateLimited):
            return forge.unavailable_outcome  # retire_requested_at stays: the reconciler retries
        with transaction.atomic():
            event_record(
                kind=forge.events.runner_deleted,
                org=job.org_id,
                job=job,
                instance=job.instance_id,
                actor=forge.actor,
                runner=runner.name,
                runner_id=runner_id,
                reason="no pending job needs it",
            )
    with contextlib.suppress(InvalidTransition):  # it ended meanwhile: nothing left to stop
        job_cancel(job=job, actor=forge.actor)
    return Handoff.RETIRED


def runner_unregister(*, forge: Forge, job_id: JobId) -> Handoff:
    """Our runner took its forge job (it runs or ended): delete the runner at the forge, so its
    token takes no other job. The job it runs goes on (it reports with its own job token) and
    its Catacloud job ends as its command exits. Safe to run twice."""
    runner = load_runner(forge, job_id)
    runner_id = forge.runner_id_of(runner) if runner is not None else None
    if runner is None or not runner_id:
        return Handoff.NOTHING_TO_DO
    now = timezone.now()
    claim = forge.runner.objects.filter(pk=runner.pk).filter(
        Q(unregister_claimed_at__isnull=True) | Q(unregister_claimed_at__lt=now - UNREGISTER_LEASE)
    )
    if not claim.update(unregister_claimed_at=now):
        return Handoff.NOTHING_TO_DO  # another task deletes it, or has
    ops = ops_of(forge)
    try:
        deleted = ops.delete(ops.client(forge.endpoint_of(runner)), runner, runner_id)
    except ForgeError as exc:  # the reconciler deletes it once its job has ended
        log.info("runner %s not deleted now (%s); the reconciler will", runner_id, exc.detail)
        mine = forge.runner.objects.filter(pk=runner.pk, unregister_claimed_at=now)
        mine.update(unregister_claimed_at=None)
        return forge.unavailable_outcome
    if deleted:
        with transaction.atomic():
            event_record(
                kind=forge.events.runner_deleted,
                org=runner.org_id,
                job=runner.job_id,
                instance=runner.registered_instance,
                actor=forge.actor,
                runner=runner.name,
                runner_id=runner_id,
                reason="it took its job",
            )
    return Handoff.UNREGISTERED


def retire_soon(forge: Forge, runner_pk: RunnerId) -> None:
    enqueue_on_commit(forge.tasks.retire, str(runner_pk))


def runner_job_failed(*, job_id: JobId, exit_code: int | None) -> str:
    """The ``handed_off_job_failed`` hook: a runner job failed. When its exit says its runner is a
    version the forge no longer accepts (actions/runner's 7), its class is blocked (no runner
    starts for it until it changes: each would fail the same way while the forge's job waits),
    its runner jobs not on a machine yet are cancelled, and the job's failure code names the
    cause (``runner_outdated``). Inside the report's transaction."""
    by = Job.objects.filter(pk=job_id).values_list("handoff_by", flat=True).first()
    forge = forge_named(by or "")
    if forge is None or exit_code is None:
        return ""
    why = ops_of(forge).outdated(exit_code)
    runner = forge.runner.objects.select_related("runner_class").filter(job_id=job_id).first()
    if not why or runner is None:
        return ""
    rc = runner.runner_class
    if forge.runner_class.objects.filter(pk=rc.pk, blocked_at__isnull=True).update(
        blocked_at=timezone.now(), blocked_reason=why[:300]
    ):
        if forge.events.runner_outdated is not None:
            event_record(
                kind=forge.events.runner_outdated,
                org=runner.org_id,
                job=job_id,
                actor=forge.actor,
                reason=why[:500],
                runner_class=rc.name,
                exit_code=exit_code,
            )
        waiting = forge.runner.objects.filter(
            runner_class=rc, job__status__in=NOT_ON_A_MACHINE, **forge.unbound()
        ).select_related("job")
        for other in waiting:
            with contextlib.suppress(InvalidTransition):
                job_cancel(job=other.job, actor=forge.actor)
    return str(ErrorCode.RUNNER_OUTDATED)
