from __future__ import annotations

from django.db import models


class ProviderKind(models.TextChoices):
    LOCAL = "local", "local (agent processes on this host)"
    HETZNER = "hetzner", "Hetzner Cloud"
    AWS = "aws", "AWS EC2"
    AZURE = "azure", "Azure Virtual Machines"
    HOSTS = "hosts", "enrolled hosts (machines you own, never bought)"


class HostStatus(models.TextChoices):
    """An enrolled host: ``active`` while its agent heartbeats, ``lost`` once it stops (back to
    ``active`` when it returns, without a new enrolment), ``revoked`` for good."""

    ACTIVE = "active"
    LOST = "lost"
    REVOKED = "revoked"


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


# Rows whose machine exists or may exist at the provider and which we still drive.
INSTANCE_LIVE = frozenset(
    {
        InstanceStatus.PENDING,
        InstanceStatus.PROVISIONING,
        InstanceStatus.WARMING,
        InstanceStatus.READY,
        InstanceStatus.CLAIMED,
        InstanceStatus.TERMINATING,
    }
)
INSTANCE_TERMINAL = frozenset({InstanceStatus.TERMINATED, InstanceStatus.FAILED, InstanceStatus.LOST})
# Counted against max_instances (everything that costs or will cost money).
INSTANCE_COUNTED = INSTANCE_LIVE

INSTANCE_TRANSITIONS: dict[str, frozenset[str]] = {
    InstanceStatus.PENDING: frozenset(
        {InstanceStatus.PROVISIONING, InstanceStatus.TERMINATING, InstanceStatus.FAILED, InstanceStatus.LOST}
    ),
    InstanceStatus.PROVISIONING: frozenset(
        {InstanceStatus.WARMING, InstanceStatus.TERMINATING, InstanceStatus.FAILED, InstanceStatus.LOST}
    ),
    InstanceStatus.WARMING: frozenset(
        {InstanceStatus.READY, InstanceStatus.TERMINATING, InstanceStatus.FAILED, InstanceStatus.LOST}
    ),
    # claimed -> ready: a machine kept for reuse is handed back after its job.
    InstanceStatus.READY: frozenset(
        {InstanceStatus.CLAIMED, InstanceStatus.TERMINATING, InstanceStatus.FAILED, InstanceStatus.LOST}
    ),
    InstanceStatus.CLAIMED: frozenset(
        {InstanceStatus.READY, InstanceStatus.TERMINATING, InstanceStatus.FAILED, InstanceStatus.LOST}
    ),
    InstanceStatus.TERMINATING: frozenset(
        {InstanceStatus.TERMINATED, InstanceStatus.FAILED, InstanceStatus.LOST}
    ),
    InstanceStatus.TERMINATED: frozenset(),
    InstanceStatus.FAILED: frozenset(),
    InstanceStatus.LOST: frozenset(),
}
