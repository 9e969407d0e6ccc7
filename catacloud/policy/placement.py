"""How many new machines to buy for waiting jobs, and what to tell the jobs that wait.

Pure functions shared by the scheduler (apps/jobs/placement.py) and the cost simulator
(catacloud/simulate.py), so the simulator replays the real decisions.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

SPEED = "speed"
COST = "cost"
# How many of a configuration's latest successful runs its typical run time looks at, and what
# it is when none finished yet (long enough that the machine is not expected free soon).
RECENT_RUNS = 20
UNKNOWN_RUNTIME_SECONDS = 3600.0


def typical_runtime(recent_seconds: Iterable[float]) -> float:
    """A configuration's typical run time: the median of its latest runs (upper median for an
    even count), or UNKNOWN_RUNTIME_SECONDS when it never finished."""
    ordered = sorted(recent_seconds)
    return ordered[len(ordered) // 2] if ordered else UNKNOWN_RUNTIME_SECONDS


def free_soon(busy: Iterable[tuple[float, float]], horizon: float) -> int:
    """How many busy machines are expected free by ``horizon``: each is (its job's start, its
    configuration's typical run time), in the same clock as ``horizon``."""
    return sum(1 for started, typical in busy if started + typical <= horizon)


@dataclass(frozen=True)
class Supply:
    """What an org has of one machine type right now."""

    total: int  # live machines counted against max_instances
    coming: int  # being provisioned for jobs (not pool members), not yet ready
    busy: int  # claimed machines that will return for reuse
    free_soon: int  # of those, expected free within max_wait_seconds
    max_instances: int


def machines_to_buy(*, waiting: int, overdue: int, supply: Supply, policy: str) -> int:
    """New machines for ``waiting`` jobs that no pool or idle machine could take.

    ``speed`` buys one for every waiting job not already covered by a machine on its way.
    ``cost`` first counts on paid machines expected free within ``max_wait_seconds``; jobs
    that already waited that long (``overdue``) get a machine regardless.
    """
    need = max(0, waiting - supply.coming)
    if policy == COST and need:
        patient = max(0, waiting - overdue)
        need = min(need, overdue + max(0, patient - supply.free_soon))
    return max(0, min(need, supply.max_instances - supply.total))


def pending_reason(
    *, waiting: int, bought: int, supply: Supply, policy: str, has_pool: bool, max_wait_seconds: int
) -> str:
    """The sentence a waiting job shows (names the limit and its numbers)."""
    coming = supply.coming + bought
    if coming:
        return f"{'pool empty, ' if has_pool else ''}{coming} provisioning"
    if waiting and supply.total >= supply.max_instances:
        return f"max_instances {supply.total}/{supply.max_instances}"
    if policy == COST and supply.busy:
        return f"waiting up to {max_wait_seconds}s for one of {supply.busy} paid machines"
    return "waiting for a machine"
