from __future__ import annotations

import uuid
from typing import Any

from django.conf import settings
from django.core.validators import MinValueValidator
from django.db import models
from django.db.models import Exists, Q
from django.utils import timezone

from apps.core.crypto import encrypted
from apps.jobs.choices import ArtifactKind, ArtifactStatus, JobStatus, Reuse


class SecretEnvMixin:
    """``secret_env``: encrypted at rest, handed to the job by the Agent API, never returned by
    the public API (which shows only its names)."""

    secret_env_encrypted: str

    secret_env = encrypted("secret_env_encrypted", "the job's secret environment (masked in its output)")


def needs_resources(config: Any) -> Exists:
    """Whether a configuration names resource types (``config``: ``OuterRef`` to its id in a
    query: a job's ``config_id``, a configuration's ``pk``)."""
    return Exists(JobConfiguration.resource_types.through.objects.filter(jobconfiguration_id=config))


class JobConfiguration(SecretEnvMixin, models.Model):
    """A named recipe: machine type, command, env, timeout, resources, priority."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    org = models.ForeignKey("orgs.Organization", on_delete=models.CASCADE, related_name="job_configs")
    name = models.SlugField(max_length=64)
    machine_type = models.ForeignKey(
        "machines.MachineType", on_delete=models.PROTECT, related_name="job_configs"
    )
    command = models.TextField(blank=True)
    # A container image the command runs in (catacloud/agent/reference.py, normalised); "": the
    # machine's own root.
    image = models.CharField(max_length=512, blank=True)
    env = models.JSONField(default=dict, blank=True)
    # NAME: value pairs given to the job but never shown (Fernet, CATACLOUD_ENCRYPTION_KEY).
    secret_env_encrypted = models.TextField(blank=True, default="", editable=False)
    timeout_seconds = models.PositiveIntegerField(default=3600, validators=[MinValueValidator(1)])
    priority = models.IntegerField(default=0)
    max_attempts = models.PositiveIntegerField(default=3, validators=[MinValueValidator(1)])
    reuse = models.CharField(max_length=16, choices=Reuse.choices, default=Reuse.REUSE)
    resource_types = models.ManyToManyField("resources.ResourceType", blank=True, related_name="job_configs")
    artifact_retention_days = models.PositiveIntegerField(default=7)
    checkpoint_interval_seconds = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="the agent uploads the checkpoint directory this often while the job runs",
    )
    # Owned capacity first, the cloud for the burst: a job of an enrolled host type that waited
    # this long for a slot goes to this machine type instead (admitted again under its grant).
    overflow_machine_type = models.ForeignKey(
        "machines.MachineType", null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    overflow_after_seconds = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="with overflow_machine_type: seconds a job waits for a slot before it overflows",
    )
    # What a job needs ({"cpus": 4, "memory_mb": 8192, "gpus": 0}): set, its jobs may run on
    # any machine type the org is granted that has at least that, the cheapest first
    # (apps.machines.capacity); machine_type is then the cheapest fitting at save time.
    requirements = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name = "job configuration"
        ordering = ["org__slug", "name"]
        constraints = [models.UniqueConstraint(fields=["org", "name"], name="job_config_name_unique_in_org")]

    def __str__(self) -> str:
        return f"{self.org}/{self.name}"


class Job(SecretEnvMixin, models.Model):
    """One run of a configuration. Fields copied from the configuration at submit time."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    org = models.ForeignKey("orgs.Organization", on_delete=models.CASCADE, related_name="jobs")
    config = models.ForeignKey(JobConfiguration, on_delete=models.PROTECT, related_name="jobs")
    machine_type = models.ForeignKey("machines.MachineType", on_delete=models.PROTECT, related_name="jobs")
    command = models.TextField(blank=True)
    # Its configuration's image, or the one it was submitted with; and the digest its first
    # attempt resolved (every later attempt runs exactly that, whatever the tag says by then).
    image = models.CharField(max_length=512, blank=True)
    image_digest = models.CharField(max_length=80, blank=True)
    env = models.JSONField(default=dict, blank=True)
    # NAME: value pairs given to the job but never shown (Fernet, CATACLOUD_ENCRYPTION_KEY).
    secret_env_encrypted = models.TextField(blank=True, default="", editable=False)
    priority = models.IntegerField(default=0)
    timeout_seconds = models.PositiveIntegerField(default=3600)
    max_attempts = models.PositiveIntegerField(default=3)
    status = models.CharField(max_length=24, choices=JobStatus.choices, default=JobStatus.QUEUED)
    pending_reason = models.CharField(max_length=300, blank=True)
    instance = models.ForeignKey(
        "machines.MachineInstance", null=True, blank=True, on_delete=models.SET_NULL, related_name="jobs"
    )
    attempt = models.PositiveIntegerField(default=1)
    exit_code = models.IntegerField(null=True, blank=True)
    failure_reason = models.TextField(blank=True)
    # Machine-readable why, when the agent gave one (an ErrorCode: image_not_found, …).
    failure_code = models.CharField(max_length=32, blank=True)
    cancel_requested = models.BooleanField(default=False)
    # Why it was last put back in the queue: machine_lost, machine_terminated, pool_drained,
    # not_started, spot_interruption. Requeues the operator caused (terminate, drain) are
    # counted in free_requeues and do not use up max_attempts.
    requeue_reason = models.CharField(max_length=32, blank=True)
    free_requeues = models.PositiveIntegerField(default=0)
    # When the current status was entered: the reaper's deadlines count from here.
    status_changed_at = models.DateTimeField(default=timezone.now)
    # Where the job comes from, for reports (costs by repository, workflow): a GitHub runner
    # job carries {repository, workflow, run_id, job_name, ...}. Never a secret.
    labels = models.JSONField(default=dict, blank=True)
    # Not empty: the job stays queued, not admitted, with this as its pending reason (its
    # integration holds it, e.g. while GitHub is unreachable).
    hold_reason = models.CharField(max_length=300, blank=True)
    # Not empty: an integration ("github") hands the job to its machine's agent once it has
    # added what the job needs (a runner registration); until then the agent does not get it.
    handoff_by = models.CharField(max_length=32, blank=True)
    # The machine the integration handed this attempt to (the agent gets the job only when this
    # is its machine; a requeued attempt on another machine waits for a new handoff).
    handed_off_to = models.UUIDField(null=True, blank=True)
    submitted_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    queued_at = models.DateTimeField(auto_now_add=True)
    admitted_at = models.DateTimeField(null=True, blank=True)
    assigned_at = models.DateTimeField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    # When the agent's long poll was last answered with this job (assigned -> delivered: the
    # wake-up and the poll; delivered -> started: the agent and its `started` report).
    delivered_at = models.DateTimeField(null=True, blank=True)
    # The W3C traceparent of the submit (apps/core/tracing.py): every later span of this job,
    # in any process and on its machine, is in that trace. Empty when tracing is off.
    traceparent = models.CharField(max_length=64, blank=True)
    # The submit's ``Idempotency-Key`` header: a retried submit with the same key answers this
    # job instead of queueing a second one. Empty: none was sent.
    idempotency_key = models.CharField(max_length=200, blank=True, editable=False)

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["org", "idempotency_key"],
                condition=~Q(idempotency_key=""),
                name="job_idempotency_key_unique_in_org",
            )
        ]
        indexes = [
            # Scheduler: WHERE status = 'queued' ORDER BY priority DESC, queued_at FOR UPDATE SKIP LOCKED
            models.Index(
                models.F("priority").desc(),
                "queued_at",
                name="job_queue_order",
                condition=Q(status=JobStatus.QUEUED),
            ),
            models.Index(fields=["org", "machine_type", "status"], name="job_org_type_status"),
            # Reaper deadlines: WHERE status IN (…) AND status_changed_at < now() - deadline
            models.Index(fields=["status", "status_changed_at"], name="job_status_since"),
        ]

    def __str__(self) -> str:
        return f"job {self.id} ({self.status})"

    def all_secret_env(self) -> dict[str, str]:
        """What the job gets as secret env: its configuration's, then its own on top."""
        return {**self.config.secret_env, **self.secret_env}

    def event_refs(self) -> dict:
        return {"org": self.org_id, "job": self.pk, "instance": self.instance_id}


