"""Where a job's start time went (``GET /api/v1/jobs/{id}/timing/``, ``catacloud jobs show
--timing``, the job's console page): its latest attempt, from submit (or requeue) to running,
in the stages its rows and events record, and its trace id when tracing is on (the same stages
as spans, with every statement and request under them, in the tracing backend)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from apps.core.tracing import trace_id
from apps.events.kinds import EventKind
from apps.events.models import Event
from apps.jobs.models import Job


@dataclass(frozen=True)
class Stage:
    name: str
    what: str
    ms: float | None  # None: not reached (yet)


def _ms(a: datetime | None, b: datetime | None) -> float | None:
    return round((b - a).total_seconds() * 1000, 1) if a and b and b >= a else None


def job_timing(job: Job) -> dict[str, Any]:
    """The stages of the latest attempt's start, in order, and their sum (submit -> running)."""
    delivered = (
        job.delivered_at
        if job.assigned_at and job.delivered_at and job.delivered_at >= job.assigned_at
        else None
    )
    started = (
        (
            Event.objects.filter(job_id=job.pk, kind=EventKind.JOB_STARTED, created_at__gte=job.queued_at)
            .order_by("-id")
            .values_list("data", flat=True)
            .first()
        )
        if job.started_at
        else None
    )
    agent_ms = (started or {}).get("agent_ms")
    to_started = _ms(delivered, job.started_at)
    stages = [
        Stage(
            "admission",
            "queued -> admitted: quotas, budgets, the grant's lock",
            _ms(job.queued_at, job.admitted_at),
        ),
        Stage(
            "placement",
            "admitted -> assigned: resources if any, then a machine claimed (idle, then pool)",
            _ms(job.admitted_at, job.assigned_at),
        ),
        Stage(
            "wake-up and poll",
            "assigned -> delivered: the agent woken (Redis) and its long poll answered",
            _ms(job.assigned_at, delivered) if delivered else None,
        ),
        Stage(
            "agent",
            "delivered -> started: the agent's share (received -> report sent)",
            round(float(agent_ms), 1) if agent_ms is not None and to_started is not None else None,
        ),
        Stage(
            "network and report",
            "delivered -> started less the agent's share: the answer's and the report's travel",
            round(to_started - float(agent_ms), 1)
            if agent_ms is not None and to_started is not None
            else to_started,
        ),
    ]
    if not delivered:  # an agent older than delivered_at, or a job handed off by an integration
        stages[2:] = [Stage("agent start", "assigned -> started", _ms(job.assigned_at, job.started_at))]
    total = _ms(job.queued_at, job.started_at)
    return {
        "job": str(job.pk),
        "attempt": job.attempt,
        "status": job.status,
        "submit_to_running_ms": total,
        "trace_id": trace_id(job.traceparent),
        "stages": [asdict(s) for s in stages],
        "launch": _launch(job),
    }


NETWORK_CAME = {
    "ahead": "its network made before it came",
    "at start": "its network made at its start",
    "none": "no job network on its machine",
}


def _launch(job: Job) -> dict[str, Any] | None:
    """After running: the start's confirmation -> the command launched (what of its folder,
    sandbox and network was not ready by then: the agent makes them while the start is reported),
    as its agent reported it with the outcome (``None`` until then, or from an agent that does
    not report it)."""
    if not job.started_at:
        return None
    data = (
        Event.objects.filter(job_id=job.pk, created_at__gte=job.started_at, data__has_key="launch_ms")
        .order_by("-id")
        .values_list("data", flat=True)
        .first()
    )
    if not data:
        return None
    network = str(data.get("network") or "")
    return {
        "name": "command launch",
        "what": "started -> command launched: its folder, sandbox and network (made as its start was told)"
        + (f" ({NETWORK_CAME[network]})" if network in NETWORK_CAME else ""),
        "ms": round(float(data["launch_ms"]), 1),
        "network": network,
    }
