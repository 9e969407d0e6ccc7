"""Part 5: one reaper tick over N pools x 20 members at steady state (nothing to do).

Pools and members are inserted directly in their converged state (every pool ready with
target_size ready members, agents heartbeating). Time and SQL query count of
``reaper_tick(reconcile=False)`` at 100 pools and at 1,000 pools: the count must not grow.
"""

from __future__ import annotations

import time
from typing import Any

from benchmarks.harness import Figure, PartResult, Progress, analyze, median, say, tenant
from testkit.builders import bulk_create, ready_instance


def _add_pools(t: Any, start: int, count: int, members: int) -> None:
    from datetime import timedelta

    from django.utils import timezone

    from apps.pools.models import InstancePool

    now = timezone.now()
    pools = InstancePool.objects.bulk_create(
        InstancePool(
            org=t.org,
            name=f"p{i}",
            machine_type=t.machine_type,
            status="ready",
            target_size=members,
            min_size=0,
            max_size=members,
        )
        for i in range(start, start + count)
    )
    bulk_create(
        (
            ready_instance(
                t.machine_type,
                pool=pool,
                now=now,
                ready_at=now + timedelta(microseconds=j),
                provider_id=f"r-{pool.pk}-{j}",
            )
            for pool in pools
            for j in range(members)
        ),
        batch_size=5000,
    )


def _measure(runs: int, progress: Progress, pools: int) -> dict[str, Any]:
    from django.utils import timezone

    from apps.control.reaper import query_count, reaper_tick
    from apps.machines.models import MachineInstance

    analyze("machines_machineinstance", "pools_instancepool")
    MachineInstance.objects.update(last_heartbeat_at=timezone.now())  # agents are alive
    reaper_tick(reconcile=False)  # warm caches
    seconds, refilled = [], 0
    for r in range(runs):
        progress(f"reaper: {pools} pools, tick {r + 1}/{runs}")
        t0 = time.perf_counter()
        report = reaper_tick(reconcile=False)
        seconds.append(time.perf_counter() - t0)
        refilled += report.refilled
    report, queries = query_count(lambda: reaper_tick(reconcile=False))
    return {
        "seconds": median(seconds),
        "all": seconds,
        "queries": queries,
        "pools_seen": report.pools,
        "refilled": refilled + report.refilled,
    }


def run(
    *, sizes: tuple[int, int] = (100, 1000), members: int = 20, runs: int = 3, progress: Progress = say
) -> PartResult:
    result = PartResult(part="reaper", title="Reaper tick at steady state")
    t = tenant("reaper", max_pool_size=members)
    small, large = sizes
    progress(f"reaper: inserting {small} pools x {members} members")
    _add_pools(t, 0, small, members)
    at_small = _measure(runs, progress, small)
    progress(
        f"reaper: inserting {large - small} more pools ({large} x {members} = {large * members} members)"
    )
    _add_pools(t, small, large - small, members)
    at_large = _measure(runs, progress, large)
    result.data = {
        "members": members,
        "small": small,
        "large": large,
        "at_small": at_small,
        "at_large": at_large,
    }
    grow = at_large["queries"] / at_small["queries"] if at_small["queries"] else float("nan")
    result.figures += [
        Figure(
            f"tick at {large} pools x {members}",
            round(at_large["seconds"], 3),
            "s",
            "<= 1 s",
            f"{small} pools: {at_small['seconds']:.3f} s",
            round(at_large["seconds"] / at_small["seconds"], 2) if at_small["seconds"] else None,
            at_large["seconds"] <= 1,
        ),
        Figure(
            f"SQL queries per tick at {large} pools",
            at_large["queries"],
            "queries",
            f"same as at {small} pools",
            f"{small} pools: {at_small['queries']}",
            round(grow, 2),
            at_large["queries"] <= at_small["queries"],
        ),
        Figure(
            "pools refilled during steady-state ticks",
            at_large["refilled"] + at_small["refilled"],
            "",
            "0",
            met=at_large["refilled"] + at_small["refilled"] == 0,
        ),
    ]
    return result
