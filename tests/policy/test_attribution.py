"""Cost attribution adds up: for random machine timelines and billing rules, the parts of a
machine sum exactly to its billed cost, none is negative, and no job pays for time it did
not hold. Pure functions: no database."""

from __future__ import annotations

from decimal import Decimal

from hypothesis import given, settings
from hypothesis import strategies as st

from catacloud.policy.attribution import IDLE, JOB, TAIL, WARM, Hold, attribute, split_micro
from catacloud.policy.billing import Billing

billings = st.builds(
    Billing,
    increment_seconds=st.sampled_from([1, 60, 3600]) | st.integers(1, 7200),
    min_billed_seconds=st.sampled_from([0, 60]) | st.integers(0, 7200),
    price_per_hour=st.decimals(min_value=0, max_value=50, places=6, allow_nan=False, allow_infinity=False),
)


@st.composite
def timelines(draw: st.DrawFn) -> tuple[float, list[Hold], float]:
    runtime = draw(st.floats(0, 4 * 86400, allow_nan=False))
    n = draw(st.integers(0, 6))
    holds = []
    for i in range(n):
        # holds may overlap, run past the end or be empty: the split must cope
        a = draw(st.floats(-10, runtime + 100, allow_nan=False))
        b = draw(st.floats(-10, runtime + 100, allow_nan=False))
        holds.append(Hold(min(a, b), max(a, b), ref=f"job-{i % 4}"))
    warm_until = draw(st.floats(0, runtime + 10, allow_nan=False))
    return runtime, holds, warm_until


def _held_seconds(holds: list[Hold], ref: str, runtime: float) -> float:
    """Seconds ``ref`` held the machine (union of its holds within the runtime)."""
    spans = sorted((max(0.0, h.start), min(runtime, h.end)) for h in holds if h.ref == ref)
    total, cursor = 0.0, 0.0
    for a, b in spans:
        a = max(a, cursor)
        if b > a:
            total += b - a
            cursor = b
    return total


@settings(max_examples=400, deadline=None)
@given(billing=billings, timeline=timelines())
def test_parts_sum_exactly_to_the_billed_cost_and_none_is_negative(billing, timeline):
    runtime, holds, warm_until = timeline
    a = attribute(billing=billing, runtime_seconds=runtime, holds=holds, warm_until=warm_until)
    assert a.cost == billing.cost(runtime)
    assert sum((p.amount for p in a.parts), Decimal(0)) == a.cost
    assert all(p.amount >= 0 for p in a.parts)
    assert sum(a.by_kind().values()) == a.cost
    assert 0 <= a.accrued <= a.cost
    # the parts tile [0, billed) without gaps or overlaps (up to the microsecond grid)
    assert abs(sum(p.seconds for p in a.parts) - a.billed_seconds) < 1e-3


@settings(max_examples=400, deadline=None)
@given(billing=billings, timeline=timelines())
def test_a_job_never_pays_for_time_it_did_not_hold(billing, timeline):
    runtime, holds, warm_until = timeline
    a = attribute(billing=billing, runtime_seconds=runtime, holds=holds, warm_until=warm_until)
    per_second = billing.price_per_hour / Decimal(3600)
    paid = a.by_ref()
    for ref in {h.ref for h in holds} | {"job-never-there"}:
        held = _held_seconds(holds, ref, runtime)
        # its seconds' share, plus at most the rounding of the cost and of the split (2 µ-units)
        ceiling = Decimal(str(held)) * per_second + Decimal("0.000002") + Decimal("0.000001") * len(holds)
        assert paid.get(ref, Decimal(0)) <= ceiling
        if held == 0:
            assert paid.get(ref, Decimal(0)) == 0


@settings(max_examples=300, deadline=None)
@given(total=st.integers(0, 10**12), weights=st.lists(st.integers(0, 10**10), max_size=12))
def test_split_is_exact_and_proportional(total, weights):
    shares = split_micro(total, weights)
    if sum(weights):
        assert sum(shares) == total
        for share, w in zip(shares, weights, strict=True):
            assert abs(share * sum(weights) - total * w) <= sum(weights)  # within one unit
            assert w or share == 0
    else:
        assert shares == [0] * len(weights)


def test_hetzner_hour_split_between_warm_two_jobs_idle_and_tail():
    # Given a pool machine billed per started hour at 0.36/h (0.0001/s): warm 600 s, job A
    # 1200 s, idle 300 s, job B 600 s, then destroyed at 2800 s
    billing = Billing(3600, 0, Decimal("0.36"))
    a = attribute(
        billing=billing,
        runtime_seconds=2800,
        holds=[Hold(600, 1800, "A"), Hold(2100, 2700, "B")],
        warm_until=600,
    )
    # Then one hour is billed and every cent of it is placed
    assert a.cost == Decimal("0.360000")
    assert a.by_ref() == {"A": Decimal("0.120000"), "B": Decimal("0.060000")}
    assert a.by_kind() == {
        JOB: Decimal("0.180000"),
        WARM: Decimal("0.060000"),
        IDLE: Decimal("0.040000"),  # 300 s between the jobs + 100 s after B
        TAIL: Decimal("0.080000"),  # 800 s of the hour never used
    }


def test_ec2_minimum_goes_to_the_tail_and_a_live_machine_accrues():
    billing = Billing(1, 60, Decimal("3.6"))  # 0.001/s, 60 s minimum
    short = attribute(billing=billing, runtime_seconds=20, holds=[Hold(5, 20, "J")])
    assert short.cost == Decimal("0.060000")
    assert short.by_ref() == {"J": Decimal("0.015000")}
    assert short.by_kind()[TAIL] == Decimal("0.040000")
    assert short.accrued == Decimal("0.020000")  # cost so far; cost is committed to 60 s


def test_a_machine_that_never_reached_the_provider_cost_nothing():
    a = attribute(billing=Billing(3600, 0, Decimal("1")), runtime_seconds=500, provisioned=False)
    assert a.cost == 0 and a.parts == ()
