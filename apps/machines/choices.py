from __future__ import annotations

from django.db import models


class ProviderKind(models.TextChoices):
    LOCAL = "local", "local (agent processes on this host)"
    HETZNER = "hetzner", "Hetzner Cloud"
    AWS = "aws", "AWS EC2"


class Policy(models.TextChoices):
    COST = "cost", "cost: use machines already paid for before buying new ones"
    SPEED = "speed", "speed: provision whenever a job waits and quota allows"


class InstanceStatus(models.TextChoices):
    PENDING = "pending"
    PROVISIONING = "provisioning"
    WARMING = "warming"
    READY = "ready"
    CLAIMED = "claimed"
    TERMINATING = "terminating"
    TERMINATED = "terminated"
    FAILED = "failed"
    LOST = "lost"


S = InstanceStatus
# Rows whose machine exists or may exist at the provider and which we still drive.
INSTANCE_LIVE = frozenset({S.PENDING, S.PROVISIONING, S.WARMING, S.READY, S.CLAIMED, S.TERMINATING})
INSTANCE_TERMINAL = frozenset({S.TERMINATED, S.FAILED, S.LOST})
# Counted against max_instances (everything that costs or will cost money).
INSTANCE_COUNTED = INSTANCE_LIVE

INSTANCE_TRANSITIONS: dict[str, frozenset[str]] = {
    S.PENDING: frozenset({S.PROVISIONING, S.TERMINATING, S.FAILED, S.LOST}),
    S.PROVISIONING: frozenset({S.WARMING, S.TERMINATING, S.FAILED, S.LOST}),
    S.WARMING: frozenset({S.READY, S.TERMINATING, S.FAILED, S.LOST}),
    # claimed -> ready: a machine kept for reuse is handed back after its job.
    S.READY: frozenset({S.CLAIMED, S.TERMINATING, S.FAILED, S.LOST}),
    S.CLAIMED: frozenset({S.READY, S.TERMINATING, S.FAILED, S.LOST}),
    S.TERMINATING: frozenset({S.TERMINATED, S.FAILED, S.LOST}),
    S.TERMINATED: frozenset(),
    S.FAILED: frozenset(),
    S.LOST: frozenset(),
}
del S
