from __future__ import annotations

from django.db import models


class PoolStatus(models.TextChoices):
    WARMING = "warming"
    READY = "ready"
    REPLENISHING = "replenishing"
    DRAINING = "draining"
    DRAINED = "drained"


P = PoolStatus
POOL_ACTIVE = frozenset({P.WARMING, P.READY, P.REPLENISHING})
POOL_TRANSITIONS: dict[str, frozenset[str]] = {
    P.WARMING: frozenset({P.READY, P.REPLENISHING, P.DRAINING}),
    P.READY: frozenset({P.REPLENISHING, P.DRAINING}),
    P.REPLENISHING: frozenset({P.READY, P.DRAINING}),
    P.DRAINING: frozenset({P.DRAINED}),
    P.DRAINED: frozenset(),
}
del P
