from __future__ import annotations

from django.db import models


class GitLabJobStatus(models.TextChoices):
    """A GitLab CI job as the Job event (``build_status``) and the jobs API (``status``) say it."""

    CREATED = "created"
    WAITING_FOR_RESOURCE = "waiting_for_resource"
    PREPARING = "preparing"
    MANUAL = "manual"
    SCHEDULED = "scheduled"
    PENDING = "pending"  # waiting for a runner: our demand
    RUNNING = "running"
    CANCELING = "canceling"
    SUCCESS = "success"
    FAILED = "failed"
    CANCELED = "canceled"
    SKIPPED = "skipped"


# Forward only: a report moves a record to a higher rank, never lower. The statuses before a
# runner takes the job share a rank (created -> pending, manual -> pending when played; a
# reordered pair is corrected by the reconciler's poll within one interval).
NOT_STARTED = frozenset(
    {
        GitLabJobStatus.CREATED,
        GitLabJobStatus.WAITING_FOR_RESOURCE,
        GitLabJobStatus.PREPARING,
        GitLabJobStatus.MANUAL,
        GitLabJobStatus.SCHEDULED,
        GitLabJobStatus.PENDING,
    }
)
DONE = frozenset(
    {GitLabJobStatus.SUCCESS, GitLabJobStatus.FAILED, GitLabJobStatus.CANCELED, GitLabJobStatus.SKIPPED}
)
STATUS_RANK = {
    **{str(status): 0 for status in NOT_STARTED},
    GitLabJobStatus.RUNNING.value: 2,
    GitLabJobStatus.CANCELING.value: 2,
    **{str(status): 3 for status in DONE},
}


class RunnerScope(models.TextChoices):
    PROJECT = "project", "project runner (the project of the job it was started for)"
    GROUP = "group", "group runner (any project of the class's group_id)"


class Executor(models.TextChoices):
    """gitlab-runner's executor on the machine: the job's script runs in the runner job's own
    environment (shell; in the class's image when it names one), or in Docker on the machine."""

    SHELL = "shell"
    DOCKER = "docker"


class RunnerMode(models.TextChoices):
    """How a class's runners are made at GitLab (docs/walkthroughs/gitlab-ci.md says which fits
    whom): a runner per job (created for the machine, deleted once it took its job: the
    strongest isolation, one creation call a job, counted against GitLab.com's runner cap), or
    one runner for the class whose token every machine of the class runs with, each its own
    runner manager (no cap, no creation call a job; the token is rotated)."""

    PER_JOB = "per_job", "a runner per job"
    CLASS = "class", "one runner for the class, a runner manager per machine"
