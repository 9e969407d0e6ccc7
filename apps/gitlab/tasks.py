"""Thin tasks: each takes a primary key, calls one service, and is safe to run twice."""

from __future__ import annotations

import logging
from uuid import UUID

from celery import shared_task

from apps.ci.demand import class_converge, converge_here
from apps.ci.dispatch import handoffs_inline, runner_handoff, runner_retire, runner_unregister
from apps.ci.reconcile import endpoint_reconcile
from apps.ci.records import converges_inline
from apps.gitlab.forge import GITLAB
from apps.gitlab.intake import delivery_resolve

log = logging.getLogger(__name__)


@shared_task(ignore_result=True)
def handoff_task(job_id: str) -> None:
    """A runner job was assigned: create its runner at GitLab, hand its token to the agent."""
    outcome = runner_handoff(forge=GITLAB, job_id=UUID(job_id))
    log.debug("handoff of job %s: %s", job_id, outcome)


@shared_task(ignore_result=True)
def retire_task(job_id: str) -> None:
    runner_retire(forge=GITLAB, job_id=UUID(job_id))


@shared_task(ignore_result=True)
def finished_task(job_id: str) -> None:
    """The CI job a runner of ours took ended: delete the runner at GitLab."""
    runner_unregister(forge=GITLAB, job_id=UUID(job_id))


@shared_task(ignore_result=True)
def converge_task(runner_class_id: str) -> None:
    with handoffs_inline():
        class_converge(forge=GITLAB, runner_class_id=UUID(runner_class_id))


@shared_task(ignore_result=True)
def reconcile_task(connection_id: str) -> None:
    report = endpoint_reconcile(forge=GITLAB, endpoint_id=UUID(connection_id))
    if any(v for k, v in report.items() if k != "skipped"):
        log.info("gitlab reconcile %s: %s", connection_id, report)


@shared_task(ignore_result=True)
def resolve_task(key: str) -> None:
    """A Job event about a job new to us, without its tags: look the job up, act on it, and
    converge its class here (apps.ci.records.converges_inline)."""
    with converges_inline() as wanted:
        delivery_resolve(key=key)
    converge_here(forge=GITLAB, runner_class_ids=wanted)
