from __future__ import annotations

from django.db import models


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


class RunnerScope(models.TextChoices):
    ORG = "org", "organization runner (any repository of the installation's organization)"
    REPO = "repo", "repository runner (the repository of the job it was started for)"
