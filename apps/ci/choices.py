from __future__ import annotations

from enum import StrEnum


class Applied(StrEnum):
    """What recording one forge job did (``ci_job_apply``): a delivery's outcome, and what the
    reconciler counts as found."""

    CREATED = "created"
    MOVED = "moved"
    STALE = "stale"  # a duplicate, or older than what we know: never back
    UNKNOWN_STATUS = "unknown status"
    NOT_A_WORKFLOW_JOB = "not a workflow job"  # GitHub: no job id or run id
    NOT_A_JOB = "not a job"  # GitLab: no job id or project
    NOT_COVERED = "no runner class covers these labels"

    @property
    def found(self) -> bool:
        """New to us, or news about it."""
        return self in (Applied.CREATED, Applied.MOVED)


class Handoff(StrEnum):
    """What handing a runner to a machine, or retiring one, came to (the tasks log it)."""

    HANDED_OFF = "handed off"
    NOTHING_TO_DO = "nothing to do"
    GITHUB_UNAVAILABLE = "github unavailable"
    GITLAB_UNAVAILABLE = "gitlab unavailable"
    REFUSED = "refused"
    JOB_MOVED_ON = "job moved on"
    BUSY = "busy"
    RETIRED = "retired"
    UNREGISTERED = "unregistered"
