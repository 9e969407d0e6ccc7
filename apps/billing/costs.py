"""Cost reports: every cent of an organization's machines attributed (a job's share, warm,
idle, tail) and grouped the way the people who pay the bill ask (day, job configuration, pool,
machine type, kind, machine, repository, workflow): ``GET /api/v1/costs/``, ``manage.py
export_costs`` and the console's charts. A machine's own cost and its split come from
:mod:`apps.machines.costs`; what a job was (its configuration, the repository and workflow
of a GitHub runner job) from :func:`apps.jobs.selectors.job_cost_keys`, read directly: this
app sits above both.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from django.conf import settings
from django.db.models import Q

from apps.jobs.selectors import job_cost_keys
from apps.machines.costs import machine_costs, money
from apps.machines.models import MachineInstance
from apps.orgs.models import Organization
from catacloud.policy.attribution import JOB, KINDS, TAIL

GROUPS = (
    "day",
    "config",
    "pool",
    "machine_type",
    "kind",
    "machine",
    "repository",
    "workflow",
    "owner",
    "payer",
)
# ``owner``: who owns the machine a part was paid on: an enrolled host of the user's (its monthly
# price attributed by the second) or a machine bought from a provider.
OWNED, BOUGHT = "owned", "bought"
# ``payer``: whose cloud account the machine was bought on: the operator's, or the
# organization's own (apps/machines/owned.py), which its cloud bills directly.
OPERATOR, ORGANIZATION = "operator", "organization"
PAYERS = (OPERATOR, ORGANIZATION)


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
    owned: bool = False  # a slot of an enrolled host
    payer: str = OPERATOR  # whose cloud account paid: the operator's or the organization's own


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
    keys = job_cost_keys(job_ids) if job_ids else {}
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
                    owned=inst.host_id is not None,
                    payer=ORGANIZATION if inst.machine_type.org_id is not None else OPERATOR,
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
    if group_by == "owner":
        return OWNED if row.owned else BOUGHT
    if group_by == "payer":
        return row.payer
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
    payers = {p: Decimal(0) for p in PAYERS}
    committed_live = Decimal(0)
    for row in rows:
        groups[_key(row, group_by)][row.kind] += row.amount
        totals[row.kind] += row.amount
        payers[row.payer] += row.amount
        if row.live and row.kind == TAIL:
            committed_live += row.amount
    total = sum(totals.values(), Decimal(0))
    results = [
        {
            "key": key,
            "total": money(sum(kinds.values(), Decimal(0))),
            **{k: money(v) for k, v in kinds.items()},
        }
        for key, kinds in sorted(groups.items(), key=lambda kv: (kv[0] is None, kv[0] or ""))
    ]
    return {
        "from": start.isoformat(),
        "to": end.isoformat(),
        "group_by": group_by,
        "currency": settings.CATACLOUD_CURRENCY,
        "total": money(total),
        "by_kind": {k: money(v) for k, v in totals.items()},
        # whose cloud account paid: the operator's, or the organization's own (billed to it directly)
        "by_payer": {p: money(v) for p, v in payers.items()},
        "shares": {k: (round(float(v / total), 4) if total else 0.0) for k, v in totals.items()},
        # of the total, what live machines committed but have not used yet (their paid tail)
        "committed_not_yet_used": money(committed_live),
        "results": results,
    }
