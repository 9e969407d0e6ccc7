"""The reaper: the periodic safety net that keeps pools at their targets and the fleet honest.

It lives in the top layer because one tick drives every app's convergence.

Runs as a single instance (advisory lock), reads every pool's member counts in one grouped
query, and works in bounded batches:
- schedules: apply the target_size of the most recently fired schedule;
- machines past their state's deadline (apps.machines.convergence): lost provision and
  terminate tasks sent again, machines not ready in time terminated (pool members after
  warmup_grace_seconds: pool.member_stuck), expired claim leases released;
- silent agents: no heartbeat for CATACLOUD_AGENT_LOST_AFTER → lost (jobs requeued). Silence
  counts only while the control plane listened: when the ticks stopped for longer than half
  the lost rule past their interval (PostgreSQL restarted, every worker and beat down, a
  restore from a backup), heartbeats could not be recorded either, so the clock restarts at
  the first tick after (``listening_since``);
- pools whose counts differ from their targets (or with outdated members) → refilled;
- the providers' reconciler for every provider account in use;
- jobs and idle machines: the scheduler's safety net (retention, timeouts).

What a rule re-drives (a row whose message was lost) it repairs itself through a ``Repairs``
(apps/core/repairs.py), never by sending the message again through the broker that lost it.
Every tick that ran is recorded (the ``reaper`` heartbeat row: /readyz and the metrics read
it), timed (``catacloud_reaper_tick_seconds``) and logged in one INFO line. The loop that ticks
is elected among every worker and beat (apps/control/election.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from apps.ci.convergence import ci_converge
from apps.core.actors import Actor
from apps.core.locks import REAPER, try_advisory_lock
from apps.core.models import Heartbeat
from apps.core.repairs import InlineRepairs, Repairs
from apps.jobs.acquisition import resources_safety_net
from apps.jobs.artifacts import artifacts_expire
from apps.jobs.convergence import jobs_converge
from apps.jobs.scheduler import schedule
from apps.machines.choices import InstanceStatus
from apps.machines.convergence import instances_converge
from apps.machines.hostops import host_drain_due, hosts_lost
from apps.machines.lifecycle import instance_mark_lost
from apps.machines.models import MachineInstance
from apps.machines.reconcile import reconcile_all
from apps.machines.retention import idle_machines_retire
from apps.pools.convergence import apply_schedules, pools_converge

log = logging.getLogger(__name__)
BATCH = 500


@dataclass
class TickReport:
    ran: bool = True
    pools: int = 0
    refilled: int = 0
    requested: int = 0
    stuck: int = 0
    lost: int = 0
    schedules_applied: int = 0
    reconcile_actions: int = 0
    repairs: int = 0
    seconds: float = 0.0
    by: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


REPAIR_KEYS = (
    "redriven_provision",
    "redriven_terminate",
    "destroying",
    "acquiring",
)


def reaper_tick(
    *,
    now: datetime | None = None,
    reconcile: bool = True,
    repairs: Repairs | None = None,
    by: str = "",
) -> TickReport:
    """One tick, if no other runs now (an advisory lock). ``repairs``: where re-drives run (by
    default at once, in this thread); ``by``: who ticks (recorded with the tick)."""
    with try_advisory_lock(REAPER) as got:
        if not got:
            log.info("reaper: another reaper is running; skipping this tick")
            return TickReport(ran=False)
        report = _tick(now or timezone.now(), reconcile, repairs or InlineRepairs())
    report.by = by
    _record(report)
    return report


def _tick(now: datetime, reconcile: bool, repairs: Repairs) -> TickReport:
    started = time.perf_counter()
    report = TickReport()
    listening = listening_since(now)
    report.schedules_applied = apply_schedules(now=now)
    machines = instances_converge(now=now, repairs=repairs)
    report.stuck = machines.pop("stuck")
    report.extra.update(machines)
    report.lost = _mark_silent_lost(now, listening)
    report.extra["hosts_lost"] = hosts_lost(now=now, listening_since=listening)
    report.extra["host_slots_drained"] = host_drain_due(now=now)
    _listened(now, listening)  # here, not with the tick's record: a later step may fail

    pools = pools_converge(now=now, batch=BATCH)
    report.pools, report.refilled, report.requested = pools.pools, pools.refilled, pools.requested

    report.extra.update(jobs_converge(now=now))
    report.extra["retired_idle"] = idle_machines_retire(now=now)
    report.extra.update(resources_safety_net(now=now, repairs=repairs))
    report.extra["artifacts_expired"] = artifacts_expire(now=now)
    report.extra.update(ci_converge(now=now))
    scheduled = schedule()
    report.extra.update(admitted=scheduled.admitted, assigned=scheduled.assigned)
    if reconcile:
        report.reconcile_actions = sum(r.actions for r in reconcile_all())
    report.repairs = sum(report.extra.get(k, 0) for k in REPAIR_KEYS)
    report.seconds = time.perf_counter() - started
    return report


# Buckets of catacloud_reaper_tick_seconds (apps/control/metrics.py).
TICK_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def _record(report: TickReport) -> None:
    """The tick is seen: the ``reaper`` heartbeat row holds its end, who ran it, how long it
    took, and the histogram of every tick's duration (so any web process serves the metric,
    whichever process ticked: apps/control/metrics.py)."""
    with transaction.atomic():
        row, _ = Heartbeat.objects.select_for_update().get_or_create(
            name="reaper", defaults={"seen_at": timezone.now()}
        )
        old = row.detail or {}
        buckets = old.get("buckets") or []
        if len(buckets) != len(TICK_BUCKETS):
            buckets, old = [0] * len(TICK_BUCKETS), {}
        buckets = [n + (report.seconds <= bound) for n, bound in zip(buckets, TICK_BUCKETS, strict=True)]
        row.seen_at = timezone.now()
        row.detail = {
            "by": report.by,
            "seconds": round(report.seconds, 4),
            "repairs": report.repairs,
            "count": int(old.get("count", 0)) + 1,
            "sum": float(old.get("sum", 0.0)) + report.seconds,
            "buckets": buckets,
        }
        row.save(update_fields=["seen_at", "detail"])


# The heartbeat row where each tick's lost rule records when it ran and since when it listened.
LISTENING = "reaper-listening"


def listening_since(now: datetime) -> datetime:
    """Since when the control plane has listened to its agents without a break: the previous
    lost rule's value, or ``now`` when that rule last ran more than an interval plus half of
    CATACLOUD_AGENT_LOST_AFTER ago (or never). A break that long means the database, or every
    process that ticks, was gone, so heartbeats were not recorded either; a shorter one adds
    at most half the lost rule to an agent's silence."""
    row = Heartbeat.objects.filter(name=LISTENING).values_list("seen_at", "detail").first()
    if row is None:
        return now
    last, detail = row
    since = (detail or {}).get("since")
    break_after = settings.CATACLOUD_REAPER_INTERVAL + settings.CATACLOUD_AGENT_LOST_AFTER / 2
    if since is None or (now - last).total_seconds() > break_after:
        return now
    return min(now, datetime.fromisoformat(since))


