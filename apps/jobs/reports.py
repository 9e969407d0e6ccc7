"""What the agent reports about a job (started, finished, interrupted) and what follows a
job's end on its machine: the machine kept for reuse or destroyed, or the job requeued when
its machine went away."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Mapping
from typing import Any

from django.db import connection, transaction

from apps.core import hooks, tracing
from apps.core.actors import Actor
from apps.core.causes import FREE_REQUEUE_CAUSES, Cause
from apps.core.errors import Conflict, ErrorCode, InvalidTransition, NotFound, ValidationFailed
from apps.core.ids import InstanceId, JobId
from apps.core.locks import machine_releases_lock
from apps.events.kinds import EventKind
from apps.events.models import Event
from apps.events.services import event_record
from apps.jobs.choices import JOB_TERMINAL, JobStatus, Reuse
from apps.jobs.dispatch import schedule_after_commit
from apps.jobs.models import Job, JobLogChunk
from apps.jobs.scheduler import schedule_grant_after_commit
from apps.jobs.services import JOB_STATES, cancelled_by, job_claim_label
from apps.machines.agents import IMAGE_DIGEST, instance_images_set, live_token_sql
from apps.machines.choices import HostStatus, InstanceStatus
from apps.machines.lifecycle import instance_terminate
from apps.machines.models import Host, MachineInstance
from apps.machines.services import INSTANCE_STATES
from apps.pools.refill import request_refill
from apps.resources.choices import ResourceStatus
from apps.resources.lifecycle import release_for_job
from catacloud.protocol import ImagesReport, Outcome

# A job's start in one statement (the agent's ``started`` report, on the path to the job's first
# instruction): the machine named by its agent token (or its id), the job moved assigned ->
# running if it is assigned to that machine (JOB_STATES' graph, stamps and event kind), its
# event inserted, one commit. Answers (machine id or NULL, whether the job moved, traceparent).
_MOVE = JOB_STATES.statement_move(
    to=JobStatus.RUNNING, from_=[JobStatus.ASSIGNED], now_sql="statement_timestamp()", alias="j"
)
_EVENT_COLUMNS = ", ".join(
    str(Event._meta.get_field(name).column)  # type: ignore[union-attr]  # concrete fields, read at import
    for name in ("org", "kind", "created_at", "actor", "reason", "pool_id", "instance_id", "job_id", "data")
)


def _start_sql(machine: str) -> str:
    return f"""
WITH m AS (SELECT i.id FROM {MachineInstance._meta.db_table} AS i WHERE {machine}),
moved AS (
    UPDATE {Job._meta.db_table} AS j SET {_MOVE.set_sql} FROM m
    WHERE j.id = %(job)s AND j.instance_id = m.id AND {_MOVE.where_sql}
    RETURNING j.id, j.org_id, j.instance_id, j.traceparent
),
event AS (
    INSERT INTO {Event._meta.db_table} ({_EVENT_COLUMNS})
    SELECT org_id, %(kind)s, statement_timestamp(), 'agent:' || instance_id::text, '', NULL, instance_id, id,
        jsonb_strip_nulls(jsonb_build_object('status', %(status)s::text, 'agent_ms', %(agent_ms)s::float8))
    FROM moved
)
SELECT (SELECT id FROM m), EXISTS (SELECT 1 FROM moved), (SELECT traceparent FROM moved)
"""


_START_BY_ID = _start_sql("i.id = %(machine)s")
# The agent server's hot route: the machine a live agent token names (as its heartbeat finds it).
_START_BY_TOKEN = _start_sql(f"i.agent_token_hash = %(machine)s AND {live_token_sql('i')}")


def _start(sql: str, machine: Any, job_id: Any, agent_ms: float | None) -> tuple[bool, bool]:
    """(the machine was found, the job moved to running)."""
    params: dict[str, Any] = {
        "machine": machine,
        "job": job_id,
        "kind": str(_MOVE.kind),
        "status": str(JobStatus.RUNNING),
        "agent_ms": agent_ms,
    }
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        found, moved, traceparent = cursor.fetchone()
    if moved and agent_ms is not None:
        now = time.time()
        tracing.record("agent start", traceparent=traceparent, start=now - agent_ms / 1000, end=now)
    return found is not None, moved


NOT_ASSIGNED = "this job is not (or no longer) assigned to this machine"


def job_started(*, instance: MachineInstance, job_id: JobId, agent_ms: float | None = None) -> None:
    """The agent starts the command. The job must still be assigned to this very machine: a
    job is never run by two machines at once, even when a lost agent comes back. ``agent_ms``:
    what the agent spent between its poll's answer and this report (kept with the event)."""
    if not _start(_START_BY_ID, instance.pk, job_id, agent_ms)[1]:
        raise Conflict(NOT_ASSIGNED, code=ErrorCode.NOT_ASSIGNED)


