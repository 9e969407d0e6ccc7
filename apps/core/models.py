"""Installation-wide singletons."""

from __future__ import annotations

import uuid

from django.db import models


class Installation(models.Model):
    """One row: the identity of this Catacloud installation, put on every cloud machine.

    The reconciler only ever touches machines carrying this installation's label, so two
    installations can share a cloud project safely.
    """

    id = models.PositiveSmallIntegerField(primary_key=True, default=1, editable=False)
    installation_id = models.UUIDField(default=uuid.uuid4, unique=True, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.CheckConstraint(condition=models.Q(id=1), name="installation_singleton")]

    def __str__(self) -> str:
        return str(self.installation_id)


class Heartbeat(models.Model):
    """Liveness marks: ``beat`` (beat's heartbeat task ran on a worker), ``reaper`` (the last
    reaper tick: when it ended, and in ``detail`` which process ran it, how long it took)."""

    name = models.CharField(max_length=64, primary_key=True)
    seen_at = models.DateTimeField()
    detail = models.JSONField(default=dict, blank=True)

    def __str__(self) -> str:
        return f"{self.name} @ {self.seen_at:%Y-%m-%d %H:%M:%S}"
