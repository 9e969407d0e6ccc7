"""Jobs an integration hands to their machine's agent, and jobs it holds in the queue.

A GitHub runner job (apps.github) needs something only known once it has a machine: a
just-in-time runner registration named after that machine. So such a job carries
``handoff_by`` ("github"): placement assigns it as usual, then calls the ``job_needs_handoff``
hook instead of waking the agent; the integration asks GitHub (outside any transaction) and
calls :func:`job_handed_off` with the secret it obtained, which stores it encrypted with the
job's secret env (masked in the job's output like any secret value) and wakes the agent. The
agent's poll hands out an assigned job only when ``handoff_by`` is empty or ``handed_off_to``
is its own machine, so a requeued attempt on another machine waits for its own handoff.

An integration may also hold its queued jobs (``hold_reason``: GitHub is unreachable): a held
job is not admitted, so no machine is claimed or bought for it, until :func:`jobs_unhold`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from django.db import transaction
from django.db.models import F, Q

from apps.core.actors import Actor
from apps.core.causes import Cause
from apps.core.errors import InvalidTransition
from apps.core.ids import InstanceId, JobId
from apps.events.kinds import EventKind
from apps.events.services import event_record
from apps.jobs.choices import JobStatus
from apps.jobs.dispatch import schedule_after_commit, wake_agent
from apps.jobs.models import Job
from apps.jobs.reports import instance_release
from apps.jobs.services import JOB_STATES
from apps.resources.lifecycle import release_for_job

# The rule, once: a job may be given to its agent when no integration hands it off, or once it
# was handed to the machine it is assigned to. Its ORM, Python and SQL forms are built from these
# names (tests/jobs/test_handoff_rule.py checks they agree).
_BY, _TO, _ON = "handoff_by", "handed_off_to", "instance_id"
HANDED_OFF_SQL = f"({_BY} = '' OR {_TO} = {_ON})"


def handed_off() -> Q:
    """The jobs an agent may be given: no handoff needed, or handed to the job's own machine."""
    return Q(**{_BY: ""}) | Q(**{_TO: F(_ON)})


def is_handed_off(job: Job) -> bool:
    """:func:`handed_off` of one row in memory (SQL's NULL never equals: neither does None here)."""
    to, on = getattr(job, _TO), getattr(job, _ON)
    return getattr(job, _BY) == "" or (to is not None and to == on)


def awaits_handoff(job: Job) -> bool:
    """Assigned to a machine whose agent has not been given it yet (nor may be)."""
    return job.status == JobStatus.ASSIGNED and not is_handed_off(job)


def _locked_awaiting(job_id: JobId, instance_id: InstanceId) -> Job | None:
    job = Job.objects.select_for_update(of=("self",)).select_related("config").filter(pk=job_id).first()
    if job is None or job.instance_id != instance_id or not awaits_handoff(job):
        return None
    return job


def job_handed_off(
    *, job_id: JobId, instance_id: InstanceId, secret_env: dict[str, str], actor: Actor
) -> bool:
    """Give the job (still assigned to ``instance_id``, not yet handed off) to its agent, with
    ``secret_env`` added to its secret env. False when the job moved on meanwhile (cancelled,
    requeued, another machine): the caller then undoes what it created for it."""
    with transaction.atomic():
        job = _locked_awaiting(job_id, instance_id)
        if job is None:
            return False
        job.secret_env = {**job.secret_env, **secret_env}  # encrypted by the model's setter
        Job.objects.filter(pk=job.pk).update(
            secret_env_encrypted=job.secret_env_encrypted, handed_off_to=instance_id
        )
        event_record(
            kind=EventKind.JOB_HANDED_OFF,
            org=job.org_id,
            job=job,
            instance=instance_id,
            actor=actor,
            by=job.handoff_by,
            secret_env_keys=sorted(secret_env),
        )
        transaction.on_commit(lambda: wake_agent(instance_id))
    return True


