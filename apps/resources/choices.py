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


R = ResourceStatus
RESOURCE_LIVE = frozenset({R.REQUESTED, R.CREATING, R.READY, R.HELD, R.RELEASING})
RESOURCE_TRANSITIONS: dict[str, frozenset[str]] = {
    R.REQUESTED: frozenset({R.CREATING, R.RELEASING, R.FAILED}),
    # creating -> requested: a create that failed transiently or whose worker died is retried
    # (wells create idempotently by resource id).
    R.CREATING: frozenset({R.REQUESTED, R.READY, R.RELEASING, R.FAILED}),
    R.READY: frozenset({R.HELD, R.RELEASING, R.FAILED}),
    R.HELD: frozenset({R.RELEASING, R.FAILED}),
    R.RELEASING: frozenset({R.DESTROYED, R.FAILED}),
    R.DESTROYED: frozenset(),
    # A failed resource may still exist outside: the reaper retries its destruction.
    R.FAILED: frozenset({R.RELEASING}),
}
del R
