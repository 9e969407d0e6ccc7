"""The Celery app. Settings come from Django settings under the ``CELERY_`` namespace."""

from __future__ import annotations

import logging
import os
from typing import Any

from celery import Celery, bootsteps
from celery.signals import beat_init, task_postrun, task_prerun, worker_process_init, worker_shutdown

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

app = Celery("catacloud")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


def _django_ready() -> None:
    """Django is set up by Celery's Django fixup before these signals; set it up only if not.
    (A second ``django.setup()`` reapplies LOGGING after Celery has redirected stderr into the
    logging: every line of this process's own loggers was then dropped, the reaper's too.)"""
    from django.apps import apps

    if not apps.ready:
        import django

        django.setup()


@beat_init.connect
def _reaper_in_beat(**_: Any) -> None:
    """Beat stands for the reaper's election (apps/control/election.py): the tick runs in a
    thread of the process that leads, never as a message through the broker, which would be
    lost exactly when Redis or the workers are down, the faults the reaper repairs."""
    _django_ready()
    from apps.control.election import stand
    from apps.core import tracing

    tracing.setup("beat")
    stand("beat")


def _reaper_in_worker() -> None:
    """Every worker stands too (in its main process, after its pool started), so the reaper
    ticks while any worker or beat lives (CATACLOUD_REAPER_IN_WORKERS=false: beat alone)."""
    _django_ready()
    from django.conf import settings

    from apps.core import tracing

    tracing.setup("worker")  # the main process: its reaper loop's spans
    if settings.CATACLOUD_REAPER_IN_WORKERS:
        from apps.control.election import stand

        stand("worker")


class ReaperStep(bootsteps.StartStopStep):
    """The worker's candidacy starts once its pool has started and before its consumer connects
    to the broker (the consumer's step is last), not on ``worker_ready``, which waits for the
    broker: a worker (re)started while Redis is down must tick all the same, the reaper needs
    no broker (a chaos soak found no process ticking with beat dead and Redis gone)."""

    requires = ("celery.worker.components:Pool",)

    def start(self, parent: Any) -> None:
        try:
            _reaper_in_worker()
        except Exception:  # a step that raises stops the worker: it must run its tasks all the same
            logging.getLogger("apps.control.reaper").exception("reaper: this worker could not stand")


app.steps["worker"].add(ReaperStep)


@worker_process_init.connect
def _tracing_in_pool_process(**_: Any) -> None:
    """Each pool process traces the tasks it runs (OTEL_* variables; off by default)."""
    _django_ready()
    from apps.core import tracing

    tracing.setup("worker")


@task_prerun.connect
@task_postrun.connect
def _connections_as_around_a_request(task: Any = None, **_: Any) -> None:
    """Close the connections that broke or outlived ``DATABASE_CONN_MAX_AGE`` around each task, as
    Django does around each request, and keep the others (``CELERY_DB_REUSE_MAX`` stops Celery's
    fixup from closing them all). Not for a task run eagerly, inside its caller's transaction."""
    if task is not None and getattr(task.request, "is_eager", False):
        return
    from django.db import close_old_connections

    close_old_connections()


@worker_shutdown.connect
def _reaper_leaves_worker(**_: Any) -> None:
    from apps.control.election import step_down

    step_down()