def job_started_by_token(*, token_hash: str, job_id: JobId, agent_ms: float | None) -> bool | None:
    """:func:`job_started` for the agent whose token hashes to ``token_hash`` (the agent server's
    hot route): None when no live machine holds that token, else whether the job started."""
    found, moved = _start(_START_BY_TOKEN, token_hash, job_id, agent_ms)
    return moved if found else None


def job_logs_append(*, instance: MachineInstance, job_id: JobId, chunks: Iterable[Mapping[str, Any]]) -> bool:
    """Store output chunks (``{seq, stream, data}``) of a job running on this machine; a retried
    report repeats seqs already stored and changes nothing. Returns whether a cancel was asked
    for (the agent kills the command). 409 ``not_assigned`` for a job not running here."""
    job = Job.objects.filter(
        pk=job_id, instance=instance, status__in=[JobStatus.ASSIGNED, JobStatus.RUNNING]
    ).first()
    if job is None:
        raise Conflict("this job is not (or no longer) running on this machine", code=ErrorCode.NOT_ASSIGNED)
    _store_output(job, chunks)
    return job.cancel_requested


def _store_output(job: Job, chunks: Iterable[Mapping[str, Any]]) -> None:
    """Output chunks of the job's current attempt; seqs already stored are left as they are."""
    JobLogChunk.objects.bulk_create(
        [
            JobLogChunk(
                job=job,
                attempt=job.attempt,
                seq=c["seq"],
                stream=c["stream"],
                data=c["data"].replace("\x00", "\ufffd"),
            )
            for c in chunks
        ],
        ignore_conflicts=True,  # a retried POST repeats seqs we already have
    )


def job_resource_metadata(*, instance: MachineInstance, job_id: JobId, name: str) -> dict[str, Any]:
    """Metadata of the resource ``name`` the job running on this machine holds, its secret
    included (``catacloud job-meta NAME``: the job is entitled to its token, its DSN; only
    here, never in the API)."""
    job = Job.objects.filter(
        pk=job_id, instance=instance, status__in=[JobStatus.ASSIGNED, JobStatus.RUNNING]
    ).first()
    if job is None:
        raise Conflict("this job is not (or no longer) running on this machine", code=ErrorCode.NOT_ASSIGNED)
    resource = job.resources.filter(resource_type_id=name, status=ResourceStatus.HELD).first()
    if resource is None:
        raise NotFound(f"this job holds no resource {name!r}")
    return {**resource.metadata, **resource.secret}


# How a job ends, as its agent reports it (the protocol's Outcome), and the status it gets.
OUTCOMES = {
    Outcome.SUCCEEDED: JobStatus.SUCCEEDED,
    Outcome.FAILED: JobStatus.FAILED,
    Outcome.TIMED_OUT: JobStatus.TIMED_OUT,
    Outcome.CANCELLED: JobStatus.CANCELLED,
}


def held_for_uploads(uploads_pending: int | None) -> bool:
    """Whether a job's exit report leaves its machine held until ``uploads-done``: only when it
    announced files (else :func:`job_finished` releases the machine and no ``uploads-done`` comes)."""
    return bool(uploads_pending)


