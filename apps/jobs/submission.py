"""Jobs enter and leave the queue by hand: submit (privileges checked now) and cancel."""

from __future__ import annotations

from typing import Any

from django.db import IntegrityError, transaction

from apps.core import tracing
from apps.core.actors import Actor
from apps.core.errors import Conflict, ErrorCode, InvalidTransition, MissingPrivilege, NotFound
from apps.events.kinds import EventKind
from apps.events.services import event_record
from apps.jobs.choices import JOB_LIVE, JobStatus
from apps.jobs.dispatch import schedule_after_commit, wake_agent
from apps.jobs.handoff import awaits_handoff, job_cancel_before_handoff
from apps.jobs.models import Job, JobConfiguration
from apps.jobs.scheduler import schedule_grant_after_commit, schedule_grant_here
from apps.jobs.services import JOB_STATES, cancelled_by, check_env, check_env_size
from apps.machines import capacity
from apps.machines.choices import INSTANCE_TERMINAL
from apps.machines.models import MachineInstance, MachineType, OrgMachineType
from apps.machines.services import grant_check_privilege, not_granted_message
from apps.orgs.models import Organization
from apps.orgs.registries import check_image_reference
from apps.resources.lifecycle import release_for_job


def job_submit(
    *,
    org: Organization,
    config: JobConfiguration,
    env: dict[str, str] | None = None,
    secret_env: dict[str, str] | None = None,
    image: str | None = None,
    user: Any = None,
    actor: Actor = Actor.UNNAMED,
    labels: dict[str, Any] | None = None,
    handoff_by: str = "",
    hold_reason: str = "",
    schedule_now: bool = True,
    idempotency_key: str = "",
) -> Job:
    """Queue a run of ``config``. Privileges are checked now (403 missing_privilege).

    Integrations (apps.github) also pass ``labels`` (where the job comes from), ``handoff_by``
    (they hand the job to its machine's agent themselves, see apps.jobs.handoff) and
    ``hold_reason`` (queued but not admitted until they release it); ``schedule_now`` False
    leaves the admission to the caller (one pass after a batch of submits)."""
    machine_type = _check_may_submit(org, config)
    merged = {**config.env, **check_env(env or {})}
    secret = check_env(secret_env or {})
    check_env_size(merged, {**config.secret_env, **secret}, owner="a job")
    # The job's image, when it names one, overrides its configuration's.
    image = check_image_reference(image) if image else config.image
    # A submit of its own (the API's, the CLI's): its job is scheduled in its own transaction.
    # Inside a caller's transaction (a CI convergence submitting runner jobs), right after that
    # commits: the grant's lock is not held for the rest of the caller's work.
    own_transaction = not transaction.get_connection().in_atomic_block
    with tracing.span("job.submit", config=config.name), transaction.atomic():
        job = Job.objects.create(
            traceparent=tracing.current_traceparent(),  # the job's trace: every later span joins it
            org=org,
            config=config,
            machine_type=machine_type,
            command=config.command,
            image=image,
            env=merged,
            priority=config.priority,
            timeout_seconds=config.timeout_seconds,
            max_attempts=config.max_attempts,
            submitted_by=user if getattr(user, "pk", None) else None,
            labels=labels or {},
            handoff_by=handoff_by,
            hold_reason=hold_reason[:300],
            pending_reason=hold_reason[:300],
            idempotency_key=idempotency_key,
        )
        if secret:  # in the job's transaction: there before any agent can see the job
            job.secret_env = secret
            job.save(update_fields=["secret_env_encrypted"])
        event_record(
            kind=EventKind.JOB_QUEUED,
            org=org,
            job=job,
            actor=actor,
            config=config.name,
            priority=job.priority,
        )
        _schedule(job, at_once=schedule_now and not hold_reason, own_transaction=own_transaction)
    return job


