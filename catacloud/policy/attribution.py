"""Cost attribution: split one machine's billed amount into who (or what) it was paid for.

A machine's billed amount (:class:`~catacloud.policy.billing.Billing`: increments, minimum)
is split, by seconds, into

- ``job``: each hold of the machine (a job from assignment to release, or an acquire's claim);
- ``warm``: time nobody held it while it was kept warm in a pool, before its first claim;
- ``idle``: every other unheld second (its boot before a first job, kept for reuse between
  jobs, being terminated);
- ``tail``: the unused end of its last paid period (and of a minimum), paid but not lived.

Money is split in micro-units (6 decimal places, like the recorded ``cost``) by the largest
remainder method, so the parts of a machine always sum exactly to its billed cost, no part is
negative, and a part never gets more than its seconds' share plus one micro-unit. A live
machine is attributed up to now: ``cost`` is then what it has committed to the end of its
current paid period and ``accrued`` what the seconds it has lived cost so far.

Pure: the server (``apps/machines/costs.py``) and ``catacloud simulate`` both use it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from decimal import Decimal

from catacloud.policy.billing import Billing

JOB, WARM, IDLE, TAIL = "job", "warm", "idle", "tail"
KINDS = (JOB, WARM, IDLE, TAIL)

MICRO = Decimal("0.000001")
_US = 1_000_000  # timeline resolution: microseconds


@dataclass(frozen=True)
class Hold:
    """Someone held the machine from ``start`` to ``end`` (seconds since billing started)."""

    start: float
    end: float
    ref: str = ""  # the job id, or a claim's label


@dataclass(frozen=True)
class Part:
    kind: str  # job | warm | idle | tail
    ref: str  # the hold's ref for job parts, "" otherwise
    start: float  # seconds since billing started
    end: float
    amount: Decimal

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Attribution:
    runtime_seconds: float  # billing start to end (or to now, for a live machine)
    billed_seconds: int
    cost: Decimal  # billed cost; for a live machine, committed to the end of its paid period
    accrued: Decimal  # what the lived seconds cost (== cost minus the tail's share, rounded)
    parts: tuple[Part, ...]

    def by_kind(self) -> dict[str, Decimal]:
        out = {kind: Decimal(0) for kind in KINDS}
        for part in self.parts:
            out[part.kind] += part.amount
        return out

    def by_ref(self) -> dict[str, Decimal]:
        """Amount per job part ref (a job held a machine maybe more than once)."""
        out: dict[str, Decimal] = defaultdict(Decimal)
        for part in self.parts:
            if part.kind == JOB:
                out[part.ref] += part.amount
        return dict(out)


def _segments(
    runtime_us: int, holds: list[tuple[int, int, str]], warm_until_us: int
) -> list[tuple[str, str, int, int]]:
    """Cover [0, runtime) with non-overlapping (kind, ref, start, end) segments."""
    out: list[tuple[str, str, int, int]] = []

    def gap(start: int, end: int) -> None:
        if start >= end:
            return
        cut = min(max(warm_until_us, start), end)
        if cut > start:
            out.append((WARM, "", start, cut))
        if end > cut:
            out.append((IDLE, "", cut, end))

    cursor = 0
    for start, end, ref in sorted(holds):
        start, end = max(start, cursor), min(end, runtime_us)
        if end <= start:
            continue  # empty, past the end, or wholly inside an earlier hold: no double count
        gap(cursor, start)
        out.append((JOB, ref, start, end))
        cursor = end
    gap(cursor, runtime_us)
    return out


def split_micro(total: int, weights: list[int]) -> list[int]:
    """Split ``total`` micro-units in proportion to ``weights`` (largest remainder): exact
    sum, nothing negative, a zero weight gets zero, each share within one unit of its quota."""
    whole = sum(weights)
    if whole <= 0 or total <= 0:
        return [0] * len(weights)
    shares = [total * w // whole for w in weights]
    left = total - sum(shares)
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(total * weights[i] % whole), i))
    for i in by_remainder[:left]:
        shares[i] += 1
    return shares


def attribute(
    *,
    billing: Billing,
    runtime_seconds: float,
    holds: list[Hold] | tuple[Hold, ...] = (),
    warm_until: float = 0.0,
    provisioned: bool = True,
) -> Attribution:
    """Attribute one machine's billed cost.

    ``runtime_seconds``: from billing start (``provisioning_started_at``) to its end, or to
    now for a live machine. ``holds``: who held it when (clipped to the runtime; overlaps are
    counted once, for the earlier hold). ``warm_until``: unheld time before this age is
    ``warm`` (a pool member before its first claim), after it ``idle``. A machine that never
    reached the provider (``provisioned=False``) cost nothing.
    """
    runtime = max(0.0, runtime_seconds)
    if not provisioned:
        return Attribution(runtime, 0, Decimal("0.000000"), Decimal("0.000000"), ())
    billed = billing.billed_seconds(runtime)
    cost = billing.cost(runtime)
    billed_us = billed * _US
    runtime_us = min(round(runtime * _US), billed_us)
    raw = _segments(
        runtime_us,
        [(round(h.start * _US), round(h.end * _US), h.ref) for h in holds],
        round(warm_until * _US),
    )
    if billed_us > runtime_us:
        raw.append((TAIL, "", runtime_us, billed_us))
    amounts = split_micro(int(cost / MICRO), [end - start for _, _, start, end in raw])
    parts = tuple(
        Part(kind, ref, start / _US, end / _US, Decimal(amount) * MICRO)
        for (kind, ref, start, end), amount in zip(raw, amounts, strict=True)
    )
    tail = sum((p.amount for p in parts if p.kind == TAIL), Decimal(0))
    return Attribution(runtime, billed, cost, (cost - tail).quantize(MICRO), parts)


def first_period_cost(billing: Billing) -> Decimal:
    """What buying one machine commits at once: its first paid period (or minimum)."""
    return billing.cost(0)
