from __future__ import annotations

from django.db import models


class Event(models.Model):
    """An append-only record of what happened, written in the transaction of the change."""

    # No index of its own: event_org_newest below leads with org_id and serves every lookup.
    org = models.ForeignKey(
        "orgs.Organization", null=True, blank=True, on_delete=models.CASCADE, related_name="+", db_index=False
    )
    kind = models.CharField(max_length=64)
    created_at = models.DateTimeField(auto_now_add=True)
    actor = models.CharField(max_length=200, blank=True)
    reason = models.TextField(blank=True)
    pool_id = models.UUIDField(null=True, blank=True)
    instance_id = models.UUIDField(null=True, blank=True)
    job_id = models.UUIDField(null=True, blank=True)
    data = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["-id"]
        indexes = [
            # GET /events/?kind_prefix=pool: WHERE org_id = %s AND kind LIKE 'pool%' ORDER BY id DESC
            models.Index(fields=["org", "-id"], name="event_org_newest"),
            models.Index(fields=["kind"], name="event_kind", opclasses=["varchar_pattern_ops"]),
            models.Index(fields=["pool_id"], name="event_pool", condition=models.Q(pool_id__isnull=False)),
            models.Index(fields=["job_id"], name="event_job", condition=models.Q(job_id__isnull=False)),
            models.Index(
                fields=["instance_id"], name="event_instance", condition=models.Q(instance_id__isnull=False)
            ),
        ]

    def __str__(self) -> str:
        return f"{self.created_at:%Y-%m-%d %H:%M:%S} {self.kind}"
