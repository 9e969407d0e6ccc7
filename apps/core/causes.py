"""Why a machine ended and why a job went back to the queue: one closed set.

A machine's ``end_cause`` becomes the ``requeue_reason`` of a job still on it, and the reaper
and the integrations requeue jobs for causes of their own; both are stored (32 characters at
most) and shown in events, the API and the console. Members only, never free text: a test keeps
every ``cause=`` in the code a member.
"""

from __future__ import annotations

from enum import StrEnum


class Cause(StrEnum):
    # A machine ends
    MACHINE_TERMINATED = "machine_terminated"  # an operator or the API terminated it
    MACHINE_LOST = "machine_lost"  # its agent went silent, or the cloud lost it
    CLAIM_RELEASED = "claim_released"  # the holder of an acquired machine released it
    BOOT_TIMEOUT = "boot_timeout"  # it never finished booting
    LEASE_EXPIRED = "lease_expired"  # an acquired machine's lease ran out
    POOL_DRAINED = "pool_drained"  # its pool was drained
    HOST_DRAINED = "host_drained"  # its enrolled host was cordoned, drained or revoked
    # A job goes back to the queue (besides its machine's end)
    NOT_STARTED = "not_started"  # assigned, and its agent never started it
    JOB_FINISHED = "job_finished"  # a job that had finished, found back on a live machine
    SPOT_INTERRUPTION = "spot_interruption"  # the cloud reclaims the spot machine
    GITHUB_UNAVAILABLE = "github_unavailable"  # GitHub could not hand over a runner
    GITHUB_REFUSED = "github_refused"  # GitHub refused the runner
    GITLAB_UNAVAILABLE = "gitlab_unavailable"  # GitLab could not create a runner
    GITLAB_REFUSED = "gitlab_refused"  # GitLab refused the runner
    RUNNER_OFFLINE = "runner_offline"  # the runner never came online
    HELD = "held"  # an integration holds the job back (its forge is unavailable)

    @classmethod
    def of(cls, value: str | None, default: Cause) -> Cause:
        """A stored value as a member (``default`` for an empty or unknown one)."""
        try:
            return cls(value) if value else default
        except ValueError:
            return default


# Requeues the operator or the cloud caused, not the job: they do not use up its max_attempts
# (a spot interruption is an interrupted attempt, not a failed one).
FREE_REQUEUE_CAUSES = frozenset(
    {Cause.MACHINE_TERMINATED, Cause.POOL_DRAINED, Cause.HOST_DRAINED, Cause.SPOT_INTERRUPTION}
)
