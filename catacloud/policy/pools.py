"""How a warm pool refills: what already stands ready for the same work is counted first.

A pool keeps ``target_size`` unclaimed members. When it is short, it first takes in machines
the organization already pays for that no job is waiting for: idle machines of its machine
type outside every pool (kept for reuse after a job, or bought for a job another machine
served), then machines of that type still booting for no job. Only the rest is bought, never
past ``max_size`` members or the grant's ``max_instances``.

A machine that ran a job stays outside the pool: jobs take it first (placement's order,
:data:`catacloud.policy.placement.ORDER`) until its paid period ends. The pool takes it in
only when the pool is short, and then it serves whoever the pool serves, an outside caller
of ``acquire`` included; a machine an outside caller held is terminated when released, never
handed to anyone else.

Pure: the refill (apps/pools/services.py) and the simulator (catacloud/simulate.py) call it.
"""

from __future__ import annotations

from dataclasses import dataclass


def adopt_preference(*, ran_a_job: bool, since: float) -> tuple[bool, float]:
    """Sort key among the machines a pool may take in (smallest first): one that never ran a
    job, then the oldest. apps/pools/services._adopt orders the same way."""
    return (ran_a_job, since)


@dataclass(frozen=True)
class RefillPlan:
    adopt_ready: int  # idle machines outside pools the pool takes in
    adopt_booting: int  # machines booting for no job the pool takes in
    buy: int  # new members bought
    wanted: int  # how many members the pool lacked
    limit: str  # why it could not get them all ("" when it could)

    @property
    def adopt(self) -> int:
        return self.adopt_ready + self.adopt_booting


def refill_plan(
    *,
    target: int,
    max_size: int,
    members: int,
    fresh: int,
    idle: int,
    booting: int,
    waiting: int,
    counted: int,
    max_instances: int,
) -> RefillPlan:
    """What a short pool takes in and buys.

    ``members``: its live members (claimed and booting included); ``fresh``: the unclaimed
    ones of the current machine type version; ``idle`` / ``booting``: the org's machines of
    the type outside every pool, ready and unclaimed / booting; ``waiting``: jobs waiting for
    a machine of the type (they take the machines outside pools first); ``counted``: every
    machine counted against ``max_instances``.
    """
    wanted = max(0, target - fresh)
    room = max(0, max_size - members)
    spare_ready = max(0, idle - waiting)
    spare_booting = max(0, booting - max(0, waiting - idle))
    adopt_ready = min(wanted, room, spare_ready)
    adopt_booting = min(wanted - adopt_ready, room - adopt_ready, spare_booting)
    adopted = adopt_ready + adopt_booting
    short = wanted - adopted
    room_quota = max(0, max_instances - counted)
    buy = min(short, room - adopted, room_quota)
    limit = ""
    if buy < short:
        limit = (
            f"pool_at_max_size: {members + adopted}/{max_size} members"
            if room - adopted <= room_quota
            else f"quota_exceeded: max_instances {counted}/{max_instances}"
        )
    return RefillPlan(adopt_ready, adopt_booting, buy, wanted, limit)
