"""What machines cost and who they were paid for, from rows and events already written.

A machine's timeline comes from its instance row (billing starts at
``provisioning_started_at``; it ends at ``ended_at``, or now while it lives) and from the
append-only events of that instance: each claim (``pool.member_claimed``,
``instance.claimed``, with the job it was for) opens a hold, the next release, termination
or loss closes it; ``pool.member_requested`` marks a machine born in a pool (unheld time
before its first claim is ``warm``). Nothing is written on the claim path for this: the
claim statement already inserts its event. The split itself is the pure
:func:`catacloud.policy.attribution.attribute`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any

from django.conf import settings

from apps.events.kinds import EventKind
from apps.events.models import Event
from apps.machines.models import Host, MachineInstance, MachineType
from catacloud.policy.attribution import MICRO, Attribution, Hold, attribute
from catacloud.policy.billing import Billing

CLAIM_KINDS = (EventKind.POOL_MEMBER_CLAIMED, EventKind.INSTANCE_CLAIMED)
# A hold ends at the first of these after its claim (or when the machine ends).
HOLD_END_KINDS = (
    EventKind.INSTANCE_RELEASED,
    EventKind.INSTANCE_TERMINATING,
    EventKind.POOL_MEMBER_TERMINATED,
    EventKind.INSTANCE_TERMINATED,
    EventKind.INSTANCE_FAILED,
    EventKind.INSTANCE_LOST,
    EventKind.POOL_MEMBER_LOST,
)
BORN_IN_POOL = EventKind.POOL_MEMBER_REQUESTED
LEFT_POOL = EventKind.POOL_MEMBER_RELEASED  # a drain without termination: warm ends, idle begins
_KINDS = (*CLAIM_KINDS, *HOLD_END_KINDS, BORN_IN_POOL, LEFT_POOL)


# A month's hours, for an enrolled host's monthly price (8760 / 12).
HOURS_A_MONTH = Decimal(730)


def billing_of(mt: MachineType, host: Host | None = None) -> Billing:
    """How a machine of ``mt`` is billed; a slot of an enrolled host with a monthly price is
    attributed its share of that price by the second (the type's cpus of the host's), never
    bought: Catacloud bills owned hosts by the hour to no one."""
    if host is not None and host.monthly_price is not None:
        share = Decimal(mt.cpus) / Decimal(max(1, host.cpus))
        return Billing(1, 0, host.monthly_price / HOURS_A_MONTH * share)
    return Billing(mt.billing_increment_seconds, mt.min_billed_seconds, mt.price_per_hour)


@dataclass(frozen=True)
class MachineCost:
    instance: MachineInstance
    start: datetime | None  # billing start (None: never reached the provider)
    live: bool
    attribution: Attribution


def _timeline(
    instance: MachineInstance, events: list[tuple[str, datetime, Any, dict]], end: datetime
) -> tuple[list[Hold], float]:
    start = instance.provisioning_started_at
    assert start is not None

    def age(t: datetime) -> float:
        return (t - start).total_seconds()

    holds: list[Hold] = []
    open_at: datetime | None = None
    open_ref = ""
    first_claim: datetime | None = None
    left_pool: datetime | None = None
    born_in_pool = False
    for kind, at, job_id, data in events:
        if kind == BORN_IN_POOL:
            born_in_pool = True
        elif kind == LEFT_POOL:
            left_pool = left_pool or at
        elif kind in CLAIM_KINDS:
            if open_at is not None:  # defensive: a claim without its release closes the previous hold
                holds.append(Hold(age(open_at), age(at), open_ref))
            open_at = at
            open_ref = str(job_id) if job_id else f"claim:{(data or {}).get('claim_id', '')}"
            first_claim = first_claim or at
        elif kind in HOLD_END_KINDS and open_at is not None:
            holds.append(Hold(age(open_at), age(at), open_ref))
            open_at = None
    if open_at is not None:
        holds.append(Hold(age(open_at), age(end), open_ref))
    warm_until = 0.0
    if born_in_pool:
        warm_end = min(t for t in (first_claim, left_pool, end) if t is not None)
        warm_until = max(0.0, age(warm_end))
    return holds, warm_until


def machine_costs(instances: Iterable[MachineInstance], *, now: datetime) -> list[MachineCost]:
    """Attribute each instance (``select_related("machine_type")`` them), with one query for
    all their events."""
    rows = list(instances)
    by_instance: dict[Any, list[tuple[str, datetime, Any, dict]]] = defaultdict(list)
    ids = [r.pk for r in rows if r.provisioning_started_at is not None]
    if ids:
        for instance_id, kind, at, job_id, data in (
            Event.objects.filter(instance_id__in=ids, kind__in=_KINDS)
            .order_by("created_at", "id")
            .values_list("instance_id", "kind", "created_at", "job_id", "data")
        ):
            by_instance[instance_id].append((kind, at, job_id, data))
    hosts = {h.pk: h for h in Host.objects.filter(pk__in={r.host_id for r in rows if r.host_id})}
    out = []
    for instance in rows:
        billing = billing_of(instance.machine_type, hosts.get(instance.host_id) if instance.host_id else None)
        start = instance.provisioning_started_at
        live = instance.ended_at is None
        if start is None:
            out.append(
                MachineCost(
                    instance, None, live, attribute(billing=billing, runtime_seconds=0, provisioned=False)
                )
            )
            continue
        end = instance.ended_at or now
        holds, warm_until = _timeline(instance, by_instance.get(instance.pk, []), end)
        attribution = attribute(
            billing=billing,
            runtime_seconds=(end - start).total_seconds(),
            holds=holds,
            warm_until=warm_until,
        )
        out.append(MachineCost(instance, start, live, attribution))
    return out


def instance_cost(instance: MachineInstance, *, now: datetime) -> dict[str, Any]:
    """An instance's cost for its detail view: billed (or committed), accrued, parts by kind."""
    (mc,) = machine_costs([instance], now=now)
    return cost_summary(mc)


def money(value: Decimal) -> str:
    """Amounts as strings with the recorded cost's 6 decimal places (no float, no drift)."""
    return str(value.quantize(MICRO))


def cost_summary(mc: MachineCost) -> dict[str, Any]:
    a = mc.attribution
    return {
        "live": mc.live,
        "billed_seconds": a.billed_seconds,
        "runtime_seconds": round(a.runtime_seconds, 3),
        # ended: the billed cost; live: committed to the end of the current paid period
        "cost": money(a.cost),
        "accrued": money(a.accrued),
        "by_kind": {k: money(v) for k, v in a.by_kind().items()},
        "jobs": {ref: money(v) for ref, v in a.by_ref().items()},
    }


def job_cost(job: Any, *, now: datetime) -> dict[str, Any]:
    """A job's share of every machine it held (a requeued job may have held several)."""
    instance_ids = {
        pk
        for pk in Event.objects.filter(job_id=job.pk, kind__in=CLAIM_KINDS).values_list(
            "instance_id", flat=True
        )
        if pk is not None
    }
    instances = MachineInstance.objects.filter(pk__in=instance_ids).select_related("machine_type")
    machines = []
    total = Decimal(0)
    for mc in machine_costs(instances, now=now):
        amount = mc.attribution.by_ref().get(str(job.pk), Decimal(0))
        total += amount
        machines.append({"instance": str(mc.instance.pk), "amount": money(amount), "live": mc.live})
    return {"amount": money(total), "currency": settings.CATACLOUD_CURRENCY, "machines": machines}
