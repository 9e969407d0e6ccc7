"""A resource's life after its job: released, destroyed by its well (idempotently), and the
reaper's pass that converges what a lost message or a dead worker left behind."""

from __future__ import annotations

from datetime import datetime, timedelta

from django.conf import settings
from django.db import models, transaction
from django.utils import timezone

from apps.core import hooks
from apps.core.actors import Actor
from apps.core.broker import enqueue_on_commit
from apps.core.ids import JobId, ResourceId
from apps.core.repairs import Repairs
from apps.resources.choices import ResourceStatus
from apps.resources.models import ResourceInstance
from apps.resources.services import RESOURCE_STATES
from apps.resources.wells import WellError, build_well

# The resources app's task (apps/resources/tasks.py), sent by its registered name: the task
# imports this module, never the other way round.
DESTROY_TASK = "apps.resources.tasks.destroy_resource_task"


def release_for_job(*, job_id: JobId, reason: str) -> int:
    """Release everything the job holds (it ended, or goes back to the queue)."""
    ids = list(
        ResourceInstance.objects.filter(
            job_id=job_id,
            status__in=[
                ResourceStatus.REQUESTED,
                ResourceStatus.CREATING,
                ResourceStatus.READY,
                ResourceStatus.HELD,
            ],
        ).values_list("pk", flat=True)
    )
    released = []
    for resource_id in ids:
        if (
            RESOURCE_STATES.try_move(
                resource_id, to=ResourceStatus.RELEASING, actor=Actor.RELEASER, reason=reason
            )
            is None
        ):
            continue
        released.append(str(resource_id))
    for released_id in released:
        enqueue_on_commit(DESTROY_TASK, released_id)
    return len(released)


def resource_destroy(*, resource_id: ResourceId) -> None:
    """Body of the destroy task: the well destroys it (idempotently), then → destroyed, and
    jobs waiting for a slot of this type are woken."""
    resource = ResourceInstance.objects.select_related("resource_type").filter(pk=resource_id).first()
    if resource is None or resource.status != ResourceStatus.RELEASING:
        return
    rtype = resource.resource_type
    build_well(rtype.well, rtype.config).destroy(  # idempotent: also when creation never finished
        resource_id=str(resource.pk),
        external_id=resource.external_id,
        job_id=str(resource.job_id) if resource.job_id else None,
    )
    with transaction.atomic():
        destroyed = RESOURCE_STATES.try_move(
            resource.pk, to=ResourceStatus.DESTROYED, from_=[ResourceStatus.RELEASING], actor=Actor.RELEASER
        )
        if destroyed is None:
            return
        ResourceInstance.objects.filter(pk=resource.pk).update(secret_encrypted="")
        hooks.resource_slot_freed(type_id=rtype.pk)


def resource_destroy_refused(*, resource_id: ResourceId, exc: WellError) -> None:
    """The well refused for good: ``failed`` (the reaper retries its destruction)."""
    RESOURCE_STATES.move(
        resource_id,
        to=ResourceStatus.FAILED,
        actor=Actor.RELEASER,
        reason=str(exc)[:500],
        failure_reason=str(exc)[:2000],
    )


def destroy_again(resource_id: ResourceId) -> None:
    """The destroy task's service as the reaper's repair (a transient error: the next tick)."""
    try:
        resource_destroy(resource_id=resource_id)
    except WellError as exc:
        if exc.retryable:
            raise
        resource_destroy_refused(resource_id=resource_id, exc=exc)


def resources_converge(*, now: datetime | None = None, repairs: Repairs) -> dict[str, int]:
    """The reaper's pass over resources: retry failed destructions, create again what a dead
    worker left ``creating``, and destroy itself (a repair, not a message) everything
    ``releasing`` since before the last tick (the destroy task sent at release had a tick)."""
    now = now or timezone.now()
    retry = list(
        ResourceInstance.objects.filter(status=ResourceStatus.FAILED)
        .exclude(external_id="")
        .values_list("pk", flat=True)[:100]
    )
    for resource_id in retry:
        RESOURCE_STATES.try_move(
            resource_id,
            to=ResourceStatus.RELEASING,
            from_=[ResourceStatus.FAILED],
            actor=Actor.REAPER,
            reason="retrying destruction",
        )
    # Creating past its deadline: the worker died mid-create (a redelivered task sees
    # `creating` and leaves it). Back to requested; the acquire below creates it again.
    create_cutoff = now - timedelta(seconds=settings.CATACLOUD_RESOURCE_CREATE_TIMEOUT)
    for resource_id in ResourceInstance.objects.filter(
        status=ResourceStatus.CREATING, status_changed_at__lt=create_cutoff
    ).values_list("pk", flat=True)[:100]:
        RESOURCE_STATES.try_move(
            resource_id,
            to=ResourceStatus.REQUESTED,
            from_=[ResourceStatus.CREATING],
            actor=Actor.REAPER,
            reason=f"still creating after {settings.CATACLOUD_RESOURCE_CREATE_TIMEOUT:.0f}s",
        )
    # A failed destruction moved back to releasing above is retried at once.
    since = now - timedelta(seconds=settings.CATACLOUD_REAPER_INTERVAL)
    releasing = list(
        ResourceInstance.objects.filter(status=ResourceStatus.RELEASING)
        .filter(models.Q(status_changed_at__lt=since) | models.Q(pk__in=retry))
        .values_list("pk", flat=True)[:500]
    )
    destroying = 0
    for releasing_id in releasing:
        destroying += repairs.submit(f"resource-destroy:{releasing_id}", destroy_again, releasing_id)
    return {"destroying": destroying}
