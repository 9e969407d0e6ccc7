"""GitLab CI on Catacloud: an organization's GitLab connection (GitLab.com or self-managed: an
access token allowed to create runners, the webhook's secret token) and the projects it serves,
runner classes (tag sets -> machine type), the Job events received, the CI jobs seen and the
runners started for them (each one a Catacloud job).

The fields every forge shares come from the CI core's abstract models (apps.ci.models)."""

from __future__ import annotations

import uuid
from typing import Any

from django.core.validators import MinValueValidator
from django.db import models
from django.db.models import Q

from apps.ci.models import CIJobFields, DeliveryFields, ForgeEndpoint, RunnerClassFields, RunnerFields
from apps.core.crypto import decrypt_json, encrypted
from apps.gitlab.choices import Executor, GitLabJobStatus, RunnerMode, RunnerScope

DEFAULT_URL = "https://gitlab.com"


class GitLabConnection(ForgeEndpoint):
    """One organization's GitLab: its URL, and an access token and the webhook's secret token
    (both encrypted at rest, write-only in the API, never shown). The core's endpoint: the rate
    limit GitLab reported, the request budget, availability, the reconciler's claim and poll."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    org = models.OneToOneField("orgs.Organization", on_delete=models.CASCADE, related_name="gitlab")
    url = models.CharField(
        max_length=300, default=DEFAULT_URL, help_text="https://gitlab.com, or a self-managed GitLab's URL"
    )
    secrets_encrypted = models.TextField(blank=True, editable=False)
    # GitLab's cap on runners created or active in a project (or group) in the past seven days
    # (GitLab.com: 50 on Free, 1,000 on paid tiers); learned from GitLab's refusal when not set.
    # Runner-per-job classes never ask for more; empty: none known.
    runner_cap = models.PositiveIntegerField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name = "GitLab connection"

    def __str__(self) -> str:
        return f"GitLab {self.url} for {self.org}"

    secrets = encrypted("secrets_encrypted", "{token, webhook_token}")

    @property
    def token(self) -> str:
        return self.secrets.get("token", "")

    @property
    def webhook_token(self) -> str:
        return self.secrets.get("webhook_token", "")

    @property
    def api_url(self) -> str:
        return self.url.rstrip("/") + "/api/v4"

    def event_ref(self) -> dict[str, Any]:
        return {"gitlab": self.url}


class GitLabProject(models.Model):
    """A project the connection serves: its Job events are accepted, its pending jobs polled."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    connection = models.ForeignKey(GitLabConnection, on_delete=models.CASCADE, related_name="projects")
    org = models.ForeignKey("orgs.Organization", on_delete=models.CASCADE, related_name="+")
    project_id = models.PositiveBigIntegerField(help_text="GitLab's project id")
    path = models.CharField(max_length=300, help_text="its path with namespace, e.g. acme/app")

    class Meta:
        verbose_name = "GitLab project"
        ordering = ["path"]
        constraints = [
            models.UniqueConstraint(fields=["connection", "project_id"], name="gitlab_project_unique")
        ]

    def __str__(self) -> str:
        return f"{self.path} ({self.project_id})"


