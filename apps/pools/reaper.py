"""The reaper: the periodic safety net that keeps pools at their targets and the fleet honest.

Runs as a single instance (advisory lock), reads every pool's member counts in one grouped
query, and works in bounded batches:
- schedules: apply the target_size of the most recently fired schedule;
- machines past their state's deadline (apps.machines.convergence): lost provision and
  terminate tasks sent again, machines not ready in time terminated (pool members after
  warmup_grace_seconds: pool.member_stuck), expired claim leases released;
- silent agents: no heartbeat for CATACLOUD_AGENT_LOST_AFTER → lost (jobs requeued);
- pools whose counts differ from their targets (or with outdated members) → refilled;
- the providers' reconciler for every provider account in use;
- jobs and idle machines: the scheduler's safety net (retention, timeouts).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

from croniter import croniter
from django.conf import settings
from django.db import connection
from django.db.models import Count, F, Q
from django.utils import timezone

from apps.core.locks import REAPER, try_advisory_lock
from apps.machines.choices import INSTANCE_LIVE, InstanceStatus
from apps.machines.convergence import instances_converge
from apps.machines.lifecycle import instance_mark_lost
from apps.machines.models import MachineInstance
from apps.machines.reconcile import reconcile_all
from apps.pools.choices import POOL_ACTIVE
from apps.pools.models import InstancePool, PoolSchedule
from apps.pools.services import pool_refill

log = logging.getLogger(__name__)
S = InstanceStatus
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
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


def reaper_tick(*, now: datetime | None = None, reconcile: bool = True) -> TickReport:
    with try_advisory_lock(REAPER) as got:
        if not got:
            log.info("reaper: another reaper is running; skipping this tick")
            return TickReport(ran=False)
        return _tick(now or timezone.now(), reconcile)


def _tick(now: datetime, reconcile: bool) -> TickReport:
    started = time.perf_counter()
    report = TickReport()
    report.schedules_applied = apply_schedules(now=now)
    machines = instances_converge(now=now)
    report.stuck = machines.pop("stuck")
    report.extra.update(machines)
    report.lost = _mark_silent_lost(now)

    # All pools' member counts in one grouped query.
    live = Q(members__status__in=INSTANCE_LIVE) & ~Q(members__status=S.TERMINATING)
    unclaimed_fresh = (
        live
        & ~Q(members__status=S.CLAIMED)
        & Q(members__outdated=False)
        & Q(members__machine_type_version__gte=F("machine_type__version"))
    )
    rows = (
        InstancePool.objects.filter(status__in=POOL_ACTIVE)
        .annotate(
            fresh=Count("members", filter=unclaimed_fresh),
            ready=Count("members", filter=unclaimed_fresh & Q(members__status=S.READY)),
            stale=Count(
                "members",
                filter=live
                & ~Q(members__status=S.CLAIMED)
                & (
                    Q(members__outdated=True)
                    | Q(members__machine_type_version__lt=F("machine_type__version"))
                ),
            ),
        )
        .values("pk", "status", "target_size", "fresh", "ready", "stale", "limit_reason")
    )
    for row in rows:
        report.pools += 1
        converged = row["fresh"] == row["target_size"] and not row["stale"]
        status_right = (row["ready"] >= row["target_size"]) == (row["status"] == "ready")
        if converged and status_right:
            continue
        if report.refilled >= BATCH:
            break
        report.requested += pool_refill(pool_id=row["pk"], actor="reaper")
        report.refilled += 1

    report.extra.update(_jobs_safety_net(now))
    if reconcile:
        report.reconcile_actions = sum(r.actions for r in reconcile_all())
    report.seconds = time.perf_counter() - started
    return report


def _mark_silent_lost(now: datetime) -> int:
    """Enrolled machines whose agent went silent."""
    cutoff = now - timedelta(seconds=settings.CATACLOUD_AGENT_LOST_AFTER)
    silent = MachineInstance.objects.filter(
        status__in=[S.READY, S.CLAIMED], last_heartbeat_at__lt=cutoff
    ).values_list("pk", flat=True)[:BATCH]
    count = 0
    for instance_id in silent:
        if instance_mark_lost(
            instance_id=instance_id,
            actor="reaper",
            reason=f"agent silent for more than {settings.CATACLOUD_AGENT_LOST_AFTER:.0f}s",
        ):
            count += 1
    return count


def _jobs_safety_net(now: datetime) -> dict[str, Any]:
    from apps.jobs.scheduling import scheduler_safety_net

    return scheduler_safety_net(now=now)


# ---- schedules --------------------------------------------------------------------------------


def last_fire(cron: str, tz: str, now: datetime) -> datetime:
    """The most recent time ``cron`` fired at or before ``now`` (in ``tz``)."""
    local_now = now.astimezone(ZoneInfo(tz))
    return croniter(cron, local_now).get_prev(datetime)


def apply_schedules(*, now: datetime) -> int:
    """For each pool with schedules: the target_size of the most recently fired schedule
    applies once per firing (a manual change stands until the next firing)."""
    from apps.pools.services import pool_update

    applied = 0
    by_pool: dict[Any, list[PoolSchedule]] = {}
    for schedule in PoolSchedule.objects.filter(pool__status__in=POOL_ACTIVE).select_related("pool"):
        by_pool.setdefault(schedule.pool_id, []).append(schedule)
    for schedules in by_pool.values():
        pool = schedules[0].pool
        fired = []
        for s in schedules:
            try:
                fired.append((last_fire(s.cron, s.timezone, now), s))
            except (ValueError, KeyError) as exc:
                log.warning("pool %s: bad schedule %s: %s", pool.pk, s.pk, exc)
        if not fired:
            continue
        when, schedule = max(fired, key=lambda pair: pair[0])
        if pool.schedule_applied_at is not None and when <= pool.schedule_applied_at:
            continue
        target = min(max(schedule.target_size, pool.min_size), pool.max_size)
        InstancePool.objects.filter(pk=pool.pk).update(schedule_applied_at=when)
        if target != pool.target_size:
            try:
                pool_update(pool=pool, target_size=target, actor=f"schedule:{schedule.name or schedule.pk}")
            except Exception as exc:
                log.warning("pool %s: schedule not applied: %s", pool.pk, exc)
                continue
            applied += 1
    return applied


def query_count(fn: Any) -> tuple[Any, int]:
    """Run ``fn`` and count its SQL queries (benchmarks and tests)."""
    from django.test.utils import CaptureQueriesContext

    with CaptureQueriesContext(connection) as ctx:
        result = fn()
    return result, len(ctx.captured_queries)
