"""The operator dashboard's figures: one snapshot of the fleet, read from the database.

Every section is one grouped query (or two; the CI panel a few per forge: apps.ci.selectors),
whatever the number of pools, jobs, machines, connections and runner classes,
so the page costs the same with 3 pools or 300 and any web process serves the same figures
(nothing comes from one process's memory). ``dashboard_snapshot`` returns plain values; the
view renders them (and the SVG charts) server-side.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from django.conf import settings
from django.db.models import (
    Avg,
    Count,
    DurationField,
    ExpressionWrapper,
    F,
    Max,
    Min,
    OuterRef,
    Q,
    QuerySet,
    Subquery,
    Sum,
)
from django.db.models.functions import Coalesce, TruncMinute
from django.urls import reverse
from django.utils import timezone

from apps.billing.budgets import spend_grouped, spend_grouped_and_own
from apps.billing.costs import kind_totals
from apps.ci.selectors import class_backlog, endpoints_overview
from apps.events.kinds import EventKind
from apps.events.models import Event
from apps.jobs.choices import JOB_ADMITTED, JobStatus
from apps.jobs.models import Job
from apps.machines.budgets import period_start
from apps.machines.choices import INSTANCE_COUNTED, INSTANCE_LIVE, InstanceStatus
from apps.machines.models import Budget, MachineInstance, OrgMachineType
from apps.pools.choices import PoolStatus
from apps.pools.models import InstancePool

# Live member states in the order a pool's bar shows them (left to right).
MEMBER_STATES = (
    InstanceStatus.READY,
    InstanceStatus.CLAIMED,
    InstanceStatus.WARMING,
    InstanceStatus.PROVISIONING,
    InstanceStatus.PENDING,
    InstanceStatus.TERMINATING,
)
WAITING = (JobStatus.QUEUED, JobStatus.ACQUIRING_RESOURCES, JobStatus.WAITING_FOR_MACHINE)
# What the "recent failures and requeues" list shows: the events an operator acts on.
TROUBLE_KINDS = (
    EventKind.JOB_REQUEUED,
    EventKind.INSTANCE_FAILED,
    EventKind.INSTANCE_LOST,
    EventKind.INSTANCE_INTERRUPTED,
    EventKind.POOL_MEMBER_STUCK,
    EventKind.POOL_MEMBER_LOST,
    EventKind.ARTIFACT_UPLOAD_FAILED,
    EventKind.BUDGET_EXHAUSTED,
    EventKind.RESOURCE_FAILED,
)
MAX_POOLS = 100
MAX_GRANTS = 200
MAX_TROUBLE = 25
WINDOW = timedelta(hours=1)


@dataclass
class PoolBar:
    id: Any
    name: str
    org: str
    machine_type: str
    status: str
    target: int
    min: int
    max: int
    limit_reason: str
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def live(self) -> int:
        return sum(self.counts.values())

    @property
    def segments(self) -> list[tuple[str, int, float]]:
        """(state, count, percent of the bar's scale) for each state present, left to right."""
        scale = max(self.max, self.live, 1)
        return [
            (s, self.counts[s], 100.0 * self.counts[s] / scale) for s in MEMBER_STATES if self.counts.get(s)
        ]

    @property
    def target_pct(self) -> float:
        """Where the target sits on the bar, in percent (the bar ends at max, or at the live
        count when it is over max)."""
        return 100.0 * self.target / max(self.max, self.live, 1)

    @property
    def min_pct(self) -> float:
        return 100.0 * self.min / max(self.max, self.live, 1)


def _pools() -> list[PoolBar]:
    pools = {
        p.pk: PoolBar(
            id=p.pk,
            name=p.name,
            org=p.org.slug,
            machine_type=p.machine_type.name,
            status=p.status,
            target=p.target_size,
            min=p.min_size,
            max=p.max_size,
            limit_reason=p.limit_reason,
        )
        for p in InstancePool.objects.exclude(status=PoolStatus.DRAINED)
        .select_related("org", "machine_type")
        .order_by("org__slug", "name")[:MAX_POOLS]
    }
    rows = (
        MachineInstance.objects.filter(pool_id__in=list(pools), status__in=INSTANCE_LIVE)
        .values_list("pool_id", "status")
        .annotate(n=Count("id"))
        .order_by()
    )
    for pool_id, status, n in rows:
        pools[pool_id].counts[status] = n
    return list(pools.values())


def _queue(now: datetime) -> list[dict[str, Any]]:
    rows = (
        Job.objects.filter(status__in=WAITING)
        .values("status", "pending_reason")
        .annotate(n=Count("id"), oldest=Min("queued_at"))
        .order_by("oldest")
    )
    return [
        {
            "status": r["status"],
            "reason": r["pending_reason"] or "not looked at yet",
            "count": r["n"],
            "oldest_wait": (now - r["oldest"]).total_seconds(),
        }
        for r in rows
    ]


def grants_with_usage(qs: QuerySet[OrgMachineType]) -> QuerySet[OrgMachineType]:
    """Annotate grants with what is in use now (the scheduler counts the same way): admitted
    jobs, counted machines, the largest max_size of its pools. One query, any number of rows."""

    def count(model: Any, statuses: Any) -> Any:
        rows = (
            model.objects.filter(
                org_id=OuterRef("org_id"), machine_type_id=OuterRef("machine_type_id"), status__in=statuses
            )
            .order_by()
            .values("org_id")
            .annotate(n=Count("id"))
            .values("n")
        )
        return Coalesce(Subquery(rows), 0)

    biggest = (
        InstancePool.objects.filter(org_id=OuterRef("org_id"), machine_type_id=OuterRef("machine_type_id"))
        .exclude(status=PoolStatus.DRAINED)
        .order_by()
        .values("org_id")
        .annotate(n=Max("max_size"))
        .values("n")
    )
    return qs.annotate(
        used_jobs=count(Job, list(JOB_ADMITTED)),
        used_machines=count(MachineInstance, list(INSTANCE_COUNTED)),
        biggest_pool=Coalesce(Subquery(biggest), 0),
    )


def grant_usage(grant: OrgMachineType) -> list[dict]:
    """The usage rows of a grant annotated by :func:`grants_with_usage`."""
    return quota_usage(
        grant=grant,
        running_jobs=grant.used_jobs,  # type: ignore[attr-defined]  # annotated by grants_with_usage
        instances=grant.used_machines,  # type: ignore[attr-defined]
        biggest_pool=grant.biggest_pool,  # type: ignore[attr-defined]
    )


def _quotas() -> list[dict[str, Any]]:
    grants = grants_with_usage(
        OrgMachineType.objects.select_related("org", "machine_type").order_by(
            "org__slug", "machine_type__name"
        )
    )[:MAX_GRANTS]
    return [
        {"org": g.org.slug, "machine_type": g.machine_type.name, "grant_id": g.pk, "usage": grant_usage(g)}
        for g in grants
    ]


def quota_usage(*, grant: OrgMachineType, running_jobs: int, instances: int, biggest_pool: int) -> list[dict]:
    """``[{name, used, limit, percent}]`` for every limit of a grant (None limit: unlimited)."""
    mt = grant.machine_type
    rows = [
        ("jobs", running_jobs, grant.max_concurrent_jobs, ""),
        ("machines", instances, grant.max_instances, ""),
        ("pool size", biggest_pool, grant.max_pool_size, ""),
        ("cpu", running_jobs * mt.cpus, grant.cpu_quota, ""),
        ("memory", running_jobs * mt.memory_mb, grant.memory_quota_mb, " MiB"),
        ("gpu", running_jobs * mt.gpus, grant.gpu_quota, ""),
    ]
    out = []
    for name, used, limit, unit in rows:
        if limit is None and name in ("cpu", "memory", "gpu") and not used:
            continue
        percent = min(100.0, 100.0 * used / limit) if limit else (100.0 if used else 0.0)
        out.append({"name": name, "used": used, "limit": limit, "unit": unit, "percent": percent})
    return out


def _machines() -> dict[str, Any]:
    rows = (
        MachineInstance.objects.filter(status__in=INSTANCE_LIVE)
        .values_list("provider_account__kind", "provider_account__name", "status")
        .annotate(n=Count("id"))
        .order_by()
    )
    by_provider: dict[tuple[str, str], dict[str, int]] = defaultdict(dict)
    for kind, name, status, n in rows:
        by_provider[(kind, name)][status] = n
    states = [s for s in InstanceStatus if s in INSTANCE_LIVE]  # in their lifecycle's order
    return {
        "states": states,
        "rows": [
            {
                "kind": kind,
                "account": name,
                "counts": [counts.get(s, 0) for s in states],
                "total": sum(counts.values()),
            }
            for (kind, name), counts in sorted(by_provider.items())
        ],
        "totals": [sum(counts.get(s, 0) for counts in by_provider.values()) for s in states],
    }


def _trouble(now: datetime) -> list[dict[str, Any]]:
    """Recent failures and requeues: trouble events and jobs that ended failed or timed out."""
    since = now - WINDOW
    rows = (
        Event.objects.filter(created_at__gte=since)
        .filter(
            Q(kind__in=TROUBLE_KINDS)
            | Q(kind=EventKind.JOB_FINISHED, data__status__in=[JobStatus.FAILED, JobStatus.TIMED_OUT])
        )
        .exclude(data__contains={"restart": True})  # local machines that ended with the previous `make dev`
        .select_related("org")
        .order_by("-id")[:MAX_TROUBLE]
    )
    return [
        {
            "at": e.created_at,
            "kind": e.kind if e.kind != EventKind.JOB_FINISHED else f"job.{e.data.get('status')}",
            "org": e.org.slug if e.org is not None else "",
            "job_id": e.job_id,
            "instance_id": e.instance_id,
            "pool_id": e.pool_id,
            "reason": e.reason,
        }
        for e in rows
    ]


def _series(now: datetime) -> dict[str, Any]:
    """Per minute over the last hour: jobs finished (by outcome), jobs submitted, and the
    wait (queued → started) of the jobs that started, mean and longest."""
    since = (now - WINDOW).replace(second=0, microsecond=0)
    minutes = [since + timedelta(minutes=i) for i in range(61)]
    finished: defaultdict[datetime, dict[str, int]] = defaultdict(
        lambda: {"succeeded": 0, "failed": 0, "cancelled": 0}
    )
    for minute, status, n in (
        Job.objects.filter(finished_at__gte=since)
        .annotate(m=TruncMinute("finished_at"))
        .values_list("m", "status")
        .annotate(n=Count("id"))
        .order_by()
    ):
        # a cancel is someone's decision, not a failure (failed and timed out are)
        outcome = status if status in (JobStatus.SUCCEEDED, JobStatus.CANCELLED) else "failed"
        finished[minute][outcome] += n
    submitted = dict(
        Job.objects.filter(created_at__gte=since)
        .annotate(m=TruncMinute("created_at"))
        .values_list("m")
        .annotate(n=Count("id"))
        .order_by()
    )
    wait = ExpressionWrapper(F("started_at") - F("queued_at"), output_field=DurationField())
    waits = {
        m: (mean.total_seconds(), longest.total_seconds())
        for m, mean, longest in Job.objects.filter(started_at__gte=since)
        .annotate(m=TruncMinute("started_at"), w=wait)
        .values_list("m")
        .annotate(mean=Avg("w"), longest=Max("w"))
        .order_by()
    }
    return {
        "minutes": minutes,
        "succeeded": [finished[m]["succeeded"] for m in minutes],
        "failed": [finished[m]["failed"] for m in minutes],
        "cancelled": [finished[m]["cancelled"] for m in minutes],
        "submitted": [submitted.get(m, 0) for m in minutes],
        "wait_mean": [waits.get(m, (0.0, 0.0))[0] for m in minutes],
        "wait_max": [waits.get(m, (0.0, 0.0))[1] for m in minutes],
    }


def _costs(now: datetime) -> dict[str, Any]:
    """Per org: spent + committed today and this month (the budgets' rule), the budgets, and
    what the live fleet costs per hour."""
    day = spend_grouped(since=period_start("day", now), now=now)
    month, month_own = spend_grouped_and_own(since=period_start("month", now), now=now)
    # What the live fleet costs per hour, and how many of its machines are idle right now
    # outside pools (kept for reuse while their paid period lasts).
    fleet = {
        org: (rate, idle)
        for org, rate, idle in MachineInstance.objects.filter(
            status__in=INSTANCE_LIVE, provisioning_started_at__isnull=False
        )
        .values_list("org__slug")
        .annotate(
            rate=Sum("machine_type__price_per_hour"),
            idle=Count("id", filter=Q(status=InstanceStatus.READY, pool__isnull=True)),
        )
        .order_by()
    }
    burn = {org: rate for org, (rate, _) in fleet.items()}
    budgets = defaultdict(list)
    for b in Budget.objects.select_related("org", "machine_type").order_by("org__slug", "period"):
        spent = month if b.period == "month" else day
        used = sum(
            (
                v
                for (org, mt), v in spent.items()
                if org == b.org.slug and (b.machine_type is None or mt == b.machine_type.name)
            ),
            Decimal(0),
        )
        budgets[b.org.slug].append(
            {
                "scope": b.machine_type.name if b.machine_type is not None else "all types",
                "period": b.period,
                "amount": b.amount,
                "used": used,
                "percent": min(100.0, float(100 * used / b.amount)) if b.amount else 100.0,
            }
        )
    # Where the last hour's money went (catacloud.policy.attribution), per org: idle (paid, no
    # job on it) and tail (paid, never lived: the unused end of an ended machine's last paid
    # period; a live machine's rest of its period is not spent yet, and may still run a job).
    kinds = kind_totals(start=now - WINDOW, end=now, now=now)
    orgs = sorted({org for org, _ in day} | {org for org, _ in month} | set(burn) | set(budgets) | set(kinds))
    rows = [
        {
            "org": org,
            "today": sum((v for (o, _), v in day.items() if o == org), Decimal(0)),
            "month": sum((v for (o, _), v in month.items() if o == org), Decimal(0)),
            # of it, what the organization's own cloud accounts paid (its cloud bills it)
            "month_own": month_own.get(org) or Decimal(0),
            "per_hour": burn.get(org) or Decimal(0),
            "idle_share": _share(kinds.get(org), "idle"),
            "tail_share": _share(kinds.get(org), "tail"),
            "idle_now": fleet[org][1] if org in fleet else 0,
            "budgets": budgets.get(org, []),
        }
        for org in orgs
    ]
    return {"currency": settings.CATACLOUD_CURRENCY, "rows": rows}


def _share(kinds: dict[str, Decimal] | None, kind: str) -> float | None:
    """``kind``'s share of the total (None: nothing billed)."""
    total = sum((kinds or {}).values(), Decimal(0))
    return float(kinds[kind] / total) if kinds and total else None


def _ci(now: datetime) -> dict[str, Any]:
    """The CI integrations: each endpoint's availability, limits and webhook failures, and each
    runner class's backlog (apps.ci.selectors)."""
    classes = [
        (c, reverse(f"admin:{c.app_label}_{c.model_name}_change", args=[c.pk]))
        for c in class_backlog(now=now)
    ]
    return {"endpoints": endpoints_overview(now=now), "classes": classes}


def dashboard_snapshot(*, now: datetime | None = None) -> dict[str, Any]:
    now = now or timezone.now()
    return {
        "now": now,
        "pools": _pools(),
        "queue": _queue(now),
        "quotas": _quotas(),
        "machines": _machines(),
        "trouble": _trouble(now),
        "series": _series(now),
        "costs": _costs(now),
        "ci": _ci(now),
    }
