from __future__ import annotations

import uuid
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import croniter
from django.core.exceptions import ValidationError
from django.db import models
from django.db.models import F, Q

from apps.pools.choices import PoolStatus


class InstancePool(models.Model):
    """Keeps ``target_size`` warm instances of one machine type for one org."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    org = models.ForeignKey("orgs.Organization", on_delete=models.CASCADE, related_name="pools")
    name = models.SlugField(max_length=64)
    description = models.CharField(max_length=300, blank=True)
    machine_type = models.ForeignKey("machines.MachineType", on_delete=models.PROTECT, related_name="pools")
    status = models.CharField(max_length=16, choices=PoolStatus.choices, default=PoolStatus.WARMING)
    target_size = models.PositiveIntegerField(default=1)
    min_size = models.PositiveIntegerField(default=0)
    max_size = models.PositiveIntegerField(default=1)
    warmup_grace_seconds = models.PositiveIntegerField(default=600)
    # Container images every member pulls before it is ready (normalised references); a change
    # bumps images_version, and members told an older list are replaced like outdated ones.
    images = models.JSONField(default=list, blank=True)
    images_version = models.PositiveIntegerField(default=1, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    drained_at = models.DateTimeField(null=True, blank=True)
    # Why the last refill could not reach target_size ("" when it could); events only on change.
    limit_reason = models.CharField(max_length=200, blank=True, editable=False)
    # When a schedule last set target_size (manual changes stand until the next firing).
    schedule_applied_at = models.DateTimeField(null=True, blank=True, editable=False)
    # Set by the claim statement itself when it takes a member (and no refill is pending yet),
    # with a NOTIFY; the refill listener clears it and enqueues the refill. The claim path
    # thus needs no broker round trip; the reaper refills whatever was missed.
    refill_requested_at = models.DateTimeField(null=True, blank=True, editable=False)

    class Meta:
        ordering = ["org__slug", "name"]
        indexes = [
            # Refill listener's sweep: WHERE refill_requested_at IS NOT NULL
            models.Index(
                fields=["refill_requested_at"],
                name="pool_refill_requested",
                condition=Q(refill_requested_at__isnull=False),
            ),
        ]
        constraints = [
            models.UniqueConstraint(fields=["org", "name"], name="pool_name_unique_in_org"),
            models.CheckConstraint(
                condition=Q(min_size__lte=F("target_size")) & Q(target_size__lte=F("max_size")),
                name="pool_sizes_ordered",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.org}/{self.name}"

    def event_refs(self) -> dict:
        return {"org": self.org_id, "pool": self.pk}


class PoolSchedule(models.Model):
    """Raise or lower a pool's ``target_size`` on a cron schedule (before a known burst)."""

    pool = models.ForeignKey(InstancePool, on_delete=models.CASCADE, related_name="schedules")
    name = models.CharField(max_length=100, blank=True)
    cron = models.CharField(max_length=100, help_text="e.g. '0 8 * * 1-5'")
    timezone = models.CharField(max_length=64, default="UTC")
    target_size = models.PositiveIntegerField()
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["pool", "id"]

    def __str__(self) -> str:
        return f"{self.pool}: {self.cron} ({self.timezone}) -> {self.target_size}"

    def clean(self) -> None:
        """A schedule the reaper can fire: a valid cron expression and a known time zone."""
        errors = {}
        if not croniter.is_valid(self.cron):
            errors["cron"] = f"{self.cron!r} is not a cron expression (e.g. '0 8 * * 1-5')"
        try:
            ZoneInfo(self.timezone)
        except (ZoneInfoNotFoundError, ValueError):
            errors["timezone"] = f"unknown time zone {self.timezone!r} (e.g. 'Europe/Berlin')"
        if errors:
            raise ValidationError(errors)
