from __future__ import annotations

from django.db import models


class JobStatus(models.TextChoices):
    QUEUED = "queued"
    ACQUIRING_RESOURCES = "acquiring_resources"
    WAITING_FOR_MACHINE = "waiting_for_machine"
    ASSIGNED = "assigned"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"


class Reuse(models.TextChoices):
    EPHEMERAL = "ephemeral", "ephemeral: destroy the machine after the job"
    REUSE = "reuse", "reuse: keep the machine for the next job while it is paid for"


class ArtifactKind(models.TextChoices):
    OUTPUT = "output", "output"
    CHECKPOINT = "checkpoint", "checkpoint"


class ArtifactStatus(models.TextChoices):
    STORED = "stored", "stored"
    FAILED = "failed", "failed"  # the agent could not upload it (error says why)
    EXPIRED = "expired", "expired"  # past its retention: the file is deleted, the row stays


J = JobStatus
JOB_TERMINAL = frozenset({J.SUCCEEDED, J.FAILED, J.CANCELLED, J.TIMED_OUT})
JOB_LIVE = frozenset(set(J) - JOB_TERMINAL)
# Admitted jobs count against max_concurrent_jobs and the cpu/memory/gpu quotas.
JOB_ADMITTED = frozenset({J.ACQUIRING_RESOURCES, J.WAITING_FOR_MACHINE, J.ASSIGNED, J.RUNNING})
_ENDS = {J.FAILED, J.CANCELLED}
JOB_TRANSITIONS: dict[str, frozenset[str]] = {
    J.QUEUED: frozenset({J.ACQUIRING_RESOURCES, *_ENDS}),
    # Every admitted state may be requeued (machine lost, resource gone) or ended.
    J.ACQUIRING_RESOURCES: frozenset({J.WAITING_FOR_MACHINE, J.QUEUED, *_ENDS}),
    J.WAITING_FOR_MACHINE: frozenset({J.ASSIGNED, J.QUEUED, *_ENDS}),
    J.ASSIGNED: frozenset({J.RUNNING, J.QUEUED, *_ENDS, J.TIMED_OUT}),
    J.RUNNING: frozenset({J.SUCCEEDED, J.QUEUED, *_ENDS, J.TIMED_OUT}),
    J.SUCCEEDED: frozenset(),
    J.FAILED: frozenset(),
    J.CANCELLED: frozenset(),
    J.TIMED_OUT: frozenset(),
}
del J
