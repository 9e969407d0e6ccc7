from __future__ import annotations

from enum import StrEnum

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


class Applied(StrEnum):
    """What recording one workflow job did (``workflow_job_apply``): a delivery's outcome, and
    what the reconciler counts as found."""

    CREATED = "created"
    MOVED = "moved"
    STALE = "stale"  # a duplicate, or older than what we know: never back
    UNKNOWN_STATUS = "unknown status"
    NOT_A_WORKFLOW_JOB = "not a workflow job"
    NOT_COVERED = "no runner class covers these labels"

    @property
    def found(self) -> bool:
        """New to us, or news about it."""
        return self in (Applied.CREATED, Applied.MOVED)


class Handoff(StrEnum):
    """What handing a runner to a machine, or retiring one, came to (the tasks log it)."""

    HANDED_OFF = "handed off"
    NOTHING_TO_DO = "nothing to do"
    GITHUB_UNAVAILABLE = "github unavailable"
    REFUSED = "refused"
    JOB_MOVED_ON = "job moved on"
    BUSY = "busy"
    RETIRED = "retired"