class JobLogChunk(models.Model):
    """A piece of a job's output as the agent streamed it (``seq`` makes retries harmless)."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="log_chunks")
    attempt = models.PositiveIntegerField()
    seq = models.PositiveIntegerField()
    stream = models.CharField(max_length=8, choices=[("stdout", "stdout"), ("stderr", "stderr")])
    data = models.TextField()
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["job", "attempt", "seq"]
        constraints = [models.UniqueConstraint(fields=["job", "attempt", "seq"], name="job_log_chunk_unique")]

    def __str__(self) -> str:
        return f"{self.job_id}#{self.attempt}:{self.seq}"


class Artifact(models.Model):
    """A file a job kept: an output (uploaded when the job ends) or its latest checkpoint."""

    KIND_OUTPUT = ArtifactKind.OUTPUT
    KIND_CHECKPOINT = ArtifactKind.CHECKPOINT

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="artifacts")
    org = models.ForeignKey("orgs.Organization", on_delete=models.CASCADE, related_name="+")
    kind = models.CharField(max_length=16, choices=ArtifactKind.choices)
    name = models.CharField(max_length=1000)
    size = models.BigIntegerField(default=0)
    sha256 = models.CharField(max_length=64, blank=True)
    key = models.CharField(max_length=1200, editable=False)
    status = models.CharField(
        max_length=16,
        default=ArtifactStatus.STORED,
        choices=ArtifactStatus.choices,
    )
    error = models.TextField(blank=True)
    attempt = models.PositiveIntegerField(default=1)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    expires_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["job", "kind", "name"]
        constraints = [models.UniqueConstraint(fields=["job", "kind", "name"], name="artifact_unique_name")]
        indexes = [
            # Retention: WHERE status = 'stored' AND expires_at < now()
            models.Index(
                fields=["expires_at"], name="artifact_expiry", condition=Q(status=ArtifactStatus.STORED)
            ),
        ]

    def __str__(self) -> str:
        return f"{self.job_id}/{self.kind}/{self.name}"
