"""The reaper: the periodic safety net that keeps pools at their targets and the fleet honest.

It lives in the top layer because one tick drives every app's convergence.

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
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import connection
from django.utils import timezone

from apps.ci.convergence import ci_converge
from apps.core.actors import Actor
from apps.core.locks import REAPER, try_advisory_lock
from apps.jobs.acquisition import resources_safety_net
from apps.jobs.artifacts import artifacts_expire
from apps.jobs.convergence import jobs_converge
from apps.jobs.scheduler import schedule
from apps.machines.choices import InstanceStatus
from apps.machines.convergence import instances_converge
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

    pools = pools_converge(now=now, batch=BATCH)
    report.pools, report.refilled, report.requested = pools.pools, pools.refilled, pools.requested

    report.extra.update(jobs_converge(now=now))
    report.extra["retired_idle"] = idle_machines_retire(now=now)
    report.extra.update(resources_safety_net(now=now))
    report.extra["artifacts_expired"] = artifacts_expire(now=now)
    report.extra.update(ci_converge(now=now))
    scheduled = schedule()
    report.extra.update(admitted=scheduled.admitted, assigned=scheduled.assigned)
    if reconcile:
        report.reconcile_actions = sum(r.actions for r in reconcile_all())
    report.seconds = time.perf_counter() - started
    return report


def _mark_silent_lost(now: datetime) -> int:
    """Enrolled machines whose agent went silent."""
    cutoff = now - timedelta(seconds=settings.CATACLOUD_AGENT_LOST_AFTER)
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
            "reaper: %d pools, %d refilled (+%d members), %d stuck, %d lost, %d schedules, "
            "%d reconcile actions in %.3fs",
            report.pools,
            report.refilled,
            report.requested,
            report.stuck,
            report.lost,
            report.schedules_applied,
            report.reconcile_actions,
            report.seconds,
        )


def serve(interval: float, stop: threading.Event) -> None:
    """Tick every ``interval`` seconds until ``stop``: the beat process runs this in a thread of
    its own (config/celery.py), so the reaper needs neither the broker nor a worker, the two
    things whose faults it exists to repair. One tick at a time across processes (the advisory
    lock); a failing tick is logged and the next one comes all the same."""
    from django.db import close_old_connections

    while not stop.wait(interval):
        try:
            log_tick(reaper_tick())
        except Exception:
            log.exception("reaper tick failed")
        finally:
            close_old_connections()
