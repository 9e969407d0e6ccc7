"""Every hook of ``apps.core.hooks`` connected to its handler, and every forge made known to the
CI core: the one place upward calls are wired."""

from __future__ import annotations

from apps.ci import forge as ci_forge
from apps.ci.dispatch import runner_handoff_soon, runner_job_failed
from apps.core import hooks
from apps.github.forge import GITHUB
from apps.github.ops import GitHubOps
from apps.gitlab.forge import GITLAB
from apps.gitlab.ops import GitLabOps
from apps.jobs.acquisition import wake_waiting
from apps.jobs.reports import jobs_requeue_for_instance
from apps.jobs.scheduler import schedule_for_machine
from apps.jobs.selectors import jobs_waiting
from apps.pools.refill import request_refill


def connect_hooks() -> None:
    hooks.machine_available.connect(schedule_for_machine)
    hooks.machine_gone.connect(jobs_requeue_for_instance)
    hooks.pool_member_left.connect(request_refill)
    hooks.resource_slot_freed.connect(wake_waiting)
    hooks.job_needs_handoff.connect(runner_handoff_soon)
    hooks.handed_off_job_failed.connect(runner_job_failed)
    hooks.jobs_waiting.connect(jobs_waiting)
    register_forges()


def register_forges() -> None:
    """The CI core's adapters (apps.ci.forge): a runner job's ``handoff_by`` names its forge."""
    ci_forge.register(GITHUB, GitHubOps())
    ci_forge.register(GITLAB, GitLabOps())
