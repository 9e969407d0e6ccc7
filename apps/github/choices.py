from __future__ import annotations

from django.db import models

from apps.ci.choices import Applied, Handoff

__all__ = [
    "GENERIC_LABELS",
    "STATUS_RANK",
    "WORKFLOW_JOB_PENDING",
    "Applied",
    "Handoff",
    "RunnerScope",
    "WorkflowJobStatus",
]


class WorkflowJobStatus(models.TextChoices):
    """A GitHub workflow job as the ``workflow_job`` webhook and the REST API say it."""

    WAITING = "waiting"  # waiting on an environment protection rule: no runner can take it yet
    QUEUED = "queued"  # waiting for a runner: our demand
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"


# Forward only: a delivery moves a record to a higher rank, never lower. waiting and queued
# share a rank (an approved job goes waiting -> queued; a reordered pair is corrected by the
# reconciler's poll within one interval).
STATUS_RANK = {
    WorkflowJobStatus.WAITING: 0,
    WorkflowJobStatus.QUEUED: 0,
    WorkflowJobStatus.IN_PROGRESS: 2,
    WorkflowJobStatus.COMPLETED: 3,
}
WORKFLOW_JOB_PENDING = frozenset({WorkflowJobStatus.WAITING, WorkflowJobStatus.QUEUED})

# Labels every self-hosted runner may carry: a class must name at least one label besides these,
# so a job asking only for [self-hosted] (meant for other runners) never matches.
GENERIC_LABELS = frozenset({"self-hosted", "linux", "windows", "macos", "x64", "arm64", "arm"})


class RunnerScope(models.TextChoices):
    ORG = "org", "organization runner (any repository of the installation's organization)"
    REPO = "repo", "repository runner (the repository of the job it was started for)"