def job_finished(
    *,
    instance: MachineInstance,
    job_id: JobId,
    outcome: Outcome,
    exit_code: int | None,
    reason: str = "",
    uploads_pending: int | None = None,
    code: str = "",
    launch: dict[str, Any] | None = None,
    output: Iterable[Mapping[str, Any]] = (),
) -> Job:
    """The agent reports the end of a job; the machine is kept for reuse or destroyed.
    ``code`` (its image could not be had: image_not_found, …) becomes the job's ``failure_code``.
    ``launch`` (``launch_ms``, ``network``: when the command was launched after the start, how
    its network came) goes to the event, for the job's timing. ``output``: the job's last output
    chunks, stored first as ``logs`` stores them (a short job's output and end in one request).

    With ``uploads_pending`` files the machine stays the job's until ``uploads-done`` (the
    job's status is final at once); with none it is released at once, and the agent sends no
    ``uploads-done`` (one from an older agent finds nothing to release).
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
        if job is None or job.status not in (JobStatus.ASSIGNED, JobStatus.RUNNING):
            raise Conflict(
                "this job is not (or no longer) running on this machine", code=ErrorCode.NOT_ASSIGNED
            )
        if output:
            _store_output(job, output)
        status = JobStatus.CANCELLED if job.cancel_requested else OUTCOMES[outcome]
        if status == JobStatus.SUCCEEDED and exit_code not in (0, None):
            status = JobStatus.FAILED
        if status == JobStatus.FAILED and job.handoff_by and not code:
            code = hooks.handed_off_job_failed(job_id=job.pk, exit_code=exit_code)  # a CI runner's cause
        machine = MachineInstance.objects.filter(pk=instance.pk).values("status", "end_cause").first()
        stopped = status not in (JobStatus.SUCCEEDED, JobStatus.CANCELLED) or (
            status == JobStatus.CANCELLED and not job.cancel_requested
        )
        if stopped and machine and machine["status"] != InstanceStatus.CLAIMED:
            return job_requeue(
                job=job,
                cause=Cause.of(machine["end_cause"], Cause.MACHINE_TERMINATED),
                detail=reason,
                actor=Actor.agent(instance.pk),
            )
        job = JOB_STATES.move_held(
            job,
            to=status,
            actor=Actor.agent(instance.pk),
            reason=reason,
            exit_code=exit_code,
            failure_reason=_final_reason(job, status, reason),
            failure_code=_failure_code(status, code),
            pending_reason="",
            event_data={
                "exit_code": exit_code,
                "attempt": job.attempt,
                **({"code": code} if code else {}),
                **(launch or {}),
            },
        )
        release_for_job(job_id=job.pk, reason=f"job {status}")
        if not held_for_uploads(uploads_pending):
            # Nothing to upload (the agent sends no uploads-done then): the machine is released
            # now, a reusable one free for the next job at once (a job submitted the moment this
            # one reads finished finds it idle, not held), an ephemeral one terminated.
            instance_release(instance_id=instance.pk, job=job)
        schedule_after_commit()
    return job


def instance_release(*, instance_id: InstanceId, job: Job) -> bool:
    """After a job: keep the machine for the next job (reuse, current version) or destroy it.
    A kept machine leaves its pool (jobs take it first until its paid period ends); the pool
    refills, and takes it back in while no job is waiting for it.

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
            or instance.status != InstanceStatus.CLAIMED
            or instance.claimed_for != job_claim_label(job.pk)
        ):
            return False
        reuse = (
            job.config.reuse == Reuse.REUSE
            and instance.machine_type_version == instance.machine_type.version
            and _host_takes_work(instance)
        )
        if reuse:
            # A pool refill of this grant running now finishes first; one that starts now waits
            # for this commit, and then counts this machine as idle (apps.core.locks).
            machine_releases_lock(
                org_id=instance.org_id, machine_type_id=instance.machine_type_id, shared=True
            )
            if instance.pool_id:
                request_refill(instance.pool_id)  # a member left its pool: the pool may take it back
            INSTANCE_STATES.move_held(
                instance,
                to=InstanceStatus.READY,
                from_=[InstanceStatus.CLAIMED],
                actor=Actor.SCHEDULER,
                reason="kept for reuse while its paid period lasts",
                event=EventKind.INSTANCE_RELEASED,
                pool=None,
                claim_id=None,
                claimed_by="",
                claimed_for="",
                lease_expires_at=None,
                last_config=job.config_id,
            )
            # A job waiting for a machine of this grant gets this one now, in this request
            # (after the report's commit), not after a worker's scheduling pass.
            schedule_after_commit()
            schedule_grant_after_commit(org_id=instance.org_id, machine_type_id=instance.machine_type_id)
        else:
            instance_terminate(
                instance_id=instance_id,
                actor=Actor.SCHEDULER,
                reason="ephemeral job finished"
                if job.config.reuse == Reuse.EPHEMERAL
                else "outdated machine type version",
                cause=Cause.JOB_FINISHED,
            )
    return True


