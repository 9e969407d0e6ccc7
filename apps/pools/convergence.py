"""Pools' side of the reaper: schedules fired, and every pool's counts compared with its target."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from zoneinfo import ZoneInfo

from croniter import croniter
from django.db.models import Count, F, Q

from apps.core.actors import Actor
from apps.machines.choices import INSTANCE_LIVE, InstanceStatus
from apps.pools.choices import POOL_ACTIVE, PoolStatus
from apps.pools.models import InstancePool, PoolSchedule
from apps.pools.services import pool_refill, pool_update

log = logging.getLogger(__name__)


@dataclass
class PoolsConverged:
    pools: int = 0
    refilled: int = 0
    requested: int = 0


def pools_converge(*, now: datetime, batch: int = 500) -> PoolsConverged:
    """Refill every active pool whose fresh members differ from its target, whose members are
    outdated, or whose status disagrees with its ready count (at most ``batch`` pools)."""
    result = PoolsConverged()
    # All pools' member counts in one grouped query.
    live = Q(members__status__in=INSTANCE_LIVE) & ~Q(members__status=InstanceStatus.TERMINATING)
    unclaimed_fresh = (
        live
        & ~Q(members__status=InstanceStatus.CLAIMED)
        & Q(members__outdated=False)
        & Q(members__machine_type_version__gte=F("machine_type__version"))
        & ~Q(members__pool_images_version__lt=F("images_version"))
    )
    rows = (
        InstancePool.objects.filter(status__in=POOL_ACTIVE)
        .annotate(
            fresh=Count("members", filter=unclaimed_fresh),
            ready=Count("members", filter=unclaimed_fresh & Q(members__status=InstanceStatus.READY)),
            stale=Count(
                "members",
                filter=live
                & ~Q(members__status=InstanceStatus.CLAIMED)
                & (
                    Q(members__outdated=True)
                    | Q(members__machine_type_version__lt=F("machine_type__version"))
                    | Q(members__pool_images_version__lt=F("images_version"))
                ),
            ),
        )
        .values("pk", "status", "target_size", "fresh", "ready", "stale", "limit_reason")
    )
    for row in rows:
        result.pools += 1
        converged = row["fresh"] == row["target_size"] and not row["stale"]
        status_right = (row["ready"] >= row["target_size"]) == (row["status"] == PoolStatus.READY)
        if converged and status_right:
            continue
        if result.refilled >= batch:
            break
        result.requested += pool_refill(pool_id=row["pk"], actor=Actor.REAPER)
        result.refilled += 1

    return result


# ---- schedules --------------------------------------------------------------------------------


def last_fire(cron: str, tz: str, now: datetime) -> datetime:
    """The most recent time ``cron`` fired at or before ``now`` (in ``tz``)."""
    local_now = now.astimezone(ZoneInfo(tz))
    return croniter(cron, local_now).get_prev(datetime)


def apply_schedules(*, now: datetime) -> int:
    """For each pool with schedules: the target_size of the most recently fired schedule
    applies once per firing (a manual change stands until the next firing)."""
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
                pool_update(pool=pool, target_size=target, actor=Actor.schedule(schedule.name or schedule.pk))
            except Exception as exc:
                log.warning("pool %s: schedule not applied: %s", pool.pk, exc)
                continue
            applied += 1
    return applied
