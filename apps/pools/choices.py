from __future__ import annotations

from django.db import models


class PoolStatus(models.TextChoices):
    WARMING = "warming"
    READY = "ready"
    REPLENISHING = "replenishing"
    DRAINING = "draining"
    DRAINED = "drained"


POOL_ACTIVE = frozenset({PoolStatus.WARMING, PoolStatus.READY, PoolStatus.REPLENISHING})
POOL_TRANSITIONS: dict[str, frozenset[str]] = {
    PoolStatus.WARMING: frozenset({PoolStatus.READY, PoolStatus.REPLENISHING, PoolStatus.DRAINING}),
    PoolStatus.READY: frozenset({PoolStatus.REPLENISHING, PoolStatus.DRAINING}),
    PoolStatus.REPLENISHING: frozenset({PoolStatus.READY, PoolStatus.DRAINING}),
    PoolStatus.DRAINING: frozenset({PoolStatus.DRAINED}),
    PoolStatus.DRAINED: frozenset(),
}