def _failure_code(status: str, code: str) -> str:
    """A failed job's code as its agent reported it: a registered ErrorCode, else none."""
    if status != JobStatus.FAILED or not code:
        return ""
    try:
        return ErrorCode(code)
    except ValueError:
        return ""


def job_image_report(*, instance: MachineInstance, job_id: JobId, report: ImagesReport) -> None:
    """The agent has the job's image: the digest it resolved becomes the job's (every later
    attempt runs exactly it), ``job.image_pulled`` (bytes, seconds) or ``job.image_cached`` is
    recorded, and the machine's held images are kept for placement."""
    if len(report.pulls) != 1 or not IMAGE_DIGEST.match(report.pulls[0].digest):
        raise ValidationFailed.field("pulls", "one pull with the sha256 digest of the job's image")
    pull = report.pulls[0]
    with transaction.atomic():
        job = (
            Job.objects.select_for_update(of=("self",))
            .filter(pk=job_id, instance=instance, status__in=[JobStatus.ASSIGNED, JobStatus.RUNNING])
            .first()
        )
        if job is None or not job.image:
            raise Conflict(
                "this job is not (or no longer) running on this machine", code=ErrorCode.NOT_ASSIGNED
            )
        if not job.image_digest:
            Job.objects.filter(pk=job.pk).update(image_digest=pull.digest)
        event_record(
            kind=EventKind.JOB_IMAGE_PULLED if pull.pulled else EventKind.JOB_IMAGE_CACHED,
            org=job.org_id,
            job=job,
            instance=instance,
            actor=Actor.agent(instance.pk),
            image=job.image,
            digest=pull.digest,
            bytes=pull.bytes if pull.pulled else None,
            seconds=pull.seconds if pull.pulled else None,
        )
        instance_images_set(instance_id=instance.pk, held=report.held)


def _host_takes_work(instance: MachineInstance) -> bool:
    """A slot of an enrolled host is kept only while its host takes new work (not cordoned,
    lost or revoked); any other machine always may be."""
    if instance.host_id is None:
        return True
    return Host.objects.filter(
        pk=instance.host_id, status=HostStatus.ACTIVE, cordoned_at__isnull=True
    ).exists()


def job_image_unrunnable(*, job: Job) -> bool:
    """A job with an image assigned to a machine whose agent did not say it runs images (an
    agent from before images would run the command on the machine's own root): the job ends
    at once, failed ``image_unusable``, and the machine is released as after any job."""
    instance = MachineInstance.objects.filter(pk=job.instance_id).first() if job.instance_id else None
    if instance is None or (instance.isolation or {}).get("images"):
        return False
    with contextlib.suppress(Conflict):
        job_finished(
            instance=instance,
            job_id=job.pk,
            outcome=Outcome.FAILED,
            exit_code=None,
            reason=_no_images_reason(instance),
            code=ErrorCode.IMAGE_UNUSABLE,
        )
    return True


def _no_images_reason(instance: MachineInstance) -> str:
    """Why a machine runs no image, as its agent said at enrollment (no sandbox, no skopeo...),
    else what an agent from before images needs."""
    said = str((instance.isolation or {}).get("images_detail") or "")
    if said:
        why = said.removeprefix("this machine cannot run images: ")
        return f"this machine's agent cannot run a job's image: {why}"
    return "this machine's agent cannot run a job's image (upgrade catacloud-agent; install skopeo and umoci)"


