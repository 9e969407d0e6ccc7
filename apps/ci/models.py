"""What every forge's records share, as abstract models: each forge keeps its own tables (GitHub's
are apps.github's, GitLab's apps.gitlab's) with these fields, and the core's services
(apps.ci.*) work on any of them through the forge's :class:`apps.ci.forge.Forge`.

- :class:`ForgeEndpoint`: what one set of credentials reaches (a GitHub App installation, a
  GitLab connection): the rate limit the forge reported, our own request budget, whether the
  forge answers, and the reconciler's claim and poll backoff.
- :class:`RunnerClassFields`: labels (tags) -> machine type, pool, timeouts, the command.
- :class:`CIJobFields`: a forge job one of the org's classes covers; moves forward only.
- :class:`RunnerFields`: a runner of ours: one Catacloud job that registers one runner.
- :class:`DeliveryFields`: a webhook delivery, stored by its idempotency key before it is
  acted on.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models
from django.utils import timezone


class ForgeEndpoint(models.Model):
    # The forge's rate limit as its last answer said.
    rate_remaining = models.IntegerField(null=True, blank=True, editable=False)
    rate_reset_at = models.DateTimeField(null=True, blank=True, editable=False)
    # Our own request budget: calls in the current hour window.
    window_started_at = models.DateTimeField(null=True, blank=True, editable=False)
    window_calls = models.PositiveIntegerField(default=0, editable=False)
    calls_total = models.PositiveBigIntegerField(default=0, editable=False)
    # Our pacing below the forge's documented per-minute and per-hour limits (apps.ci.client):
    # {window key: [window start (epoch seconds), calls or points counted]}.
    spend = models.JSONField(default=dict, blank=True, editable=False)
    # Limit answers the forge gave (primary or secondary, 403 or 429): the metric counts them.
    limited_total = models.PositiveIntegerField(default=0, editable=False)
    # Runner registrations wait (our pacing below a documented creation limit) until then; every
    # other call goes on.
    paced_until = models.DateTimeField(null=True, blank=True, editable=False)
    paced_reason = models.CharField(max_length=300, blank=True, editable=False)
    # The forge unreachable or limiting us: no call before this (runner jobs are held meanwhile).
    unavailable_until = models.DateTimeField(null=True, blank=True, editable=False)
    unavailable_reason = models.CharField(max_length=300, blank=True, editable=False)
    failures = models.PositiveIntegerField(default=0, editable=False)
    # The reconciler: when it last ran (and claimed the endpoint), and its pending-jobs poll.
    reconciled_at = models.DateTimeField(null=True, blank=True, editable=False)
    reconcile_claimed_at = models.DateTimeField(null=True, blank=True, editable=False)
    next_poll_at = models.DateTimeField(null=True, blank=True, editable=False)
    poll_interval_seconds = models.FloatField(default=0, editable=False)
    # When the reconciler last listed the forge's runners (it lists them when something of ours
    # is unaccounted for, and at least every few minutes), and when a delivery last came (at
    # most a minute stale: a delivery after a quiet spell brings the poll back to its interval).
    runners_listed_at = models.DateTimeField(null=True, blank=True, editable=False)
    last_delivery_at = models.DateTimeField(null=True, blank=True, editable=False)

    class Meta:
        abstract = True

    def is_available(self, now: datetime | None = None) -> bool:
        return self.unavailable_until is None or self.unavailable_until <= (now or timezone.now())

    def is_paced(self, now: datetime | None = None) -> bool:
        return self.paced_until is not None and self.paced_until > (now or timezone.now())

    def event_ref(self) -> dict[str, Any]:
        """What the availability events name of the endpoint (never a secret)."""
        raise NotImplementedError


class RunnerClassFields(models.Model):
    name = models.SlugField(max_length=48)
    machine_type = models.ForeignKey("machines.MachineType", on_delete=models.PROTECT, related_name="+")
    pool = models.ForeignKey(
        "pools.InstancePool", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    # Empty: the forge's default runner command.
    command = models.TextField(blank=True)
    priority = models.IntegerField(default=0)
    timeout_seconds = models.PositiveIntegerField(
        default=6 * 3600, validators=[MinValueValidator(60), MaxValueValidator(7 * 86400)]
    )
    max_attempts = models.PositiveIntegerField(default=3, validators=[MinValueValidator(1)])
    # A runner that has not come online this long after its handoff: its machine is recycled.
    online_timeout_seconds = models.PositiveIntegerField(default=180, validators=[MinValueValidator(10)])
    # A registered runner idle (no job) this long: deleted and its machine released.
    idle_timeout_seconds = models.PositiveIntegerField(default=300, validators=[MinValueValidator(10)])
    # No runner is started for the class while blocked (its runner refused to start: a version
    # the forge no longer accepts); cleared when the class changes, or by hand.
    blocked_at = models.DateTimeField(null=True, blank=True, editable=False)
    blocked_reason = models.CharField(max_length=300, blank=True, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        abstract = True

    @property
    def match_labels(self) -> list[str]:
        """The labels (GitHub) or tags (GitLab) jobs are matched against."""
        raise NotImplementedError


class CIJobFields(models.Model):
    conclusion = models.CharField(max_length=32, blank=True)
    runner_name = models.CharField(max_length=200, blank=True)
    seen_at = models.DateTimeField(auto_now_add=True)
    status_changed_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    completed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        abstract = True

    def job_labels(self) -> dict[str, object]:
        """What a runner job records about the forge job it serves (costs by repository)."""
        raise NotImplementedError

    def event_data(self) -> dict[str, object]:
        """What the job's events name of it."""
        raise NotImplementedError


class RunnerFields(models.Model):
    org = models.ForeignKey("orgs.Organization", on_delete=models.CASCADE, related_name="+")
    # Registration: asked for (the intent, committed before the call), then obtained.
    name = models.CharField(max_length=100, blank=True)
    registering_instance = models.UUIDField(null=True, blank=True)
    registering_at = models.DateTimeField(null=True, blank=True)
    registered_instance = models.UUIDField(null=True, blank=True)
    registered_at = models.DateTimeField(null=True, blank=True)
    online_at = models.DateTimeField(null=True, blank=True)
    # No longer needed (demand fell): being deleted at the forge, then its job cancelled.
    retire_requested_at = models.DateTimeField(null=True, blank=True)
    # Its deletion at the forge once it took its job, claimed by one task at a time (the job's
    # end and a reconcile's listing both ask for it): no second DELETE while one is in flight
    # or done; a claim older than a minute is a crashed task's, taken over.
    unregister_claimed_at = models.DateTimeField(null=True, blank=True)
    # Held in the queue by a limit (a registration's pacing, a runner cap) until then: the
    # reaper releases it.
    held_until = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        abstract = True


class DeliveryFields(models.Model):
    org = models.ForeignKey("orgs.Organization", on_delete=models.CASCADE, related_name="+")
    event = models.CharField(max_length=64)
    action = models.CharField(max_length=64, blank=True)
    payload = models.JSONField()
    received_at = models.DateTimeField(auto_now_add=True)
    processed_at = models.DateTimeField(null=True, blank=True)
    outcome = models.CharField(max_length=200, blank=True)

    class Meta:
        abstract = True
