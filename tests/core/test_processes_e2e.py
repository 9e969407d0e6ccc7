"""A real Celery worker and a real beat, against real PostgreSQL and Redis."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.test import Client

from apps.core.models import Heartbeat
from apps.machines.models import MachineInstance
from testkit.processes import TESTS, free_port, purge_redis, wait_for
from tests.conftest import World

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.e2e]


def test_beat_schedules_work_that_a_worker_runs_and_healthz_sees_both(tmp_path: Path, settings: Any) -> None:
    settings.CATACLOUD_METRICS_TOKEN = "e2e-token"  # the details (checks) come with it
    scraper = Client(HTTP_AUTHORIZATION="Bearer e2e-token")
    purge_redis()
    before = scraper.get("/healthz").json()["checks"]
    assert before["beat"]["ok"] is False
    with TESTS.celery_worker(tmp_path), TESTS.celery_beat(tmp_path) as beat:
        wait_for(lambda: Heartbeat.objects.filter(name="beat").exists(), 40, "beat's heartbeat task to run")
        from django.core.cache import cache

        cache.delete("health:workers")
        body = scraper.get("/healthz").json()
        assert body["status"] == "ok", body
        assert body["checks"]["workers"]["count"] >= 1
        assert body["checks"]["beat"]["ok"] is True
        assert "beat: Starting" in beat.output()


def test_beat_runs_the_reaper_itself_with_no_worker_and_no_broker(tworld: World, tmp_path: Path) -> None:
    """The reaper repairs what a dead worker or a dead Redis left: its own ticks must need
    neither. Beat alone, pointed at a broker that does not answer, marks a silent machine lost."""
    from django.utils import timezone

    from testkit.builders import idle_machine

    silent = idle_machine(
        tworld.org, tworld.machine_type, last_heartbeat_at=timezone.now() - timedelta(minutes=10)
    )
    env = {"CATACLOUD_REAPER_INTERVAL": "1", "CATACLOUD_AGENT_LOST_AFTER": "30"}
    dead = f"redis://127.0.0.1:{free_port()}/0"
    with TESTS.celery_beat(tmp_path, CELERY_BROKER_URL=dead, REDIS_URL=dead, **env) as beat:
        try:
            wait_for(
                lambda: MachineInstance.objects.get(pk=silent.pk).status == "lost",
                30,
                "the silent machine lost",
            )
        except AssertionError:
            print(beat.output()[-3000:])
            raise
