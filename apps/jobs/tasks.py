from __future__ import annotations

import logging

from celery import shared_task

from apps.jobs.scheduling import schedule

log = logging.getLogger(__name__)


@shared_task(ignore_result=True)
def schedule_task() -> None:
    """Admit and place jobs. Triggered after commit by a submit, a job's end, a machine
    becoming ready or a quota change; beat runs it as a safety net. Any number may run at
    once on any number of workers (SKIP LOCKED on jobs, row locks on grants)."""
    report = schedule()
    if report.admitted or report.assigned or report.provisioned:
        log.info(
            "scheduler: admitted %d, assigned %d, requested %d machines, %d waiting",
            report.admitted,
            report.assigned,
            report.provisioned,
            report.waiting,
        )
