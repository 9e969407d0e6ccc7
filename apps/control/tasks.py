from __future__ import annotations

from celery import shared_task

from apps.control import reaper


@shared_task(ignore_result=True)
def reaper_task() -> None:
    """One reaper tick on a worker, on demand (beat runs the reaper itself: apps.control.reaper.serve)."""
    reaper.log_tick(reaper.reaper_tick())
