from __future__ import annotations

import uuid

from django.db import models
from django.utils import timezone

from apps.core.crypto import encrypted
from apps.resources.choices import ResourceStatus, WellKind


class ResourceType(models.Model):
    """Something besides a machine that a job needs, created and destroyed by a well."""

    id = models.SlugField(max_length=64, primary_key=True)
    description = models.CharField(max_length=300, blank=True)
    well = models.CharField(max_length=32, choices=WellKind.choices)
    config = models.JSONField(default=dict, blank=True)
    max_instances = models.PositiveIntegerField(default=10)
    required_privilege = models.ForeignKey(
        "orgs.Privilege", null=True, blank=True, on_delete=models.PROTECT, related_name="resource_types"
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["id"]

    def __str__(self) -> str:
        return self.id


class ResourceInstance(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    resource_type = models.ForeignKey(ResourceType, on_delete=models.PROTECT, related_name="instances")
    org = models.ForeignKey("orgs.Organization", on_delete=models.CASCADE, related_name="resources")
    job = models.ForeignKey(
        "jobs.Job", null=True, blank=True, on_delete=models.SET_NULL, related_name="resources"
    )
    status = models.CharField(max_length=16, choices=ResourceStatus.choices, default=ResourceStatus.REQUESTED)
    external_id = models.CharField(max_length=200, blank=True)
    metadata = models.JSONField(default=dict, blank=True, help_text="what the job may read")
    secret_encrypted = models.TextField(blank=True, editable=False)
    failure_reason = models.TextField(blank=True)
    attempts = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)
    ready_at = models.DateTimeField(null=True, blank=True)
    held_at = models.DateTimeField(null=True, blank=True)
    releasing_at = models.DateTimeField(null=True, blank=True)
    destroyed_at = models.DateTimeField(null=True, blank=True)
    # When the current status was entered: the reaper's deadlines count from here.
    status_changed_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-created_at"]
        indexes = [
            models.Index(fields=["resource_type", "status"], name="resource_type_status"),
            # Reaper deadlines: WHERE status IN (…) AND status_changed_at < now() - deadline
            models.Index(fields=["status", "status_changed_at"], name="resource_status_since"),
        ]

    def __str__(self) -> str:
        return f"{self.resource_type} {self.id} ({self.status})"

    def event_refs(self) -> dict:
        return {
            "org": self.org_id,
            "job": self.job_id,
            "resource": str(self.pk),
            "resource_type": self.resource_type_id,
        }

    secret = encrypted("secret_encrypted", "what the job is handed (a token, a database's URL)")
