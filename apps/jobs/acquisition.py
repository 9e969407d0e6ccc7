"""Acquiring and releasing a job's resources, without deadlock.

After admission a job acquires the resource types its configuration lists one at a time in
lexicographic order of resource type id, and asks for a machine only when it holds all of
them. So a job holding resource R/1 and waiting for machine type T/1 can never wait on a job
holding T/1 and waiting for R/1, and ordered acquisition rules out cycles among resources.
``max_instances`` on a resource type is back pressure: jobs wait (``pending_reason`` names the
type) while it is at its limit. Everything a job holds is released when it ends in any way;
the reaper destroys resources whose job is gone.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from apps.core.actors import Actor
from apps.core.ids import JobId
from apps.core.repairs import Repairs
from apps.events.kinds import EventKind
from apps.events.services import event_record
from apps.jobs.choices import JOB_TERMINAL, JobStatus
from apps.jobs.dispatch import acquire_after_commit, schedule_after_commit
from apps.jobs.models import Job
from apps.jobs.services import JOB_STATES
from apps.resources.choices import ResourceStatus
from apps.resources.lifecycle import release_for_job, resources_converge
from apps.resources.models import ResourceInstance, ResourceType
from apps.resources.services import RESOURCE_STATES
from apps.resources.wells import WellError, build_well

log = logging.getLogger(__name__)
# Live resources that occupy a slot of their type's max_instances.
OCCUPYING = [
    ResourceStatus.REQUESTED,
    ResourceStatus.CREATING,
    ResourceStatus.READY,
    ResourceStatus.HELD,
    ResourceStatus.RELEASING,
]


def job_acquire_resources(*, job_id: JobId) -> str:
    """Advance one job's acquisition as far as it can go. Returns what happened:
    ``done`` (all held, waiting for a machine), ``waiting`` (a type is at its limit),
    ``gone`` (the job is no longer acquiring)."""
    job = Job.objects.select_related("config", "org").filter(pk=job_id).first()
    if job is None or job.status != JobStatus.ACQUIRING_RESOURCES:
        return "gone"
    needed = sorted(job.config.resource_types.values_list("id", flat=True))  # lexicographic: no deadlock
    for type_id in needed:
        resource = _reserve(job, type_id)
        if resource is None:
            return "waiting"
        if resource.status == ResourceStatus.REQUESTED:
            _create(resource, job)
            resource.refresh_from_db()
        if resource.status == ResourceStatus.READY:
            RESOURCE_STATES.move(
                resource.pk, to=ResourceStatus.HELD, from_=[ResourceStatus.READY], actor=Actor.ACQUIRER
            )
        elif resource.status != ResourceStatus.HELD:
            return "waiting"  # failed or being created elsewhere: the next pass retries
    with transaction.atomic():
        moved = JOB_STATES.try_move(
            job.pk,
            to=JobStatus.WAITING_FOR_MACHINE,
            from_=[JobStatus.ACQUIRING_RESOURCES],
            actor=Actor.ACQUIRER,
            pending_reason="waiting for a machine",
            event_data={"resources": needed},
        )
        if moved is None:
            return "gone"  # cancelled meanwhile: release_for_job has run or will run
        schedule_after_commit()
    return "done"


def _reserve(job: Job, type_id: str) -> ResourceInstance | None:
    """The job's live resource of this type, or a new ``requested`` one if the type has room."""
    with transaction.atomic():
        rtype = ResourceType.objects.select_for_update().get(pk=type_id)  # serialises slot counting
        mine = ResourceInstance.objects.filter(
            job=job,
            resource_type=rtype,
            status__in=[
                ResourceStatus.REQUESTED,
                ResourceStatus.CREATING,
                ResourceStatus.READY,
                ResourceStatus.HELD,
            ],
        ).first()
        if mine is not None:
            return mine
        used = ResourceInstance.objects.filter(resource_type=rtype, status__in=OCCUPYING).count()
        if used >= rtype.max_instances:
            reason = f"waiting for resource {rtype.pk} ({used}/{rtype.max_instances} in use)"
            Job.objects.filter(pk=job.pk).exclude(pending_reason=reason).update(pending_reason=reason)
            return None
        resource = ResourceInstance.objects.create(resource_type=rtype, org_id=job.org_id, job=job)
        Job.objects.filter(pk=job.pk).update(pending_reason=f"acquiring resource {rtype.pk}")
        event_record(
            kind=EventKind.RESOURCE_REQUESTED,
            org=job.org_id,
            job=job,
            actor=Actor.ACQUIRER,
            resource=str(resource.pk),
            resource_type=rtype.pk,
        )
        return resource


