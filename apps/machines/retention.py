"""Billing-aware retention of idle machines kept for reuse (the reaper's pass)."""

from __future__ import annotations

from datetime import datetime

from django.conf import settings

from apps.core.actors import Actor
from apps.core.errors import InvalidTransition
from apps.machines.choices import InstanceStatus
from apps.machines.lifecycle import instance_terminate
from apps.machines.models import MachineInstance
from catacloud.policy.billing import Billing
from catacloud.policy.retention import should_retire


def idle_machines_retire(*, now: datetime) -> int:
    """Billing-aware retention: an idle machine kept for reuse lives until just before its
    current paid period ends (every started hour on Hetzner; per second after a 60 s minimum
    on EC2), then it is destroyed. The margin covers the time between reaper ticks."""
    margin = settings.CATACLOUD_RETENTION_MARGIN
    count = 0
    idle = MachineInstance.objects.filter(pool__isnull=True, status=InstanceStatus.READY).select_related(
        "machine_type"
    )[:1000]
    for instance in idle:
        mt = instance.machine_type
        started = instance.provisioning_started_at or instance.created_at
        runtime = (now - started).total_seconds()
        billing = Billing(mt.billing_increment_seconds, mt.min_billed_seconds, mt.price_per_hour)
        outdated = instance.machine_type_version < mt.version
        if not outdated and not should_retire(
            billing=billing, runtime_seconds=runtime, margin_seconds=margin
        ):
            continue
        left = billing.seconds_left_in_paid_period(runtime)
        try:
            instance_terminate(
                instance_id=instance.pk,
                only_idle=True,  # placement or a pool may have taken it since the read above
                actor=Actor.REAPER,
                reason="outdated machine type version"
                if outdated
                else f"idle at the end of its paid period ({left:.0f}s left)",
            )
        except InvalidTransition:
            continue
        count += 1
    return count