def job_handoff_failed(
    *,
    job_id: JobId,
    instance_id: InstanceId,
    cause: Cause,
    detail: str,
    actor: Actor,
    permanent: bool = False,
    hold_reason: str = "",
) -> bool:
    """The integration could not hand the job off. Its machine is released as after a job
    (kept for reuse, or destroyed). ``permanent`` (the integration refuses it: a wrong
    configuration): the job fails with ``detail``. Otherwise it goes back to the queue without
    using an attempt, held with ``hold_reason`` if given. False when it had moved on."""
    with transaction.atomic():
        job = _locked_awaiting(job_id, instance_id)
        if job is None:
            return False
        if permanent:
            job = JOB_STATES.move(
                job.pk,
                to=JobStatus.FAILED,
                actor=actor,
                reason=f"{cause}: {detail}"[:2000],
                failure_reason=f"{cause}: {detail}"[:2000],
                pending_reason="",
            )
        else:
            JOB_STATES.move(
                job.pk,
                to=JobStatus.QUEUED,
                actor=actor,
                reason=f"{cause}: {detail}"[:2000],
                event=EventKind.JOB_REQUEUED,
                instance=None,
                requeue_reason=cause,
                hold_reason=hold_reason[:300],
                pending_reason=(hold_reason or f"requeued ({cause})")[:300],
                admitted_at=None,
                assigned_at=None,
                queued_at=job.queued_at,
                event_data={"attempt": job.attempt, "cause": cause, "counts": False},
            )
        release_for_job(job_id=job.pk, reason=f"handoff failed: {cause}")
        instance_release(instance_id=instance_id, job=job)
        schedule_after_commit()
    return True


def job_cancel_before_handoff(*, job: Job, actor: Actor) -> Job:
    """Cancel an assigned job its agent never got: it ends at once, its machine is released.
    The caller holds the job's row lock."""
    instance_id = job.instance_id
    ended = JOB_STATES.move(
        job.pk,
        to=JobStatus.CANCELLED,
        from_=[JobStatus.ASSIGNED],
        actor=actor,
        reason="cancelled before its machine's agent got it",
        pending_reason="",
    )
    release_for_job(job_id=job.pk, reason="job cancelled")
    if instance_id is not None:
        instance_release(instance_id=instance_id, job=ended)
    schedule_after_commit()
    return ended


def jobs_hold(*, job_ids: Iterable[Any], reason: str, actor: Actor) -> int:
    """Hold these jobs in the queue with ``reason`` (their pending reason): queued ones stay
    there; admitted ones not yet on a machine go back to it (their resources released), so
    nothing is claimed or bought for them. Jobs on a machine are left alone."""
    reason = reason[:300]
    ids = list(job_ids)
    held = Job.objects.filter(pk__in=ids, status=JobStatus.QUEUED).update(
        hold_reason=reason, pending_reason=reason
    )
    for job_id in Job.objects.filter(
        pk__in=ids, status__in=[JobStatus.ACQUIRING_RESOURCES, JobStatus.WAITING_FOR_MACHINE]
    ).values_list("pk", flat=True):
        with transaction.atomic():
            try:
                JOB_STATES.move(
                    job_id,
                    to=JobStatus.QUEUED,
                    from_=[JobStatus.ACQUIRING_RESOURCES, JobStatus.WAITING_FOR_MACHINE],
                    actor=actor,
                    reason=f"held: {reason}",
                    event=EventKind.JOB_REQUEUED,
                    hold_reason=reason,
                    pending_reason=reason,
                    admitted_at=None,
                    event_data={"cause": Cause.HELD, "counts": False},
                )
            except InvalidTransition:
                continue  # placed meanwhile: its handoff will find out
            release_for_job(job_id=job_id, reason="job held")
            held += 1
    return held


def jobs_unhold(*, job_ids: Iterable[Any]) -> int:
    """Release held jobs: admission takes them again (a scheduling pass is sent)."""
    released = (
        Job.objects.filter(pk__in=list(job_ids), status=JobStatus.QUEUED)
        .exclude(hold_reason="")
        .update(hold_reason="", pending_reason="")
    )
    if released:
        schedule_after_commit()
    return released
