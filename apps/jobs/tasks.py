from __future__ import annotations

import logging
from uuid import UUID

from celery import Task, shared_task

from apps.core.broker import task_backoff
from apps.jobs.acquisition import job_acquire_resources
from apps.jobs.dispatch import schedule_started
from apps.jobs.scheduler import schedule
from apps.resources.wells import WellError

log = logging.getLogger(__name__)


@shared_task(ignore_result=True)
def schedule_task() -> None:
    """Admit and place jobs. Triggered after commit by a submit, a job's end, a machine
    becoming ready or a quota change; beat runs it as a safety net. Any number may run at
    once on any number of workers (SKIP LOCKED on jobs, row locks on grants)."""
    schedule_started()
    report = schedule()
    if report.admitted or report.assigned or report.provisioned:
        log.info(
            "scheduler: admitted %d, assigned %d, requested %d machines, %d waiting",
            report.admitted,
            report.assigned,
            report.provisioned,
            report.waiting,
        )


@shared_task(bind=True, max_retries=10, acks_late=True)
def acquire_resources_task(self: Task, job_id: str) -> None:
    try:
        job_acquire_resources(job_id=UUID(job_id))
    except WellError as exc:
        if exc.retryable:
            raise self.retry(countdown=task_backoff(self.request.retries)) from None
        raise
