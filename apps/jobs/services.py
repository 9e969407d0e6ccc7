"""Jobs: the job state machine (admission and placement come with the scheduler)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from apps.core.transitions import change_state
from apps.jobs.choices import JOB_TERMINAL, JOB_TRANSITIONS, JobStatus
from apps.jobs.models import Job

_STAMPS = {
    JobStatus.QUEUED: "queued_at",
    JobStatus.ACQUIRING_RESOURCES: "admitted_at",
    JobStatus.ASSIGNED: "assigned_at",
    JobStatus.RUNNING: "started_at",
    **{s: "finished_at" for s in JOB_TERMINAL},
}


def job_transition(
    *,
    job_id: Any,
    to: str,
    from_: Iterable[str] | None = None,
    actor: str = "",
    reason: str = "",
    **changes: Any,
) -> Job:
    """Compare-and-set a job's status (``job.<status>`` event)."""
    return change_state(
        Job,
        job_id,
        graph=JOB_TRANSITIONS,
        to=to,
        event_prefix="job",
        from_=from_,
        stamps=_STAMPS,
        actor=actor,
        reason=reason,
        **changes,
    )
