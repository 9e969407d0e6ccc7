"""Where a waiting job runs, how many new machines to buy for waiting jobs, and what to tell
the jobs that wait.

The rule is *paid capacity first*: a job takes a machine the organization already pays for
before anything is bought, in :data:`ORDER`: an idle machine kept for reuse (the one that last
ran the same configuration first, then the one idle longest: :func:`idle_preference`), then a
warm pool member; a machine is bought only for the jobs that neither these, nor the machines
already booting, nor (policy ``cost``) the busy machines expected free soon can serve.

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


# Where placement looks for a machine, in order, before it buys one.
IDLE = "idle"  # a ready machine outside every pool, kept for reuse while its paid period lasts
POOL = "pool"  # a ready member of one of the org's active pools of the machine type
ORDER = (IDLE, POOL)


def idle_preference(*, same_config: bool, idle_since: float) -> tuple[bool, float]:
    """Sort key among idle machines (smallest first): the one that last ran the job's own
    configuration (warm caches), then the one idle longest. apps/machines/claims.IDLE_SQL
    orders the same way."""
    return (not same_config, idle_since)


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
    """What an org has of one machine type right now, once the waiting jobs took every ready
    machine they could."""

    total: int  # live machines counted against max_instances
    coming: int  # booting outside pools (bought for jobs), not yet ready
    busy: int  # machines running reusable jobs: they come back for reuse
    free_soon: int  # of those, expected free within max_wait_seconds
    max_instances: int
    # booting pool members: a waiting job takes one the moment it is ready
    pool_coming: int = 0
    # ready and unclaimed, yet not taken: another transaction held the row at that instant
    # (a heartbeat, the commit that made it ready). Paid and about to be free: never bought
    # around, the job gets it at the next pass.
    held: int = 0

    @property
    def on_the_way(self) -> int:
        """Paid machines a waiting job will get without anything bought."""
        return self.coming + self.pool_coming + self.held


def machines_to_buy(*, waiting: int, overdue: int, supply: Supply, policy: str) -> int:
    """New machines for ``waiting`` jobs that no idle machine or pool member could take.

    ``speed`` buys one for every waiting job not already covered by a paid machine on its way
    (booting, or ready but held by another transaction this instant). ``cost`` also counts on
    busy machines expected free within ``max_wait_seconds``; jobs that already waited that
    long (``overdue``) get a machine regardless.
    """
    need = max(0, waiting - supply.on_the_way)
    if policy == COST and need:
        # The machines on their way serve the jobs that waited longest (the overdue ones)
        # first; the rest wait for busy machines that free up soon.
        overdue_left = min(need, max(0, overdue - supply.on_the_way))
        need = overdue_left + max(0, need - overdue_left - supply.free_soon)
    return max(0, min(need, supply.max_instances - supply.total))


def pending_reason(
    *, waiting: int, bought: int, supply: Supply, policy: str, has_pool: bool, max_wait_seconds: int
) -> str:
    """The sentence a waiting job shows (names the limit and its numbers)."""
    coming = supply.coming + supply.pool_coming + bought
    if coming:
        return f"{'pool empty, ' if has_pool else ''}{coming} provisioning"
    if supply.held:
        return f"{supply.held} paid machine{'s' if supply.held > 1 else ''} ready, taken at the next pass"
    if waiting and supply.total >= supply.max_instances:
        return f"max_instances {supply.total}/{supply.max_instances}"
    if policy == COST and supply.busy:
        return f"waiting up to {max_wait_seconds}s for one of {supply.busy} paid machines"
    return "waiting for a machine"
