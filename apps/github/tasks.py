"""Thin tasks: each takes a primary key, calls one service, and is safe to run twice."""

from __future__ import annotations

import logging
from uuid import UUID

from celery import shared_task

from apps.ci.dispatch import handoffs_inline
from apps.github.demand import class_converge
from apps.github.dispatch import runner_handoff, runner_retire
from apps.github.reconcile import installation_reconcile

log = logging.getLogger(__name__)


@shared_task(ignore_result=True)
def handoff_task(job_id: str) -> None:
    """A runner job was assigned: register its runner with GitHub, hand it to the agent."""
    outcome = runner_handoff(job_id=UUID(job_id))
    log.debug("handoff of job %s: %s", job_id, outcome)


@shared_task(ignore_result=True)
def retire_task(job_id: str) -> None:
    runner_retire(job_id=UUID(job_id))


@shared_task(ignore_result=True)
def converge_task(runner_class_id: str) -> None:
    with handoffs_inline():
        class_converge(runner_class_id=UUID(runner_class_id))


@shared_task(ignore_result=True)
def reconcile_task(installation_id: str) -> None:
    report = installation_reconcile(installation_id=UUID(installation_id))
    if any(v for k, v in report.items() if k != "skipped"):
        log.info("github reconcile %s: %s", installation_id, report)
