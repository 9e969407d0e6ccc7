"""What the CI integrations look like now, for the operator console: read only, every forge at
once (:func:`apps.ci.forge.forges`), a fixed number of grouped queries per forge whatever the
number of endpoints, classes, jobs and deliveries.

- :func:`endpoints_overview`: each endpoint (a GitHub installation, a GitLab connection): whether
  the forge answers it, the limits it ran into (our hourly request budget, the forge's rate limit,
  the pauses of the last day and why), and its webhook deliveries that went wrong.
- :func:`class_backlog`: each runner class: forge jobs waiting for a runner (and the oldest
  wait), runners starting or online, forge jobs running.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db.models import Count, Min, Q

from apps.ci.choices import Applied
from apps.ci.forge import Forge, forges
from apps.events.kinds import EventKind
from apps.events.models import Event
from apps.jobs.choices import JOB_LIVE, JobStatus

DAY = timedelta(hours=24)
# A delivery stored this long ago and still not acted on went wrong (the reaper's rule retries it).
NOT_ACTED_AFTER = timedelta(seconds=60)
# Outcomes of deliveries that arrived but ran nothing: no class covers the job's labels (or tags),
# or a status the adapter does not know.
UNMATCHED = (Applied.NOT_COVERED, Applied.UNKNOWN_STATUS)
# Why an endpoint was paused, when the reason is a limit rather than an outage (apps.ci.client).
LIMIT_WORDS = ("rate limit", "budget", "limit", "cap")
# Deliveries the forge could not hand us, found by its reconciler and sent again (GitHub only:
# GitLab's are found by its poll of pending jobs instead).
REDELIVERED = {"github": EventKind.GITHUB_REDELIVERED}
MAX_ROWS = 200


@dataclass(frozen=True)
class EndpointOverview:
    forge: str  # its title: GitHub, GitLab
    org: str
    name: str
    available: bool
    unavailable_until: datetime | None
    unavailable_reason: str
    calls_this_hour: int
    request_budget: int
    rate_remaining: int | None
    rate_reset_at: datetime | None
    reconciled_at: datetime | None
    paused_24h: int  # times it became unavailable in the last day
    limits_24h: int  # of those, because of a rate limit or our budget
    last_pause: str  # the reason of the last one
    deliveries_24h: int
    not_acted_on: int  # stored, not acted on for over a minute (any age)
    unmatched_24h: int  # acted on, ran nothing: no class covers the labels, or unknown status
    redelivered_24h: int
    limit_answers: int = 0  # limit answers the forge gave this endpoint, ever
    paced_until: datetime | None = None  # our pacing holds registrations until then
    paced_reason: str = ""

    @property
    def webhook_failures(self) -> list[str]:
        """What went wrong with its deliveries, one phrase each (none: nothing)."""
        counts = (
            (self.not_acted_on, "not acted on"),
            (self.unmatched_24h, "no class covers"),
            (self.redelivered_24h, "lost and sent again"),
        )
        return [f"{n} {what}" for n, what in counts if n]


@dataclass(frozen=True)
class ClassBacklog:
    forge: str
    org: str
    name: str
    labels: list[str]
    machine_type: str
    app_label: str  # the runner class's model, for a link to its page
    model_name: str
    pk: Any
    waiting: int  # forge jobs waiting for a runner (the class's demand)
    oldest_wait: float | None  # seconds, the longest-waiting of them
    starting: int  # our runners not online yet
    online: int  # our runners online, not given a job yet
    running: int  # forge jobs started, not done
    held: int = 0  # runner jobs held in the queue by a limit (a forge's, or our pacing below it)
    blocked_reason: str = ""  # why the class starts no runner ("" : it does)
    mode: str = ""  # GitLab: per_job | class


def _window_calls(row: Any, now: datetime) -> int:
    """Calls counted in the endpoint's current hour window (0 once that hour is over)."""
    started = row.window_started_at
    return row.window_calls if started is not None and now - started < timedelta(hours=1) else 0


def _ref_key(org_id: Any, refs: dict[str, Any]) -> tuple[Any, str]:
    return org_id, repr(sorted((k, str(v)) for k, v in refs.items()))


@dataclass
class _DayEvents:
    """The last day's events the panel counts, every forge's in one query: the reasons of each
    endpoint's pauses (newest first, by forge, org and the endpoint's event ref) and the
    deliveries each org's forge lost and sent again."""

    pauses: dict[tuple[str, Any, str], list[str]]
    redelivered: dict[tuple[str, Any], int]

    @classmethod
    def read(cls, now: datetime) -> _DayEvents:
        unavailable = {str(forge.events.unavailable): forge.name for forge in forges()}
        redelivered = {str(kind): name for name, kind in REDELIVERED.items()}
        out = cls({}, {})
        for kind, org_id, data, reason in (
            Event.objects.filter(kind__in=[*unavailable, *redelivered], created_at__gte=now - DAY)
            .order_by("-id")
            .values_list("kind", "org_id", "data", "reason")[: MAX_ROWS * 10]
        ):
            if kind in unavailable:
                refs = {k: v for k, v in (data or {}).items() if k != "until"}  # the endpoint's event_ref()
                out.pauses.setdefault((unavailable[kind], *_ref_key(org_id, refs)), []).append(reason)
            else:
                key = (redelivered[kind], org_id)
                out.redelivered[key] = out.redelivered.get(key, 0) + 1
        return out


