"""Jobs: the job state machine (admission and placement come with the scheduler)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from django.db import transaction

from apps.core.actors import Actor
from apps.core.errors import Conflict, ErrorCode, MissingPrivilege, ValidationFailed
from apps.core.ids import JobId
from apps.core.transitions import StateMachine
from apps.events.kinds import EventKind
from apps.events.models import Event
from apps.events.services import event_record, events_record
from apps.jobs.choices import JOB_TERMINAL, JOB_TRANSITIONS, JobStatus
from apps.jobs.models import Job, JobConfiguration
from apps.machines import capacity
from apps.machines.models import MachineType
from apps.machines.services import grant_check_privilege, grant_for
from apps.orgs.models import Organization
from apps.orgs.registries import check_image_reference
from apps.resources.models import ResourceType

_STAMPS = {
    JobStatus.QUEUED: "queued_at",
    JobStatus.ACQUIRING_RESOURCES: "admitted_at",
    JobStatus.ASSIGNED: "assigned_at",
    JobStatus.RUNNING: "started_at",
    **{s: "finished_at" for s in JOB_TERMINAL},
}


# Event names users see (job.queued, job.admitted, job.assigned, job.started, job.finished…).
JOB_EVENTS = {
    JobStatus.ACQUIRING_RESOURCES: EventKind.JOB_ADMITTED,
    JobStatus.WAITING_FOR_MACHINE: EventKind.JOB_WAITING_FOR_MACHINE,
    JobStatus.ASSIGNED: EventKind.JOB_ASSIGNED,
    JobStatus.RUNNING: EventKind.JOB_STARTED,
    **{s: EventKind.JOB_FINISHED for s in JOB_TERMINAL},
}


def job_claim_label(job_id: JobId) -> str:
    """``claimed_for`` of a machine claimed for a job (who holds it, for ownership checks)."""
    return f"job:{job_id}"


# Every job status change: JOB_STATES.move(job_id, to=..., ...) or .try_move(...).
JOB_STATES = StateMachine(
    Job,
    JOB_TRANSITIONS,
    "job",
    kinds=EventKind,
    record=event_record,
    record_many=events_record,
    stamps=_STAMPS,
    events=JOB_EVENTS,
)


# ---- job configurations ---------------------------------------------------------------------

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
RESERVED_ENV_PREFIX = "CATACLOUD_"


def check_env(env: object) -> dict[str, str]:
    """A job's (or configuration's) env as given: an object of valid, unreserved names to
    strings, or a 400 naming what is wrong."""
    if not isinstance(env, dict):
        raise ValidationFailed("env must be an object of NAME: value", fields={"env": ["must be an object"]})
    for key, value in env.items():
        if not isinstance(key, str) or not ENV_NAME.match(key):
            raise ValidationFailed(
                f"env: {key!r} is not a valid variable name", fields={"env": ["invalid name"]}
            )
        if key.startswith(RESERVED_ENV_PREFIX):
            raise ValidationFailed(
                f"env: {key} is reserved (CATACLOUD_* is set by Catacloud)", fields={"env": ["reserved name"]}
            )
        if not isinstance(value, str):
            raise ValidationFailed(
                f"env: the value of {key} must be a string", fields={"env": ["values are strings"]}
            )
    return dict(env)


# What a job's environment may hold: env and secret_env together (a name in both counts once),
# names and values in UTF-8. Far above what jobs use, far below what starts a process (Linux:
# 128 KiB per variable, about 2 MiB in all; bubblewrap: 9,000 arguments).
ENV_MAX_VARIABLES = 256
ENV_MAX_BYTES = 128 * 1024


def check_env_size(env: dict[str, str], secret_env: dict[str, str], *, owner: str) -> None:
    """A 400 ``env_too_large`` naming the limits when ``env`` and ``secret_env`` together pass
    them: such a job could not even be started on its machine."""
    merged = {**env, **secret_env}
    size = sum(len(name.encode()) + len(value.encode()) for name, value in merged.items())
    if len(merged) <= ENV_MAX_VARIABLES and size <= ENV_MAX_BYTES:
        return
    limit = (
        f"at most {ENV_MAX_VARIABLES} variables and {ENV_MAX_BYTES:,} bytes "
        f"({ENV_MAX_BYTES // 1024} KiB) of names and values"
    )
    raise ValidationFailed(
        f"env: {len(merged)} variables ({size:,} bytes); {owner}'s env and secret_env together take {limit}",
        fields={"env": [f"env and secret_env together take {limit}"]},
        code=ErrorCode.ENV_TOO_LARGE,
    )


def check_command(*, command: str, image: str) -> None:
    """A command to run, unless an image names one (its Entrypoint and Cmd run then)."""
    if not command.strip() and not image:
        raise ValidationFailed.field(
            "command", "must not be empty (only a job with an image may leave it out)"
        )


def _check_usable(
    *, org: Organization, machine_type: MachineType, resource_types: Iterable[ResourceType]
) -> None:
    grant_for(org=org, machine_type=machine_type)
    grant_check_privilege(org=org, machine_type=machine_type)
    for rt in resource_types:
        if not org.has_privilege(rt.required_privilege):
            raise MissingPrivilege(f"resource type {rt.id} requires privilege {rt.required_privilege}")


def _check_overflow(org: Organization, config: JobConfiguration) -> None:
    """An overflow names another machine type the org may use, and a bound, or neither."""
    if config.overflow_machine_type_id is None:
        if config.overflow_after_seconds is not None:
            raise ValidationFailed.field("overflow_after_seconds", "needs overflow_machine_type")
        return
    if config.overflow_machine_type_id == config.machine_type_id:
        raise ValidationFailed.field(
            "overflow_machine_type", "must be another machine type than machine_type"
        )
    if config.overflow_after_seconds is None:
        raise ValidationFailed.field("overflow_after_seconds", "how long a job waits before it overflows")
    overflow = config.overflow_machine_type
    assert overflow is not None
    grant_for(org=org, machine_type=overflow)
    grant_check_privilege(org=org, machine_type=overflow)


def cancelled_by(job_id: JobId, fallback: str = "") -> str:
    """``cancelled by user:alice``: who asked for the cancel (the ``job.cancel_requested``
    event's actor, without the token prefix), so a job's reason says who did what."""
    actor = (
        Event.objects.filter(job_id=job_id, kind=EventKind.JOB_CANCEL_REQUESTED)
        .order_by("-id")
        .values_list("actor", flat=True)
        .first()
    ) or fallback
    who = actor.split(" token:")[0].strip()
    return f"cancelled by {who}" if who else "cancelled"


@transaction.atomic
def job_config_save(
    *,
    org: Organization,
    config: JobConfiguration | None = None,
    actor: Actor = Actor.UNNAMED,
    resource_types: Iterable[ResourceType] | None = None,
    **fields: Any,
) -> JobConfiguration:
    """Create (``config`` None) or update a job configuration, checking what users expect:
    a machine type the org may use, privileges, a valid env, a unique name."""
    creating = config is None
    config = config or JobConfiguration(org=org)
    for key, value in fields.items():
        setattr(config, key, value)  # secret_env: encrypted by the model's setter
    config.env = check_env(config.env)
    config.image = check_image_reference(config.image) if config.image else ""
    check_command(command=config.command, image=config.image)
    if "secret_env" in fields:
        config.secret_env = check_env(fields["secret_env"] or {})
    check_env_size(config.env, config.secret_env, owner="a job configuration")
    config.requirements = capacity.clean_requirements(config.requirements)
    if config.requirements:  # its jobs may run on any type meeting them; named: the cheapest
        config.machine_type = capacity.cheapest_fitting(org_id=org.pk, requirements=config.requirements)
    elif config.machine_type_id is None:
        raise ValidationFailed.field("machine_type", "this field is required (or requirements)")
    types = (
        list(resource_types)
        if resource_types is not None
        else ([] if creating else list(config.resource_types.all()))
    )
    _check_usable(org=org, machine_type=config.machine_type, resource_types=types)
    _check_overflow(org, config)
    clash = JobConfiguration.objects.filter(org=org, name=config.name).exclude(pk=config.pk)
    if clash.exists():
        raise ValidationFailed(
            f"a job configuration named {config.name!r} already exists",
            fields={"name": ["already exists"]},
            code=ErrorCode.DUPLICATE_NAME,
        )
    config.save()
    if resource_types is not None:
        config.resource_types.set(types)
    event_record(
        kind=EventKind.JOB_CONFIG_CREATED if creating else EventKind.JOB_CONFIG_UPDATED,
        org=org,
        actor=actor,
        config=str(config.pk),
        name=config.name,
    )
    return config


@transaction.atomic
def job_config_delete(*, config: JobConfiguration, actor: Actor = Actor.UNNAMED) -> None:
    """Delete a configuration that no job refers to (409 ``in_use`` otherwise)."""
    if config.jobs.exists():
        raise Conflict(
            f"job configuration {config.name} has jobs; it cannot be deleted", code=ErrorCode.IN_USE
        )
    event_record(
        kind=EventKind.JOB_CONFIG_DELETED,
        org=config.org_id,
        actor=actor,
        config=str(config.pk),
        name=config.name,
    )
    config.delete()
