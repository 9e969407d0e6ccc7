"""Needless purchases, read back from the event log: was a machine bought while a machine the
organization already paid for could have taken its place?

The events are replayed in the order they were written. Per machine type, the replay keeps
the machines standing ready (ready and unclaimed), those booting, where each is (in a pool or
outside), and the jobs waiting for a machine. A purchase is needless when

- a job's purchase (``instance.requested``): the paid machines standing ready or booting,
  in a pool or outside, already outnumber or equal the jobs waiting;
- a pool's purchase (``pool.member_requested``): a machine outside every pool stands ready or
  boots while no waiting job needs it (the pool could have taken it instead).

Ready and booting are counted together, so the order in which two transactions' events were
written (a machine becoming ready while placement counts it as booting) cannot make a sound
purchase look needless. Used by the end-to-end tests and the ``cost`` benchmark.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

BOOTING_IN = ("instance.requested", "pool.member_requested")
READY_IN = ("instance.ready", "pool.member_warmed", "instance.released")
CLAIMED = ("instance.claimed", "pool.member_claimed")
ENDED = (
    "instance.terminating",
    "pool.member_terminated",
    "instance.terminated",
    "instance.failed",
    "instance.lost",
    "pool.member_lost",
)
LEFT_POOL = "pool.member_released"
ADOPTED = "pool.member_adopted"
WAIT_START = ("job.waiting_for_machine",)
WAIT_END = ("job.assigned", "job.finished", "job.requeued")


@dataclass
class Needless:
    event_id: Any
    kind: str
    instance_id: Any
    ready: int
    booting: int
    waiting: int


@dataclass
class _Fleet:
    state: dict[Any, str] = field(default_factory=dict)  # booting | ready | claimed | gone
    in_pool: dict[Any, bool] = field(default_factory=dict)

    def count(self, state: str, *, outside_only: bool = False) -> int:
        return sum(
            1
            for machine, s in self.state.items()
            if s == state and not (outside_only and self.in_pool.get(machine))
        )


def needless_purchases(events: Iterable[Any]) -> list[Needless]:
    """``events``: Event rows (or objects with ``id, kind, instance_id, job_id, data``) of one
    organization and machine type, in the order written (by id)."""
    fleet = _Fleet()
    waiting: set[Any] = set()
    found: list[Needless] = []
    for e in events:
        kind, machine = e.kind, e.instance_id
        admitted = kind == "job.admitted" and (e.data or {}).get("status") == "waiting_for_machine"
        if admitted or kind in WAIT_START:
            waiting.add(e.job_id)
        elif kind in WAIT_END:
            waiting.discard(e.job_id)
        elif kind in BOOTING_IN:
            in_pool = kind == "pool.member_requested"
            ready = fleet.count("ready", outside_only=in_pool)
            booting = fleet.count("booting", outside_only=in_pool)
            if (in_pool and ready + booting > len(waiting)) or (
                not in_pool and len(waiting) and ready + booting >= len(waiting)
            ):
                found.append(Needless(e.id, kind, machine, ready, booting, len(waiting)))
            fleet.state[machine], fleet.in_pool[machine] = "booting", in_pool
        elif kind in READY_IN:
            fleet.state[machine] = "ready"
            if kind == "instance.released":
                fleet.in_pool[machine] = False  # a used machine stays outside every pool
        elif kind in CLAIMED:
            fleet.state[machine] = "claimed"
        elif kind in ENDED:
            fleet.state[machine] = "gone"
        elif kind == LEFT_POOL:
            fleet.in_pool[machine] = False
        elif kind == ADOPTED:
            fleet.in_pool[machine] = True
    return found


def story(events: Iterable[Any], found: list[Needless], before: int = 40) -> str:
    """The events written before each needless purchase (kind, machine, job, data), for the
    failure message: which transaction's view made the purchase look sound."""
    rows = list(events)
    lines: list[str] = []
    for n in found:
        at = next(i for i, e in enumerate(rows) if e.id == n.event_id)
        lines.append(f"{n}:")
        for e in rows[max(0, at - before) : at + 3]:
            machine, job = str(e.instance_id or "")[:8], str(e.job_id or "")[:8]
            at_time = e.created_at.strftime("%S.%f")[:-3] if getattr(e, "created_at", None) else ""
            lines.append(f"  {e.id} {at_time} {e.kind:28} m={machine:8} j={job:8} {e.data or ''}")
    return "\n".join(lines)
