"""Workflow jobs in, runners out, through the CI core (apps.ci.records, apps.ci.demand): GitHub
gives a runner *any* queued job whose labels it has, so each runner class is converged
level-triggered (its queued workflow jobs against its live runners not yet given a job), and
a workflow job's record moves forward only. These are the core's services for GitHub."""

from __future__ import annotations

from apps.ci import demand as ci_demand
from apps.ci.forge import RunnerClassId
from apps.ci.records import converge_soon as ci_converge_soon
from apps.github.forge import GITHUB


def converge_soon(runner_class_id: RunnerClassId) -> None:
    ci_converge_soon(GITHUB, runner_class_id)


def class_converge(*, runner_class_id: RunnerClassId) -> dict[str, int]:
    """Bring one runner class's live, unbound runners to its number of queued workflow jobs."""
    return ci_demand.class_converge(forge=GITHUB, runner_class_id=runner_class_id)


def classes_converge() -> dict[str, int]:
    return ci_demand.classes_converge(forge=GITHUB)


def erase_ended_secrets() -> int:
    return ci_demand.erase_ended_secrets(forge=GITHUB)