def _final_reason(job: Job, status: str, reported: str) -> str:
    """A job's ``failure_reason`` says who did what: a cancel a user asked for names the user
    (the agent only knows that the control plane told it to stop); a success has none."""
    if status == JobStatus.SUCCEEDED:
        return ""
    if status == JobStatus.CANCELLED and job.cancel_requested:
        return cancelled_by(job.pk)
    return reported


def job_requeue(*, job: Job, cause: Cause, actor: Actor, detail: str = "") -> Job:
    """Back to ``queued`` with ``attempt + 1`` and ``requeue_reason = cause`` (machine_lost,
    machine_terminated, pool_drained, not_started, spot_interruption). Requeues the operator
    caused (terminate, drain) are free; the others count against ``max_attempts``, and when
    none is left the job fails with the reason. A cancel requested meanwhile wins."""
    reason = f"{cause}: {detail}" if detail else cause
    free = cause in FREE_REQUEUE_CAUSES
    used = job.attempt - job.free_requeues
    if job.cancel_requested:
        job = JOB_STATES.move(
            job.pk,
            to=JobStatus.CANCELLED,
            actor=actor,
            reason=f"cancelled; {reason}",
            failure_reason=f"{cancelled_by(job.pk)} ({reason})",
        )
    elif not free and used >= job.max_attempts:
        job = JOB_STATES.move(
            job.pk,
            to=JobStatus.FAILED,
            actor=actor,
            reason=f"{reason}; no attempts left ({used}/{job.max_attempts})",
            failure_reason=f"{reason} (attempt {used} of {job.max_attempts})",
            requeue_reason=cause,
        )
    else:
        job = JOB_STATES.move(
            job.pk,
            to=JobStatus.QUEUED,
            actor=actor,
            reason=reason,
            event=EventKind.JOB_REQUEUED,
            attempt=job.attempt + 1,
            free_requeues=job.free_requeues + (1 if free else 0),
            requeue_reason=cause,
            instance=None,
            pending_reason=f"requeued ({reason})"[:300],
            admitted_at=None,
            assigned_at=None,
            started_at=None,
            queued_at=job.queued_at,
            event_data={"attempt": job.attempt + 1, "cause": cause, "counts": not free},
        )
    release_for_job(job_id=job.pk, reason="job requeued")
    schedule_after_commit()
    return job


def jobs_requeue_for_instance(*, instance_id: InstanceId, cause: Cause, detail: str = "") -> int:
    """Requeue the jobs still assigned to or running on this instance (its machine is gone;
    ``hooks.machine_gone``)."""
    count = 0
    with transaction.atomic():
        for job in Job.objects.select_for_update().filter(
            instance_id=instance_id, status__in=[JobStatus.ASSIGNED, JobStatus.RUNNING]
        ):
            job_requeue(job=job, cause=cause, detail=detail, actor=Actor.REAPER)
            count += 1
    return count


def job_interrupted(*, instance: MachineInstance, detail: str) -> None:
    """The agent saw a spot interruption notice: requeue its job now and retire the machine."""
    with transaction.atomic():
        for job in Job.objects.select_for_update().filter(
            instance=instance, status__in=[JobStatus.ASSIGNED, JobStatus.RUNNING]
        ):
            job_requeue(
                job=job, cause=Cause.SPOT_INTERRUPTION, detail=detail[:200], actor=Actor.agent(instance.pk)
            )
        event_record(
            kind=EventKind.INSTANCE_INTERRUPTED,
            org=instance.org_id,
            instance=instance,
            actor=Actor.agent(instance.pk),
            reason=detail[:500],
        )
        with contextlib.suppress(InvalidTransition):
            instance_terminate(
                instance_id=instance.pk,
                actor=Actor.agent(instance.pk),
                reason="spot interruption",
                cause=Cause.SPOT_INTERRUPTION,
            )
