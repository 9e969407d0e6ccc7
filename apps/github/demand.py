"""Workflow jobs in, runners out, through the CI core (apps.ci.records, apps.ci.demand): GitHub
gives a runner *any* queued job whose labels it has, so each runner class is converged
level-triggered (its queued workflow jobs against its live runners not yet given a job), and
a workflow job's record moves forward only. These are the core's services for GitHub."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from apps.ci import demand as ci_demand
from apps.ci.choices import Applied
from apps.ci.forge import RunnerClassId
from apps.ci.records import converge_soon as ci_converge_soon
from apps.github.forge import GITHUB
from apps.github.models import GitHubInstallation, WorkflowJob
from apps.github.ops import workflow_job_apply as _apply


def workflow_job_apply(
    *,
    installation: GitHubInstallation,
    job: Mapping[str, Any],
    status: str | None,
    repository: str,
    source: str,
) -> tuple[WorkflowJob | None, Applied]:
    """Record what GitHub says about one workflow job (a ``workflow_job`` delivery's
    ``workflow_job``, or a job the reconciler polled). Returns (record, outcome); the record is
    None for a job no runner class of the org covers (it is meant for other runners)."""
    return _apply(
        forge=GITHUB, installation=installation, job=job, status=status, repository=repository, source=source
    )


def converge_soon(runner_class_id: RunnerClassId) -> None:
    ci_converge_soon(GITHUB, runner_class_id)


def class_converge(*, runner_class_id: RunnerClassId) -> dict[str, int]:
    """Bring one runner class's live, unbound runners to its number of queued workflow jobs."""
    return ci_demand.class_converge(forge=GITHUB, runner_class_id=runner_class_id)


def classes_converge() -> dict[str, int]:
    return ci_demand.classes_converge(forge=GITHUB)


def erase_ended_secrets() -> int:
    return ci_demand.erase_ended_secrets(forge=GITHUB)
