"""Dispatch for GitHub, through the CI core (apps.ci.dispatch): a runner job assigned to a
machine gets a just-in-time runner registration from GitHub (``catacloud-<instance id>``, the
class's labels), handed to the machine's agent as a secret (``ACTIONS_RUNNER_INPUT_JITCONFIG``);
a runner no longer needed is deleted at GitHub and its job cancelled."""

from __future__ import annotations

from apps.ci import dispatch as ci_dispatch
from apps.ci.choices import Handoff
from apps.ci.dispatch import NAME_PREFIX, instance_of, runner_name
from apps.ci.forge import RunnerId
from apps.core.ids import JobId
from apps.github.forge import GITHUB
from apps.github.ops import owner_path

__all__ = ["NAME_PREFIX", "instance_of", "owner_path", "runner_name"]


def runner_handoff(*, job_id: JobId) -> Handoff:
    """Register a just-in-time runner for the machine the job is assigned to and hand its
    configuration to the agent. Idempotent: a job already handed off (or no longer assigned)
    is left alone; a registration left by a crash is deleted and made again."""
    return ci_dispatch.runner_handoff(forge=GITHUB, job_id=job_id)


def runner_retire(*, job_id: JobId) -> Handoff:
    """A runner no longer needed: delete its registration at GitHub (refused while it runs a
    job: then it stays, bound to that job), then cancel its Catacloud job."""
    return ci_dispatch.runner_retire(forge=GITHUB, job_id=job_id)


def retire_soon(runner_pk: RunnerId) -> None:
    ci_dispatch.retire_soon(GITHUB, runner_pk)
