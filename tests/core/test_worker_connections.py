"""A Celery worker keeps its PostgreSQL connection from one task to the next, as a web process
keeps it from one request to the next (``DATABASE_CONN_MAX_AGE``): Celery's Django fixup would
close it around every task, and every task would then open a new one, password exchange and all."""

from __future__ import annotations

from pathlib import Path

import pytest
from django.db import connection

from apps.core.models import Heartbeat
from apps.core.tasks import beat_heartbeat_task
from testkit.processes import TESTS, purge_redis, wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.e2e]


def _seen_at() -> object:
    row = Heartbeat.objects.filter(name="beat").first()
    return row.seen_at if row else None


def _task_connections() -> list[tuple[int, float]]:
    """The backends whose last statement was the task's (``update_or_create`` ends with its
    transaction's COMMIT): their pid and when they connected."""
    with connection.cursor() as cur:
        cur.execute(
            "SELECT pid, extract(epoch FROM backend_start) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid() AND query = 'COMMIT'"
        )
        return [(pid, float(start)) for pid, start in cur.fetchall()]


def run_task() -> None:
    before = _seen_at()
    beat_heartbeat_task.delay()
    wait_for(lambda: _seen_at() != before, 30, "the worker to run the task", 0.02)


@pytest.mark.parametrize(("max_age", "kept"), [("60", True), ("0", False)])
def test_a_worker_keeps_its_database_connection_across_tasks(
    tmp_path: Path, max_age: str, kept: bool
) -> None:
    purge_redis()
    with TESTS.celery_worker(tmp_path, concurrency=1, DATABASE_CONN_MAX_AGE=max_age):
        if kept:
            run_task()
            first = _task_connections()
            for _ in range(4):
                run_task()
            last = _task_connections()
            assert len(first) == 1 and last == first, (first, last)  # one served all five
        else:
            for _ in range(5):
                run_task()
                # Closed after each task, as the setting asks: the close runs in the worker's
                # task_postrun, just after the task's COMMIT the test saw, so it is awaited.
                wait_for(lambda: _task_connections() == [], 10, "the task's connection to close")
