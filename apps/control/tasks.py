from __future__ import annotations

import logging

from celery import shared_task

from apps.control import reaper

log = logging.getLogger(__name__)


@shared_task(ignore_result=True)
def reaper_task() -> None:
    """One reaper tick on a worker, on demand (beat runs the reaper itself: apps.control.reaper.serve)."""
    report = reaper.reaper_tick()
    if report.ran:
        log.info(
            "reaper: %d pools, %d refilled (+%d members), %d stuck, %d lost, %d schedules, "
            "%d reconcile actions in %.3fs",
            report.pools,
            report.refilled,
            report.requested,
            report.stuck,
            report.lost,
            report.schedules_applied,
            report.reconcile_actions,
            report.seconds,
        )