def _deliveries(forge: Forge, now: datetime) -> dict[Any, dict[str, int]]:
    field = f"{forge.endpoint_field}_id"
    late = Q(processed_at__isnull=True, received_at__lt=now - NOT_ACTED_AFTER)
    recent = Q(received_at__gte=now - DAY)
    return {
        row[field]: row
        for row in forge.delivery.objects.filter(recent | late)
        .values(field)
        .annotate(
            total=Count("pk", filter=recent),
            late=Count("pk", filter=late),
            unmatched=Count("pk", filter=recent & Q(outcome__in=[str(o) for o in UNMATCHED])),
        )
        .order_by()
    }


def _forge_endpoints(
    forge: Forge, endpoints: list[Any], now: datetime, events: _DayEvents
) -> list[EndpointOverview]:
    budget = int(getattr(settings, forge.settings.request_budget))
    deliveries = _deliveries(forge, now) if endpoints else {}
    rows = []
    for e in endpoints:
        reasons = events.pauses.get((forge.name, *_ref_key(e.org_id, e.event_ref())), [])
        got = deliveries.get(e.pk, {})
        rows.append(
            EndpointOverview(
                forge=forge.title,
                org=e.org.slug,
                name=str(e),
                available=e.is_available(now),
                unavailable_until=None if e.is_available(now) else e.unavailable_until,
                unavailable_reason="" if e.is_available(now) else e.unavailable_reason,
                calls_this_hour=_window_calls(e, now),
                request_budget=budget,
                rate_remaining=e.rate_remaining,
                rate_reset_at=e.rate_reset_at,
                reconciled_at=e.reconciled_at,
                paused_24h=len(reasons),
                limits_24h=sum(1 for r in reasons if any(w in r.lower() for w in LIMIT_WORDS)),
                last_pause=reasons[0] if reasons else "",
                deliveries_24h=got.get("total", 0),
                not_acted_on=got.get("late", 0),
                unmatched_24h=got.get("unmatched", 0),
                # per org: GitHub's redeliveries name the connection's org, not an installation
                redelivered_24h=events.redelivered.get((forge.name, e.org_id), 0),
                limit_answers=e.limited_total,
                paced_until=e.paced_until if e.is_paced(now) else None,
                paced_reason=e.paced_reason if e.is_paced(now) else "",
            )
        )
    return rows


def endpoints_overview(*, now: datetime) -> list[EndpointOverview]:
    """Every endpoint of every forge, by forge then org."""
    found = [
        (forge, list(forge.endpoint.objects.select_related("org").order_by("org__slug", "pk")[:MAX_ROWS]))
        for forge in forges()
    ]
    if not any(endpoints for _, endpoints in found):
        return []
    events = _DayEvents.read(now)
    return [row for forge, endpoints in found for row in _forge_endpoints(forge, endpoints, now, events)]


def _forge_backlog(forge: Forge, now: datetime) -> list[ClassBacklog]:
    classes = list(
        forge.runner_class.objects.select_related("org", "machine_type").order_by("org__slug", "name")[
            :MAX_ROWS
        ]
    )
    if not classes:
        return []
    rules = forge.statuses
    jobs = {
        r["runner_class_id"]: r
        for r in forge.ci_job.objects.filter(runner_class__isnull=False)
        .filter(Q(status=rules.demand) | Q(status__in=sorted(rules.started - rules.done)))
        .values("runner_class_id")
        .annotate(
            waiting=Count("pk", filter=Q(status=rules.demand)),
            oldest=Min("seen_at", filter=Q(status=rules.demand)),
            running=Count("pk", filter=~Q(status=rules.demand)),
        )
        .order_by()
    }
    runners = {
        r["runner_class_id"]: r
        for r in forge.runner.objects.filter(job__status__in=JOB_LIVE, **forge.unbound())
        .values("runner_class_id")
        .annotate(
            starting=Count("pk", filter=Q(online_at__isnull=True)),
            online=Count("pk", filter=Q(online_at__isnull=False)),
            held=Count("pk", filter=Q(job__status=JobStatus.QUEUED) & ~Q(job__hold_reason="")),
        )
        .order_by()
    }
    meta = forge.runner_class._meta
    rows = []
    for rc in classes:
        j, r = jobs.get(rc.pk, {}), runners.get(rc.pk, {})
        oldest = j.get("oldest")
        rows.append(
            ClassBacklog(
                forge=forge.title,
                org=rc.org.slug,
                name=rc.name,
                labels=list(rc.match_labels),
                machine_type=rc.machine_type.name,
                app_label=meta.app_label,
                model_name=meta.model_name or "",
                pk=rc.pk,
                waiting=j.get("waiting", 0),
                oldest_wait=(now - oldest).total_seconds() if oldest else None,
                starting=r.get("starting", 0),
                online=r.get("online", 0),
                running=j.get("running", 0),
                held=r.get("held", 0),
                blocked_reason=rc.blocked_reason if rc.blocked_at else "",
                mode=str(getattr(rc, "runner_mode", "")),
            )
        )
    return rows


def class_backlog(*, now: datetime) -> list[ClassBacklog]:
    """Every runner class of every forge with its backlog, by forge, org and name."""
    return [row for forge in forges() for row in _forge_backlog(forge, now)]