class GitLabRunnerClass(RunnerClassFields):
    """CI jobs whose ``tags`` this class covers run on ``machine_type`` (``[catacloud,
    linux-2cpu]`` -> local-small), through a job configuration it keeps (``gitlab-<name>``):
    same admission, quotas, budgets, priorities and reports as any job."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    org = models.ForeignKey(
        "orgs.Organization", on_delete=models.CASCADE, related_name="gitlab_runner_classes"
    )
    # Lower-case, sorted, unique: the runner's tags; a job matches when its tags are a subset.
    tags = models.JSONField(default=list)
    scope = models.CharField(max_length=8, choices=RunnerScope.choices, default=RunnerScope.PROJECT)
    group_id = models.PositiveBigIntegerField(
        null=True, blank=True, help_text="scope group: GitLab's group id"
    )
    executor = models.CharField(max_length=16, choices=Executor.choices, default=Executor.SHELL)
    # A runner created for each job (deleted once it has its job), or one runner for the class
    # (per project, or its group) whose token every machine of the class runs with, each its
    # own runner manager (system id); its token is rotated every ``rotate_hours``.
    runner_mode = models.CharField(max_length=8, choices=RunnerMode.choices, default=RunnerMode.PER_JOB)
    rotate_hours = models.PositiveIntegerField(
        default=168, validators=[MinValueValidator(1)], help_text="class runner mode: token rotation"
    )
    # The image the runner job runs in (apps.jobs images), when the class names one.
    image = models.CharField(max_length=500, blank=True)
    # Empty: CATACLOUD_GITLAB_RUNNER (the gitlab-runner the machine's image provides).
    runner_path = models.CharField(max_length=500, blank=True)
    job_config = models.OneToOneField(
        "jobs.JobConfiguration",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="gitlab_runner_class",
    )

    class Meta:
        verbose_name = "GitLab runner class"
        verbose_name_plural = "GitLab runner classes"
        ordering = ["org__slug", "name"]
        constraints = [
            models.UniqueConstraint(fields=["org", "name"], name="gitlab_runner_class_name_unique")
        ]

    def __str__(self) -> str:
        return f"{self.org}/{self.name} {self.tags}"

    @property
    def match_labels(self) -> list[str]:
        return list(self.tags)


class GitLabDelivery(DeliveryFields):
    """A Job event received, keyed by its ``Idempotency-Key`` (else ``X-Gitlab-Event-UUID``): the
    same event sent again is a no-op. Stored before it is acted on; ``processed_at`` empty means
    not yet acted on (the reaper's rule acts on what a crash, or a tag look-up, left)."""

    key = models.CharField(max_length=64, primary_key=True)
    connection = models.ForeignKey(GitLabConnection, on_delete=models.CASCADE, related_name="deliveries")

    class Meta:
        verbose_name = "GitLab delivery"
        verbose_name_plural = "GitLab deliveries"
        ordering = ["-received_at"]
        indexes = [
            models.Index(
                fields=["received_at"], name="gitlab_delivery_unprocessed", condition=Q(processed_at=None)
            )
        ]

    def __str__(self) -> str:
        return f"{self.event} {self.action} {self.key}"


class GitLabJob(CIJobFields):
    """A GitLab CI job that one of the org's runner classes covers, keyed by its id (a retry is
    another job): Job events and the reconciler's polls move its status forward only."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    connection = models.ForeignKey(GitLabConnection, on_delete=models.CASCADE, related_name="jobs")
    org = models.ForeignKey("orgs.Organization", on_delete=models.CASCADE, related_name="+")
    runner_class = models.ForeignKey(
        GitLabRunnerClass, null=True, on_delete=models.SET_NULL, related_name="jobs"
    )
    gitlab_id = models.PositiveBigIntegerField()
    project_id = models.PositiveBigIntegerField()
    project = models.CharField(max_length=300, help_text="the project's path with namespace")
    pipeline_id = models.PositiveBigIntegerField(null=True, blank=True)
    # The pipeline's name (workflow:name) when it has one, else its ref: costs by pipeline.
    pipeline = models.CharField(max_length=300, blank=True)
    ref = models.CharField(max_length=300, blank=True)
    name = models.CharField(max_length=300, blank=True)
    stage = models.CharField(max_length=100, blank=True)
    tags = models.JSONField(default=list)
    status = models.CharField(max_length=24, choices=GitLabJobStatus.choices)
    failure_reason = models.CharField(max_length=64, blank=True)
    # The Catacloud job (a runner of ours) that ran it, when one did.
    job = models.ForeignKey("jobs.Job", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")

    class Meta:
        verbose_name = "GitLab job"
        ordering = ["-seen_at"]
        constraints = [models.UniqueConstraint(fields=["connection", "gitlab_id"], name="gitlab_job_unique")]
        indexes = [models.Index(fields=["runner_class", "status"], name="gitlab_job_class_status")]

    def __str__(self) -> str:
        return f"{self.project} {self.pipeline}/{self.name} #{self.gitlab_id} ({self.status})"

    def job_labels(self) -> dict[str, object]:
        """What a runner job records about the CI job it serves (costs by repository, and by
        workflow: the pipeline)."""
        return {
            "forge": "gitlab",
            "repository": self.project,
            "workflow": self.pipeline,
            "pipeline_id": self.pipeline_id,
            "stage": self.stage,
            "job_name": self.name,
            "gitlab_job_id": self.gitlab_id,
        }

    def event_data(self) -> dict[str, object]:
        return {
            "project": self.project,
            "pipeline": self.pipeline,
            "pipeline_id": self.pipeline_id,
            "job_name": self.name,
            "gitlab_job": self.gitlab_id,
        }


class GitLabRunner(RunnerFields):
    """A runner of ours: one Catacloud job (``job``) that runs ``gitlab-runner run-single`` for
    one runner created with ``POST /user/runners`` and takes one CI job. ``created_for`` is the
    job whose pending started it; ``gitlab_job`` the one GitLab actually gave it."""

    job = models.OneToOneField(
        "jobs.Job", primary_key=True, on_delete=models.CASCADE, related_name="gitlab_runner"
    )
    connection = models.ForeignKey(GitLabConnection, on_delete=models.CASCADE, related_name="runners")
    runner_class = models.ForeignKey(GitLabRunnerClass, on_delete=models.CASCADE, related_name="runners")
    created_for = models.ForeignKey(
        GitLabJob, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    gitlab_job = models.ForeignKey(
        GitLabJob, null=True, blank=True, on_delete=models.SET_NULL, related_name="runners"
    )
    gitlab_runner_id = models.PositiveBigIntegerField(null=True, blank=True)
    # Class runner mode: the runner manager's system id this job's gitlab-runner reports
    # (``s_`` and 12 characters of the job's id), which names it in GitLab's job answers.
    system_id = models.CharField(max_length=32, blank=True)

    class Meta:
        verbose_name = "GitLab runner"
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return self.name or f"runner for job {self.job_id}"


class GitLabClassRunner(models.Model):
    """A class runner (class runner mode): one runner at GitLab for a class and a scope (its
    project, or its group: ``scope_key``), created once; every runner job of the class runs it
    with its own system id. Its token is encrypted at rest and rotated on a schedule
    (``GitLabRunnerClass.rotate_hours``) and on demand; runner jobs handed the old token and
    not running a CI job yet are retired then."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    runner_class = models.ForeignKey(
        GitLabRunnerClass, on_delete=models.CASCADE, related_name="class_runners"
    )
    scope_key = models.CharField(max_length=40)
    gitlab_runner_id = models.PositiveBigIntegerField()
    token_encrypted = models.TextField(editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    rotated_at = models.DateTimeField()

    class Meta:
        verbose_name = "GitLab class runner"
        constraints = [
            models.UniqueConstraint(fields=["runner_class", "scope_key"], name="gitlab_class_runner_unique")
        ]

    def __str__(self) -> str:
        return f"class runner {self.gitlab_runner_id} of {self.runner_class_id} ({self.scope_key})"

    @property
    def token(self) -> str:
        return str(decrypt_json(self.token_encrypted).get("token", ""))
