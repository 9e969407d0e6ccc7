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
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from django.conf import settings
from django.db.models import Q

from apps.core import hooks
from apps.events.kinds import EventKind
from apps.events.models import Event
from apps.machines.models import MachineInstance, MachineType
from apps.orgs.models import Organization
from catacloud.policy.attribution import JOB, KINDS, MICRO, TAIL, Attribution, Hold, attribute
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


def billing_of(mt: MachineType) -> Billing:
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
    out = []
    for instance in rows:
        billing = billing_of(instance.machine_type)
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


def _money(value: Decimal) -> str:
    """Amounts as strings with the recorded cost's 6 decimal places (no float, no drift)."""
    return str(value.quantize(MICRO))


def cost_summary(mc: MachineCost) -> dict[str, Any]:
    a = mc.attribution
    return {
        "live": mc.live,
        "billed_seconds": a.billed_seconds,
        "runtime_seconds": round(a.runtime_seconds, 3),
        # ended: the billed cost; live: committed to the end of the current paid period
        "cost": _money(a.cost),
        "accrued": _money(a.accrued),
        "by_kind": {k: _money(v) for k, v in a.by_kind().items()},
        "jobs": {ref: _money(v) for ref, v in a.by_ref().items()},
    }


# ---- reports: GET /costs/, export_costs ----------------------------------------------------

GROUPS = ("day", "config", "pool", "machine_type", "kind", "machine", "repository", "workflow")


@dataclass(frozen=True)
class PartRow:
    """One attributed part with its place in time and its owners, for reports and exports."""

    instance_id: Any
    machine_type: str
    pool: str | None
    kind: str
    job_id: str | None
    config: str | None
    # where the job came from (a GitHub runner job's repository and workflow), else None
    repository: str | None
    workflow: str | None
    start: datetime
    end: datetime
    amount: Decimal
    live: bool


def _in_window(start: datetime, end: datetime) -> Any:
    """Machines that billed in [start, end)."""
    return MachineInstance.objects.filter(provisioning_started_at__lt=end).filter(
        Q(ended_at__isnull=True) | Q(ended_at__gte=start)
    )


def kind_totals(*, start: datetime, end: datetime, now: datetime) -> dict[str, dict[str, Decimal]]:
    """Per organization slug: the job / warm / idle / tail amounts of every part starting in
    [start, end), all organizations at once (two queries: the dashboard's idle share)."""
    totals: dict[str, dict[str, Decimal]] = defaultdict(lambda: {k: Decimal(0) for k in KINDS})
    for mc in machine_costs(_in_window(start, end).select_related("machine_type", "org"), now=now):
        if mc.start is None:
            continue
        for p in mc.attribution.parts:
            if start <= mc.start + timedelta(seconds=p.start) < end:
                totals[mc.instance.org.slug][p.kind] += p.amount
    return dict(totals)


def part_rows(*, org: Organization, start: datetime, end: datetime, now: datetime) -> list[PartRow]:
    """Every attributed part of the org's machines that starts in [start, end). A part counts
    when it starts (a tail when its machine ended, or now for a live machine)."""
    instances = (
        _in_window(start, end)
        .filter(org=org)
        .select_related("machine_type", "pool")
        .order_by("provisioning_started_at")
    )
    costs = machine_costs(instances, now=now)
    job_ids = {
        p.ref
        for mc in costs
        for p in mc.attribution.parts
        if p.kind == JOB and not p.ref.startswith("claim:")
    }
    keys: dict[str, dict[str, str | None]] = hooks.job_cost_keys(job_ids) if job_ids else {}
    rows = []
    for mc in costs:
        if mc.start is None:
            continue
        inst = mc.instance
        for p in mc.attribution.parts:
            at = mc.start + timedelta(seconds=p.start)
            if not start <= at < end:
                continue
            job_id = p.ref if p.kind == JOB and not p.ref.startswith("claim:") else None
            of_job = keys.get(job_id, {}) if job_id else {}
            rows.append(
                PartRow(
                    instance_id=inst.pk,
                    machine_type=inst.machine_type.name,
                    pool=inst.pool.name if inst.pool is not None else None,
                    kind=p.kind,
                    job_id=job_id,
                    config=of_job.get("config"),
                    repository=of_job.get("repository"),
                    workflow=of_job.get("workflow"),
                    start=at,
                    end=mc.start + timedelta(seconds=p.end),
                    amount=p.amount,
                    live=mc.live,
                )
            )
    return rows


def _key(row: PartRow, group_by: str) -> str | None:
    if group_by == "day":
        return row.start.astimezone(UTC).date().isoformat()
    if group_by == "config":
        return row.config
    if group_by == "pool":
        return row.pool
    if group_by == "machine_type":
        return row.machine_type
    if group_by == "machine":
        return str(row.instance_id)
    if group_by == "repository":
        return row.repository
    if group_by == "workflow":
        return row.workflow
    return row.kind


def cost_report(
    *, org: Organization, start: datetime, end: datetime, group_by: str, now: datetime
) -> dict[str, Any]:
    """Totals of the org's parts starting in [start, end), grouped, with the kind shares of
    every group (``config`` groups warm, idle and tail, which no configuration ran, under
    ``null``)."""
    rows = part_rows(org=org, start=start, end=end, now=now)
    groups: dict[str | None, dict[str, Decimal]] = defaultdict(lambda: {k: Decimal(0) for k in KINDS})
    totals = {k: Decimal(0) for k in KINDS}
    committed_live = Decimal(0)
    for row in rows:
        groups[_key(row, group_by)][row.kind] += row.amount
        totals[row.kind] += row.amount
        if row.live and row.kind == TAIL:
            committed_live += row.amount
    total = sum(totals.values(), Decimal(0))
    results = [
        {
            "key": key,
            "total": _money(sum(kinds.values(), Decimal(0))),
            **{k: _money(v) for k, v in kinds.items()},
        }
        for key, kinds in sorted(groups.items(), key=lambda kv: (kv[0] is None, kv[0] or ""))
    ]
    return {
        "from": start.isoformat(),
        "to": end.isoformat(),
        "group_by": group_by,
        "currency": settings.CATACLOUD_CURRENCY,
        "total": _money(total),
        "by_kind": {k: _money(v) for k, v in totals.items()},
        "shares": {k: (round(float(v / total), 4) if total else 0.0) for k, v in totals.items()},
        # of the total, what live machines committed but have not used yet (their paid tail)
        "committed_not_yet_used": _money(committed_live),
        "results": results,
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
        machines.append({"instance": str(mc.instance.pk), "amount": _money(amount), "live": mc.live})
    return {"amount": _money(total), "currency": settings.CATACLOUD_CURRENCY, "machines": machines}
