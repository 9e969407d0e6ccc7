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


JOB_TERMINAL = frozenset({JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED, JobStatus.TIMED_OUT})
JOB_LIVE = frozenset(set(JobStatus) - JOB_TERMINAL)
# Admitted jobs count against max_concurrent_jobs and the cpu/memory/gpu quotas.
JOB_ADMITTED = frozenset(
    {JobStatus.ACQUIRING_RESOURCES, JobStatus.WAITING_FOR_MACHINE, JobStatus.ASSIGNED, JobStatus.RUNNING}
)
_ENDS = {JobStatus.FAILED, JobStatus.CANCELLED}
JOB_TRANSITIONS: dict[str, frozenset[str]] = {
    # Admission: to acquiring_resources, or straight to waiting_for_machine (no resources).
    JobStatus.QUEUED: frozenset({JobStatus.ACQUIRING_RESOURCES, JobStatus.WAITING_FOR_MACHINE, *_ENDS}),
    # Every admitted state may be requeued (machine lost, resource gone) or ended.
    JobStatus.ACQUIRING_RESOURCES: frozenset({JobStatus.WAITING_FOR_MACHINE, JobStatus.QUEUED, *_ENDS}),
    JobStatus.WAITING_FOR_MACHINE: frozenset({JobStatus.ASSIGNED, JobStatus.QUEUED, *_ENDS}),
    JobStatus.ASSIGNED: frozenset({JobStatus.RUNNING, JobStatus.QUEUED, *_ENDS, JobStatus.TIMED_OUT}),
    JobStatus.RUNNING: frozenset({JobStatus.SUCCEEDED, JobStatus.QUEUED, *_ENDS, JobStatus.TIMED_OUT}),
    JobStatus.SUCCEEDED: frozenset(),
    JobStatus.FAILED: frozenset(),
    JobStatus.CANCELLED: frozenset(),
    JobStatus.TIMED_OUT: frozenset(),
}
