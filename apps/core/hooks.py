"""Upward calls, listed in one place.

Apps import only downward (core → events → orgs → machines → pools → resources → jobs →
control). When a lower layer must trigger a higher one (a machine became ready, so the
scheduler may place a job), it calls one of the hooks below; the handlers are connected
explicitly in ``apps/control/wiring.py`` (``ControlConfig.ready``), never by signals or by
importing upward inside a function.

Each hook is declared as the signature its callers and its handler share (ids, not models:
this module imports no domain code), so mypy checks both sides: a call with a wrong argument
and a handler that does not fit are type errors. A hook called before it has a handler
raises: a missing connection is a bug, not a no-op. ``tests/core/test_hooks.py`` keeps every
hook called and handled.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, ParamSpec, TypeVar

from apps.core.causes import Cause
from apps.core.ids import InstanceId, JobId, MachineTypeId, OrgId, PoolId, ResourceTypeId

P = ParamSpec("P")
R = TypeVar("R")


class HookNotConnected(RuntimeError):
    pass


class Hook(Generic[P, R]):
    """One named extension point with exactly one handler (the layer above decides). Made
    from a stub (``@Hook def name(...) -> R: "doc"``) whose signature it keeps."""

    def __init__(self, stub: Callable[P, R]) -> None:
        self.name = stub.__name__
        self.__doc__ = stub.__doc__
        self._handler: Callable[P, R] | None = None

    def connect(self, handler: Callable[P, R]) -> Callable[P, R]:
        self._handler = handler
        return handler

    @property
    def handler(self) -> Callable[P, R] | None:
        return self._handler

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        if self._handler is None:
            raise HookNotConnected(f"hook {self.name!r} has no handler: is apps.control installed?")
        return self._handler(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<Hook {self.name}>"


# ---- the list ------------------------------------------------------------------------------


@Hook
def machine_available(*, org_id: OrgId, machine_type_id: MachineTypeId) -> None:
    """machines → jobs: a machine of this grant became ready (or ended, so one may be bought);
    the scheduler may place the grant's waiting jobs."""


@Hook
def machine_gone(*, instance_id: InstanceId, cause: Cause, detail: str = "") -> int:
    """machines → jobs: a machine ended (terminated, lost); requeue the jobs it was running with
    ``cause``. Returns how many."""
    raise NotImplementedError


@Hook
def pool_member_left(pool_id: PoolId) -> None:
    """machines → pools: a member left its pool (claimed, ended, warmed); request the pool's refill."""


@Hook
def resource_slot_freed(*, type_id: ResourceTypeId) -> None:
    """resources → jobs: a resource of this type was destroyed; jobs waiting for a slot try again."""


@Hook
def job_needs_handoff(*, job_id: JobId) -> None:
    """jobs → github: a job with ``handoff_by`` was assigned (called after commit); its
    integration hands it to the machine's agent (apps.jobs.handoff)."""


@Hook
def handed_off_job_failed(*, job_id: JobId, exit_code: int | None) -> str:
    """jobs → ci: a job an integration handed off (``handoff_by``) failed with ``exit_code``
    (inside the report's transaction); the integration may name the cause: the job's
    ``failure_code`` (an ErrorCode value), or ""."""
    raise NotImplementedError


@Hook
def jobs_waiting(*, org_id: OrgId, machine_type_id: MachineTypeId) -> int:
    """pools (refill) → jobs: how many jobs of this grant wait for a machine (they take the
    machines outside pools before a refill may take them in)."""
    raise NotImplementedError


ALL: tuple[Hook[..., Any], ...] = tuple(v for v in list(globals().values()) if isinstance(v, Hook))
