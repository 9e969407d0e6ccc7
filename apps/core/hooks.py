"""Upward calls, listed in one place.

Apps import only downward (core → events → orgs → machines → pools → resources → jobs →
control). When a lower layer must trigger a higher one (a machine became ready, so the
scheduler may place a job), it calls one of the hooks below; the handlers are connected
explicitly in ``apps/control/apps.py`` (``ControlConfig.ready``), never by signals or by
importing upward inside a function.

A hook called before it has a handler raises: a missing connection is a bug, not a no-op.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class HookNotConnected(RuntimeError):
    pass


class Hook:
    """One named extension point with exactly one handler (the layer above decides)."""

    def __init__(self, name: str, doc: str) -> None:
        self.name = name
        self.__doc__ = doc
        self._handler: Callable[..., Any] | None = None

    def connect(self, handler: Callable[..., Any]) -> Callable[..., Any]:
        self._handler = handler
        return handler

    @property
    def handler(self) -> Callable[..., Any] | None:
        return self._handler

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._handler is None:
            raise HookNotConnected(f"hook {self.name!r} has no handler: is apps.control installed?")
        return self._handler(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<Hook {self.name}>"


# ---- the list ------------------------------------------------------------------------------

record_event = Hook(
    "record_event",
    "core.transitions → events: append the event a state change produces, in its transaction.",
)
machine_available = Hook(
    "machine_available",
    "machines → jobs: a machine became ready (or free again); the scheduler may place a job.",
)
machine_gone = Hook(
    "machine_gone",
    "machines → jobs: a machine ended (terminated, lost); requeue the job it was running, "
    "called with instance=, cause=, detail=.",
)
pool_member_left = Hook(
    "pool_member_left",
    "machines → pools: a member left its pool (claimed, ended, warmed); request the pool's refill.",
)
resource_slot_freed = Hook(
    "resource_slot_freed",
    "resources → jobs: a resource of type_id= was destroyed; jobs waiting for a slot try again.",
)
job_cost_keys = Hook(
    "job_cost_keys",
    "machines (cost reports) → jobs: {job id: {config, repository, workflow}} for a set of job ids.",
)
job_needs_handoff = Hook(
    "job_needs_handoff",
    "jobs → github: a job with handoff_by was assigned (after commit, job_id=); its integration "
    "hands it to the machine's agent (apps.jobs.handoff).",
)
jobs_waiting = Hook(
    "jobs_waiting",
    "pools (refill) → jobs: how many jobs of org_id= and machine_type_id= wait for a machine "
    "(they take the machines outside pools before a refill may take them in).",
)
jobs_to_cancel = Hook(
    "jobs_to_cancel",
    "machines (agent heartbeat) → jobs: the ids of jobs on this instance its agent must kill.",
)

ALL: tuple[Hook, ...] = tuple(v for v in list(globals().values()) if isinstance(v, Hook))