def _check_may_submit(org: Organization, config: JobConfiguration) -> MachineType:
    """The organization may run ``config`` now: its own, privileged, a machine type granted.
    Returns the type its job goes to: the cheapest candidate not cooling down after a capacity
    error (apps.machines.capacity), else the cheapest candidate, whose cool-down it waits out."""
    if config.org_id != org.pk:
        raise NotFound("job configuration not found")
    several = config.requirements or config.machine_type.alternatives
    types = capacity.candidates(org_id=org.pk, config=config) if several else []
    if not types:
        grant_check_privilege(org=org, machine_type=config.machine_type)
    # A configuration found by apps.jobs.selectors.configs_to_submit knows both of these already.
    if getattr(config, "needs_resources", True):
        for rt in config.resource_types.all():
            if not org.has_privilege(rt.required_privilege):
                raise MissingPrivilege(f"resource type {rt.id} requires privilege {rt.required_privilege}")
    if types:
        return capacity.choose(types) or types[0]
    granted = getattr(config, "granted", None)
    if granted is None:
        granted = OrgMachineType.objects.filter(org=org, machine_type=config.machine_type_id).exists()
    if not granted:
        raise Conflict(
            f"{not_granted_message(org=org, machine_type=config.machine_type)} (any more): "
            "ask an operator for one, or change the configuration's machine type",
            code=ErrorCode.MACHINE_TYPE_NOT_GRANTED,
        )
    return config.machine_type


def _schedule(job: Job, *, at_once: bool, own_transaction: bool) -> None:
    """Admitted and on a warm machine in the submit's very commit when it fits (its agent woken
    by the commit); a scheduling pass only when that could not run here."""
    org_id, machine_type_id = job.org_id, job.machine_type_id
    if at_once and own_transaction and schedule_grant_here(org_id=org_id, machine_type_id=machine_type_id):
        return
    schedule_after_commit()
    if at_once and not own_transaction:
        schedule_grant_after_commit(org_id=org_id, machine_type_id=machine_type_id)


IDEMPOTENCY_KEY_MAX = 200


def job_submit_once(
    *, org: Organization, config: JobConfiguration, idempotency_key: str, **submit: Any
) -> tuple[Job, bool]:
    """:func:`job_submit`, once per ``idempotency_key`` in the organization: a retried submit
    (its answer lost: a timeout, a 503) gets the job the first one queued. Returns (job,
    whether this call queued it). The key naming a submit of another configuration: 409."""

    def earlier() -> Job | None:
        job = Job.objects.filter(org=org, idempotency_key=idempotency_key).first()
        if job is not None and job.config_id != config.pk:
            raise Conflict(
                "this Idempotency-Key was used for a submit of another configuration",
                code=ErrorCode.IDEMPOTENCY_KEY_REUSED,
            )
        return job

    if not idempotency_key:
        return job_submit(org=org, config=config, **submit), True
    if (job := earlier()) is not None:
        return job, False
    try:
        return job_submit(org=org, config=config, idempotency_key=idempotency_key, **submit), True
    except IntegrityError:  # a concurrent submit with the same key won the unique index
        if (job := earlier()) is None:
            raise
        return job, False


def job_cancel(*, job: Job, actor: Actor = Actor.UNNAMED) -> Job:
    """Cancel in any live state: before a machine it ends at once (releasing what it holds);
    on a machine the agent kills the command and reports ``cancelled`` within seconds."""
    with transaction.atomic():
        locked = Job.objects.select_for_update().get(pk=job.pk)
        if locked.status not in JOB_LIVE:
            raise InvalidTransition("Job", job.pk, locked.status, JobStatus.CANCELLED)
        machine_gone = locked.instance_id is None or (
            MachineInstance.objects.filter(pk=locked.instance_id, status__in=INSTANCE_TERMINAL).exists()
        )
        if awaits_handoff(locked):
            # Its agent has not got it (apps.jobs.handoff): it ends at once and its machine
            # is released as after any job (kept for reuse or destroyed).
            job_cancel_before_handoff(job=locked, actor=actor)
        elif locked.status in (JobStatus.ASSIGNED, JobStatus.RUNNING) and not machine_gone:
            # The agent kills the command and reports; if the machine goes away first, the
            # requeue that follows sees cancel_requested and ends the job cancelled.
            Job.objects.filter(pk=job.pk).update(cancel_requested=True)
            event_record(
                kind=EventKind.JOB_CANCEL_REQUESTED,
                org=locked.org_id,
                job=job,
                actor=actor,
                instance=locked.instance_id,
            )
            instance_id = locked.instance_id
            assert instance_id is not None  # not machine_gone
            transaction.on_commit(lambda: wake_agent(instance_id))
        else:
            JOB_STATES.move(
                job.pk,
                to=JobStatus.CANCELLED,
                actor=actor,
                reason="cancelled before it ran",
                failure_reason=f"{cancelled_by(job.pk, fallback=actor)} before it ran",
            )
            release_for_job(job_id=locked.pk, reason="job cancelled")
            schedule_after_commit()
    return Job.objects.get(pk=job.pk)
