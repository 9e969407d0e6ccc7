"""The framework-free policy, table by table: what a provider bills, when an idle machine is
retired, how many machines the scheduler buys and what a waiting job is told. The scheduler
(apps/jobs/placement.py) and the simulator (catacloud/simulate.py) both call these."""

from __future__ import annotations

from decimal import Decimal

import pytest

from catacloud.policy import placement
from catacloud.policy.billing import Billing
from catacloud.policy.pools import refill_plan
from catacloud.policy.retention import should_retire

HETZNER = Billing(increment_seconds=3600, min_billed_seconds=0, price_per_hour=Decimal("0.0100"))
EC2 = Billing(increment_seconds=1, min_billed_seconds=60, price_per_hour=Decimal("0.3600"))


@pytest.mark.parametrize(
    ("billing", "runtime", "billed", "cost"),
    [
        (HETZNER, 0, 3600, "0.010000"),  # the first second costs an hour
        (HETZNER, 1, 3600, "0.010000"),
        (HETZNER, 3600, 3600, "0.010000"),
        (HETZNER, 3601, 7200, "0.020000"),  # a started hour is a paid hour
        (HETZNER, -5, 3600, "0.010000"),  # clock skew never bills less than one period
        (EC2, 0, 60, "0.006000"),  # the 60 s minimum
        (EC2, 59.2, 60, "0.006000"),
        (EC2, 61, 61, "0.006100"),  # then per second
        (EC2, 3600, 3600, "0.360000"),
    ],
)
def test_billing(billing: Billing, runtime: float, billed: int, cost: str) -> None:
    assert billing.billed_seconds(runtime) == billed
    assert billing.cost(runtime) == Decimal(cost)


@pytest.mark.parametrize(
    ("billing", "runtime", "margin", "retire"),
    [
        (HETZNER, 60, 90, False),  # 59 min of the paid hour left: keep it for the next job
        (HETZNER, 3500, 90, False),  # 100 s left, more than the margin
        (HETZNER, 3520, 90, True),  # 80 s left: gone before the next hour starts
        (HETZNER, 3600, 90, True),
        (HETZNER, 3700, 90, False),  # already in its second hour, which is paid: keep
        (EC2, 30, 90, True),  # per-second billing: idle time is never free past the minimum
        (EC2, 10, 5, False),  # inside the 60 s minimum, 50 s left
    ],
)
def test_retention(billing: Billing, runtime: float, margin: float, retire: bool) -> None:
    assert should_retire(billing=billing, runtime_seconds=runtime, margin_seconds=margin) is retire


def supply(
    total=0, coming=0, busy=0, free_soon=0, max_instances=10, pool_coming=0, held=0
) -> placement.Supply:
    return placement.Supply(
        total=total,
        coming=coming,
        busy=busy,
        free_soon=free_soon,
        max_instances=max_instances,
        pool_coming=pool_coming,
        held=held,
    )


@pytest.mark.parametrize(
    ("waiting", "overdue", "have", "policy", "buy"),
    [
        (3, 0, supply(), placement.SPEED, 3),  # speed: one per waiting job
        (3, 0, supply(coming=2, total=2), placement.SPEED, 1),  # machines on their way count
        (3, 0, supply(total=9), placement.SPEED, 1),  # max_instances caps it
        (3, 0, supply(total=10), placement.SPEED, 0),
        (3, 0, supply(busy=3, free_soon=3, total=3), placement.COST, 0),  # cost: wait for paid ones
        (3, 0, supply(busy=3, free_soon=1, total=3), placement.COST, 2),
        (3, 2, supply(busy=3, free_soon=3, total=3), placement.COST, 2),  # overdue jobs buy anyway
        (0, 0, supply(), placement.COST, 0),
        # paid capacity first: a booting pool member, or a ready machine another transaction
        # held when placement tried to claim it, is on its way: nothing is bought for it
        (3, 0, supply(pool_coming=2, total=2), placement.SPEED, 1),
        (3, 0, supply(held=1, coming=2, total=3), placement.SPEED, 0),  # issue 25's sixth machine
        (3, 3, supply(held=1, coming=2, total=3), placement.COST, 0),
        # cost: what is on its way serves the longest waiting first; the others wait for the
        # busy machines expected free (each counted once)
        (3, 0, supply(coming=1, busy=2, free_soon=2, total=3), placement.COST, 0),
        (3, 2, supply(coming=1, busy=2, free_soon=2, total=3), placement.COST, 1),
    ],
)
def test_machines_to_buy(waiting: int, overdue: int, have: placement.Supply, policy: str, buy: int) -> None:
    assert placement.machines_to_buy(waiting=waiting, overdue=overdue, supply=have, policy=policy) == buy