def _create(resource: ResourceInstance, job: Job) -> None:
    """Create it with its well, outside any transaction; record the result in a new one."""
    if (
        RESOURCE_STATES.try_move(
            resource.pk, to=ResourceStatus.CREATING, from_=[ResourceStatus.REQUESTED], actor=Actor.ACQUIRER
        )
        is None
    ):
        return
    rtype = resource.resource_type
    try:
        created = build_well(rtype.well, rtype.config).create(resource_id=str(resource.pk), job=job)
    except WellError as exc:
        ResourceInstance.objects.filter(pk=resource.pk).update(attempts=resource.attempts + 1)
        if exc.retryable:
            # Back to requested; the acquire task retries it with backoff.
            RESOURCE_STATES.try_move(
                resource.pk,
                to=ResourceStatus.REQUESTED,
                from_=[ResourceStatus.CREATING],
                actor=Actor.ACQUIRER,
                reason=str(exc),
            )
            raise
        RESOURCE_STATES.move(
            resource.pk,
            to=ResourceStatus.FAILED,
            actor=Actor.ACQUIRER,
            reason=str(exc)[:500],
            failure_reason=str(exc)[:2000],
        )
        _fail_job(job, f"resource {rtype.pk} could not be created: {exc}")
        return
    with transaction.atomic():
        row = ResourceInstance.objects.select_for_update().get(pk=resource.pk)
        row.external_id, row.metadata = created.external_id[:200], created.metadata
        row.secret = created.secret
        row.save(update_fields=["external_id", "metadata", "secret_encrypted"])
        if row.status == ResourceStatus.CREATING:
            RESOURCE_STATES.move(
                resource.pk, to=ResourceStatus.READY, from_=[ResourceStatus.CREATING], actor=Actor.ACQUIRER
            )
            return
    # Released (or re-driven) while we were creating: the release's destroy may have run
    # before the thing existed, so destroy what we made now (idempotent), and let a release
    # still in flight find it recorded.
    log.info("resource %s was released while being created; destroying it", resource.pk)
    if row.status in (ResourceStatus.RELEASING, ResourceStatus.DESTROYED, ResourceStatus.FAILED):
        build_well(rtype.well, rtype.config).destroy(
            resource_id=str(resource.pk), external_id=created.external_id, job_id=str(job.pk)
        )


def _fail_job(job: Job, reason: str) -> None:
    with transaction.atomic():
        failed = JOB_STATES.try_move(
            job.pk, to=JobStatus.FAILED, actor=Actor.ACQUIRER, reason=reason, failure_reason=reason
        )
        if failed is None:
            return
        release_for_job(job_id=job.pk, reason="job failed")
        schedule_after_commit()


def wake_waiting(*, type_id: str) -> None:
    """Jobs waiting for a slot of ``type_id`` try again (oldest admitted first)."""
    waiting = list(
        Job.objects.filter(status=JobStatus.ACQUIRING_RESOURCES, config__resource_types=type_id)
        .order_by("-priority", "admitted_at")
        .values_list("pk", flat=True)[:50]
    )
    acquire_after_commit(waiting)


def acquire_again(job_id: JobId) -> None:
    """The acquire task's service as the reaper's repair (a transient well error: next tick)."""
    job_acquire_resources(job_id=job_id)


def resources_safety_net(*, now: datetime | None = None, repairs: Repairs) -> dict[str, int]:
    """The reaper's pass: release resources whose job is gone or ended, converge the resources
    themselves (apps.resources.lifecycle), and acquire itself (a repair, not a message) for
    jobs acquiring since before the last tick (their acquire task had a tick to do it)."""
    now = now or timezone.now()
    orphans = ResourceInstance.objects.filter(
        Q(job__isnull=True) | Q(job__status__in=JOB_TERMINAL),
        status__in=[ResourceStatus.REQUESTED, ResourceStatus.READY, ResourceStatus.HELD],
    ).values_list("pk", flat=True)[:500]
    released = 0
    for resource_id in orphans:
        releasing = RESOURCE_STATES.try_move(
            resource_id, to=ResourceStatus.RELEASING, actor=Actor.REAPER, reason="job is gone"
        )
        if releasing is None:
            continue
        released += 1
    converged = resources_converge(now=now, repairs=repairs)
    since = now - timedelta(seconds=settings.CATACLOUD_REAPER_INTERVAL)
    acquiring = list(
        Job.objects.filter(status=JobStatus.ACQUIRING_RESOURCES, status_changed_at__lt=since)
        .order_by("-priority", "admitted_at")
        .values_list("pk", flat=True)[:200]
    )
    started = sum(repairs.submit(f"job-acquire:{job_id}", acquire_again, job_id) for job_id in acquiring)
    return {"released_orphans": released, **converged, "acquiring": started}
