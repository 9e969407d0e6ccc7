from __future__ import annotations

from django.db import models


class WellKind(models.TextChoices):
    API_TOKEN = "api_token", "api_token: a Catacloud token scoped to the job"
    POSTGRES_DATABASE = "postgres_database", "postgres_database: a scratch database and role"
    WEBHOOK = "webhook", "webhook: your own create/destroy URLs"


class ResourceStatus(models.TextChoices):
    REQUESTED = "requested"
    CREATING = "creating"
    READY = "ready"
    HELD = "held"
    RELEASING = "releasing"
    DESTROYED = "destroyed"
    FAILED = "failed"


RESOURCE_LIVE = frozenset(
    {
        ResourceStatus.REQUESTED,
        ResourceStatus.CREATING,
        ResourceStatus.READY,
        ResourceStatus.HELD,
        ResourceStatus.RELEASING,
    }
)
RESOURCE_TRANSITIONS: dict[str, frozenset[str]] = {
    ResourceStatus.REQUESTED: frozenset(
        {ResourceStatus.CREATING, ResourceStatus.RELEASING, ResourceStatus.FAILED}
    ),
    # creating -> requested: a create that failed transiently or whose worker died is retried
    # (wells create idempotently by resource id).
    ResourceStatus.CREATING: frozenset(
        {ResourceStatus.REQUESTED, ResourceStatus.READY, ResourceStatus.RELEASING, ResourceStatus.FAILED}
    ),
    ResourceStatus.READY: frozenset({ResourceStatus.HELD, ResourceStatus.RELEASING, ResourceStatus.FAILED}),
    ResourceStatus.HELD: frozenset({ResourceStatus.RELEASING, ResourceStatus.FAILED}),
    ResourceStatus.RELEASING: frozenset({ResourceStatus.DESTROYED, ResourceStatus.FAILED}),
    ResourceStatus.DESTROYED: frozenset(),
    # A failed resource may still exist outside: the reaper retries its destruction.
    ResourceStatus.FAILED: frozenset({ResourceStatus.RELEASING}),
}