@pytest.mark.parametrize(
    ("bought", "have", "policy", "has_pool", "reason"),
    [
        (2, supply(), placement.SPEED, True, "pool empty, 2 provisioning"),
        (0, supply(coming=1), placement.SPEED, False, "1 provisioning"),
        (0, supply(total=10), placement.SPEED, False, "max_instances 10/10"),
        (0, supply(total=3, busy=3), placement.COST, False, "waiting up to 90s for one of 3 paid machines"),
        (0, supply(total=3), placement.SPEED, False, "waiting for a machine"),
        (0, supply(total=3, pool_coming=2), placement.SPEED, True, "pool empty, 2 provisioning"),
        (0, supply(total=3, held=1), placement.COST, False, "1 paid machine ready, taken at the next pass"),
    ],
)
def test_pending_reason(
    bought: int, have: placement.Supply, policy: str, has_pool: bool, reason: str
) -> None:
    said = placement.pending_reason(
        waiting=2, bought=bought, supply=have, policy=policy, has_pool=has_pool, max_wait_seconds=90
    )
    assert said == reason


@pytest.mark.parametrize(
    ("recent", "typical"),
    [
        ([], placement.UNKNOWN_RUNTIME_SECONDS),  # never finished: not expected free soon
        ([30.0], 30.0),
        ([50.0, 10.0, 30.0], 30.0),  # the median, whatever the order
        ([10.0, 20.0, 30.0, 40.0], 30.0),  # upper median for an even count
    ],
)
def test_typical_runtime(recent: list[float], typical: float) -> None:
    assert placement.typical_runtime(recent) == typical


def test_free_soon_counts_the_machines_whose_typical_run_ends_by_the_horizon() -> None:
    busy = [(0.0, 50.0), (10.0, 50.0), (0.0, placement.UNKNOWN_RUNTIME_SECONDS)]
    assert placement.free_soon(busy, horizon=55.0) == 1
    assert placement.free_soon(busy, horizon=60.0) == 2
    assert placement.free_soon([], horizon=1e9) == 0


def test_placement_takes_paid_machines_in_order_idle_then_pool() -> None:
    assert placement.ORDER == (placement.IDLE, placement.POOL)
    idle = [("other", 10.0), ("same", 30.0), ("other", 5.0)]  # (last config, idle since)
    ranked = sorted(
        idle, key=lambda m: placement.idle_preference(same_config=m[0] == "same", idle_since=m[1])
    )
    assert ranked == [("same", 30.0), ("other", 5.0), ("other", 10.0)]  # warm caches, then idle longest


def plan(**kw: int) -> tuple[int, int, int, str]:
    args = {"target": 2, "max_size": 4, "members": 0, "fresh": 0, "idle": 0, "booting": 0, "waiting": 0}
    p = refill_plan(**{**args, "counted": kw.pop("counted", 0), "max_instances": 10, **kw})
    return p.adopt_ready, p.adopt_booting, p.buy, p.limit


@pytest.mark.parametrize(
    ("given", "wanted"),
    [
        ({}, (0, 0, 2, "")),  # an empty pool buys its target
        ({"members": 2, "fresh": 2}, (0, 0, 0, "")),  # full
        ({"members": 2, "fresh": 1}, (0, 0, 1, "")),  # a member claimed: one replacement
        # an idle machine outside the pool stands ready for the same work: taken in, not bought
        ({"members": 2, "fresh": 1, "idle": 1, "counted": 3}, (1, 0, 0, "")),
        # ... unless a waiting job is about to take it
        ({"members": 2, "fresh": 1, "idle": 1, "waiting": 1, "counted": 3}, (0, 0, 1, "")),
        # a machine booting for no job (its job got another machine) is taken in too
        ({"members": 1, "fresh": 1, "booting": 2, "waiting": 1, "counted": 3}, (0, 1, 0, "")),
        ({"idle": 1, "booting": 3, "waiting": 2, "counted": 4}, (0, 2, 0, "")),
        # never past max_size (claimed members count) or max_instances
        ({"max_size": 2, "members": 2, "fresh": 1}, (0, 0, 0, "pool_at_max_size: 2/2 members")),
        ({"max_size": 2, "members": 2, "fresh": 1, "idle": 1}, (0, 0, 0, "pool_at_max_size: 2/2 members")),
        ({"counted": 10}, (0, 0, 0, "quota_exceeded: max_instances 10/10")),
        ({"counted": 9, "idle": 1}, (1, 0, 1, "")),  # taking one in costs no quota
    ],
)
def test_refill_counts_what_already_stands_ready(given: dict[str, int], wanted: tuple) -> None:
    assert plan(**given) == wanted
