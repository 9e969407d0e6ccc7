"""A real Celery worker and a real beat, against real PostgreSQL and Redis."""

from __future__ import annotations

from pathlib import Path

import pytest
from django.test import Client

from apps.core.models import Heartbeat
from testkit.processes import TESTS, purge_redis, wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.e2e]


def test_beat_schedules_work_that_a_worker_runs_and_healthz_sees_both(tmp_path: Path) -> None:
    purge_redis()
    before = Client().get("/healthz").json()["checks"]
    assert before["beat"]["ok"] is False
    with TESTS.celery_worker(tmp_path), TESTS.celery_beat(tmp_path) as beat:
        wait_for(lambda: Heartbeat.objects.filter(name="beat").exists(), 40, "beat's heartbeat task to run")
        from django.core.cache import cache

        cache.delete("health:workers")
        body = Client().get("/healthz").json()
        assert body["status"] == "ok", body
        assert body["checks"]["workers"]["count"] >= 1
        assert body["checks"]["beat"]["ok"] is True
        assert "beat: Starting" in beat.output()
