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
    neither, and neither must what they repair. Beat alone, pointed at a broker that does not
    answer, marks a silent machine lost, acquires for a job whose acquire message was lost and
    destroys a resource whose destroy message was lost (before: both were sent again, to the
    dead broker, and stayed as they were); each tick is one line of beat's log."""
    from django.utils import timezone

    from apps.jobs.models import Job
    from apps.resources.models import ResourceInstance, ResourceType
    from testkit.builders import idle_machine
    from tests.resources.test_resources import admitted_job, config_with

    long_ago = timezone.now() - timedelta(minutes=10)
    silent = idle_machine(tworld.org, tworld.machine_type, last_heartbeat_at=long_ago)
    token = ResourceType.objects.create(id="tok", well="api_token")
    job = admitted_job(tworld, config_with(tworld, "tok"))
    Job.objects.filter(pk=job.pk).update(status_changed_at=long_ago)
    leftover = ResourceInstance.objects.create(
        resource_type=token, org=tworld.org, status="releasing", status_changed_at=long_ago
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
            wait_for(
                lambda: Job.objects.get(pk=job.pk).status == "waiting_for_machine",
                30,
                "the job's resources acquired by the tick",
            )
            wait_for(
                lambda: ResourceInstance.objects.get(pk=leftover.pk).status == "destroyed",
                30,
                "the released resource destroyed by the tick",
            )
            wait_for(lambda: "reaper: tick in" in beat.output(), 10, "a tick's line in beat's log")
        except AssertionError:
            print(beat.output()[-3000:])
            raise
