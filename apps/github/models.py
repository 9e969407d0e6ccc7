"""GitHub Actions on Catacloud: an organization's GitHub App connection, its installations,
runner classes (label sets -> machine type), the webhook deliveries received, the workflow
jobs seen and the just-in-time runners started for them (each one a Catacloud job).

The fields every forge shares come from the CI core's abstract models (apps.ci.models); these
are GitHub's own tables, and what only GitHub has."""

from __future__ import annotations

import uuid
from typing import Any

from django.db import models
from django.db.models import Q

from apps.ci.models import CIJobFields, DeliveryFields, ForgeEndpoint, RunnerClassFields, RunnerFields
from apps.core.crypto import decrypt_json, encrypted
from apps.github.choices import RunnerScope, WorkflowJobStatus

DEFAULT_API_URL = "https://api.github.com"


class GitHubConnection(models.Model):
    """One organization's GitHub App: its id, private key and webhook secret (both encrypted at
    rest, write-only in the API, never shown) and the API base URL (GitHub Enterprise Server)."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    org = models.OneToOneField("orgs.Organization", on_delete=models.CASCADE, related_name="github")
    app_id = models.PositiveBigIntegerField(help_text="the GitHub App's id")
    api_url = models.CharField(
        max_length=300,
        default=DEFAULT_API_URL,
        help_text="https://api.github.com, or GitHub Enterprise Server's /api/v3",
    )
    secrets_encrypted = models.TextField(blank=True, editable=False)
    # Hook deliveries already looked at by the reconciler (GitHub's delivery ids).
    deliveries_checked_at = models.DateTimeField(null=True, blank=True, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name = "GitHub connection"

    def __str__(self) -> str:
        return f"GitHub App {self.app_id} for {self.org}"

    secrets = encrypted("secrets_encrypted", "{private_key, webhook_secret}")

    @property
    def webhook_secret(self) -> str:
        return self.secrets.get("webhook_secret", "")

    @property
    def private_key(self) -> str:
        return self.secrets.get("private_key", "")

    def event_refs(self) -> dict:
        return {"org": self.org_id}


class GitHubInstallation(ForgeEndpoint):
    """One installation of the App (on a GitHub organization or user): the core's endpoint.
    Holds what the one GitHub client shares across processes: the cached installation token,
    and (from :class:`ForgeEndpoint`) the rate limit GitHub reported, the per-installation
    request budget, whether GitHub is reachable, the reconciler's claim and poll backoff."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    connection = models.ForeignKey(GitHubConnection, on_delete=models.CASCADE, related_name="installations")
    org = models.ForeignKey("orgs.Organization", on_delete=models.CASCADE, related_name="+")
    installation_id = models.PositiveBigIntegerField()
    # The GitHub account it is installed on (organization runners register there); learned
    # from deliveries when not set.
    account = models.CharField(max_length=100, blank=True)
    # "Organization" or "User" (learned from deliveries, or from a 404 on /orgs/{login}): a user
    # account has no organization runners, so its runners are repository runners.
    account_type = models.CharField(max_length=16, blank=True)
    # The poll's turn over the active repositories: the last one it looked at.
    poll_cursor = models.CharField(max_length=200, blank=True, editable=False)
    # The last sweep of every repository the installation sees (hourly, when it is quiet).
    swept_at = models.DateTimeField(null=True, blank=True, editable=False)
    # The cached installation token (encrypted) and its expiry.
    token_encrypted = models.TextField(blank=True, editable=False)
    token_expires_at = models.DateTimeField(null=True, blank=True, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        verbose_name = "GitHub installation"
        constraints = [
            models.UniqueConstraint(
                fields=["connection", "installation_id"], name="github_installation_unique"
            )
        ]

    def __str__(self) -> str:
        return f"installation {self.installation_id}" + (f" ({self.account})" if self.account else "")

    @property
    def token(self) -> str:
        return decrypt_json(self.token_encrypted).get("token", "") if self.token_encrypted else ""

    def event_ref(self) -> dict[str, Any]:
        return {"installation": self.installation_id}


class RunnerClass(RunnerClassFields):
    """Workflow jobs whose ``runs-on`` labels this class covers run on ``machine_type``
    (``[self-hosted, catacloud-linux-2cpu]`` -> local-small), through a job configuration it
    keeps (``github-<name>``): same admission, quotas, budgets, priorities and reports."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    org = models.ForeignKey("orgs.Organization", on_delete=models.CASCADE, related_name="runner_classes")
    # Lower-case, sorted, unique: the runner's labels; a job matches when its labels are a
    # subset that names at least one of the class's own (not only self-hosted, linux, x64...).
    labels = models.JSONField(default=list)
    scope = models.CharField(max_length=8, choices=RunnerScope.choices, default=RunnerScope.ORG)
    runner_group_id = models.PositiveBigIntegerField(default=1, help_text="1: the Default group")
    # Empty: CATACLOUD_GITHUB_RUNNER_DIR (the runner folder the machine's image provides).
    runner_dir = models.CharField(max_length=500, blank=True)
    job_config = models.OneToOneField(
        "jobs.JobConfiguration", null=True, blank=True, on_delete=models.SET_NULL, related_name="runner_class"
    )

    class Meta:
        verbose_name_plural = "runner classes"
        ordering = ["org__slug", "name"]
        constraints = [models.UniqueConstraint(fields=["org", "name"], name="runner_class_name_unique")]

    def __str__(self) -> str:
        return f"{self.org}/{self.name} {self.labels}"

    @property
    def match_labels(self) -> list[str]:
        return list(self.labels)


class WebhookDelivery(DeliveryFields):
    """A delivery received, keyed by ``X-GitHub-Delivery``: a redelivery of the same one is a
    no-op. Stored before it is acted on; ``processed_at`` empty means not yet acted on (the
    reaper's rule processes what a crash left)."""

    guid = models.CharField(max_length=64, primary_key=True)
    installation = models.ForeignKey(GitHubInstallation, on_delete=models.CASCADE, related_name="deliveries")

    class Meta:
        verbose_name_plural = "webhook deliveries"
        ordering = ["-received_at"]
        indexes = [
            # the reaper: WHERE processed_at IS NULL ORDER BY received_at
            models.Index(fields=["received_at"], name="delivery_unprocessed", condition=Q(processed_at=None))
        ]

    def __str__(self) -> str:
        return f"{self.event}.{self.action} {self.guid}"


class WorkflowJob(CIJobFields):
    """A GitHub workflow job that one of the org's runner classes covers, keyed by (job id,
    run attempt): deliveries and the reconciler's polls move its status forward only."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    installation = models.ForeignKey(GitHubInstallation, on_delete=models.CASCADE, related_name="jobs")
    org = models.ForeignKey("orgs.Organization", on_delete=models.CASCADE, related_name="+")
    runner_class = models.ForeignKey(RunnerClass, null=True, on_delete=models.SET_NULL, related_name="jobs")
    github_id = models.PositiveBigIntegerField()
    run_attempt = models.PositiveIntegerField(default=1)
    run_id = models.PositiveBigIntegerField()
    repository = models.CharField(max_length=200)
    workflow = models.CharField(max_length=300, blank=True)
    name = models.CharField(max_length=300, blank=True)
    labels = models.JSONField(default=list)
    # A public repository's job: an organization runner in a group that serves private
    # repositories only (the Default group) never takes it, so its runner is a repository runner.
    public = models.BooleanField(default=False)
    status = models.CharField(max_length=16, choices=WorkflowJobStatus.choices)
    # The Catacloud job (a runner of ours) that ran it, when one did.
    job = models.ForeignKey("jobs.Job", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")

    class Meta:
        ordering = ["-seen_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["installation", "github_id", "run_attempt"], name="workflow_job_unique"
            )
        ]
        indexes = [
            # demand: WHERE runner_class_id = %s AND status = 'queued'
            models.Index(fields=["runner_class", "status"], name="workflow_job_class_status"),
        ]

    def __str__(self) -> str:
        where = f"{self.repository} {self.workflow}/{self.name}"
        return f"{where} #{self.github_id}.{self.run_attempt} ({self.status})"

    def job_labels(self) -> dict[str, object]:
        """What a runner job records about the workflow job it serves (costs by repository)."""
        return {
            "repository": self.repository,
            "workflow": self.workflow,
            "run_id": self.run_id,
            "run_attempt": self.run_attempt,
            "job_name": self.name,
            "github_job_id": self.github_id,
        }

    def event_data(self) -> dict[str, object]:
        return {
            "repository": self.repository,
            "workflow": self.workflow,
            "job_name": self.name,
            "github_job": self.github_id,
            "run_attempt": self.run_attempt,
        }


class Runner(RunnerFields):
    """A just-in-time runner: one Catacloud job (``job``) that registers one runner with
    GitHub on its machine and takes one workflow job. ``created_for`` is the workflow job whose
    queueing started it; ``workflow_job`` the one GitHub actually gave it (any queued job with
    matching labels), once known."""

    job = models.OneToOneField("jobs.Job", primary_key=True, on_delete=models.CASCADE, related_name="runner")
    installation = models.ForeignKey(GitHubInstallation, on_delete=models.CASCADE, related_name="runners")
    runner_class = models.ForeignKey(RunnerClass, on_delete=models.CASCADE, related_name="runners")
    created_for = models.ForeignKey(
        WorkflowJob, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    workflow_job = models.ForeignKey(
        WorkflowJob, null=True, blank=True, on_delete=models.SET_NULL, related_name="runners"
    )
    github_runner_id = models.PositiveBigIntegerField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return self.name or f"runner for job {self.job_id}"