def _listened(now: datetime, since: datetime) -> None:
    Heartbeat.objects.update_or_create(
        name=LISTENING, defaults={"seen_at": now, "detail": {"since": since.isoformat()}}
    )


def _mark_silent_lost(now: datetime, listening: datetime | None = None) -> int:
    """Enrolled machines whose agent went silent for CATACLOUD_AGENT_LOST_AFTER while we listened."""
    cutoff = now - timedelta(seconds=settings.CATACLOUD_AGENT_LOST_AFTER)
    if listening is not None and listening > cutoff:  # None: judge alone (the fleet bench)
        return 0  # not listened long enough to call anyone silent
    silent = MachineInstance.objects.filter(
        status__in=[InstanceStatus.READY, InstanceStatus.CLAIMED], last_heartbeat_at__lt=cutoff
    ).values_list("pk", flat=True)[:BATCH]
    count = 0
    for instance_id in silent:
        if instance_mark_lost(
            instance_id=instance_id,
            actor=Actor.REAPER,
            reason=f"agent silent for more than {settings.CATACLOUD_AGENT_LOST_AFTER:.0f}s",
        ):
            count += 1
    return count


def query_count(fn: Any) -> tuple[Any, int]:
    """Run ``fn`` and count its SQL queries (benchmarks and tests)."""
    from django.test.utils import CaptureQueriesContext

    with CaptureQueriesContext(connection) as ctx:
        result = fn()
    return result, len(ctx.captured_queries)


def log_tick(report: TickReport) -> None:
    """One line per tick that ran (a skipped one logged its reason already)."""
    if report.ran:
        log.info(
            "reaper: tick in %.3fs%s: %d pools, %d refilled (+%d members), %d stuck, %d lost, "
            "%d schedules, %d repairs, %d reconcile actions",
            report.seconds,
            f" by {report.by}" if report.by else "",
            report.pools,
            report.refilled,
            report.requested,
            report.stuck,
            report.lost,
            report.schedules_applied,
            report.repairs,
            report.reconcile_actions,
        )
