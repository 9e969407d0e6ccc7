from __future__ import annotations

import importlib.metadata
from typing import Any

import pytest
from django.test import Client, override_settings

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("metrics_token")]
TOKEN = "health-test-token"


@pytest.fixture
def metrics_token(settings: Any) -> None:
    """The details (``checks``) come with the metrics token (tests/security/test_health_answers.py)."""
    settings.CATACLOUD_METRICS_TOKEN = TOKEN


def _get(path: str) -> Any:
    return Client().get(path, HTTP_AUTHORIZATION=f"Bearer {TOKEN}")


def test_healthz_reports_database_and_broker() -> None:
    response = _get("/healthz")
    assert response.status_code == 200
    checks = response.json()["checks"]
    assert checks["database"]["ok"] is True
    assert checks["broker"]["ok"] is True
    assert set(checks) == {"database", "broker", "workers", "beat", "reaper"}


@override_settings(CELERY_BROKER_URL="redis://127.0.0.1:1/0")
def test_healthz_is_503_when_the_broker_is_down() -> None:
    response = _get("/healthz")
    assert response.status_code == 503
    body = response.json()
    assert body["status"] == "unhealthy"
    assert body["checks"]["broker"]["ok"] is False
    assert body["checks"]["database"]["ok"] is True


def test_liveness_and_readiness_answer_apart_without_a_worker_or_beat(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """/healthz answered 200 ("degraded") while no worker and no beat ran, so whoever waited on
    it started sending work too early. Kubernetes convention: /livez says the process answers
    (restart it if not), /readyz says everything is up (wait on it before sending work)."""
    from django.core.cache import cache
    from django.utils import timezone

    from apps.core.models import Heartbeat

    Heartbeat.objects.all().delete()
    cache.set("health:workers", [], 5)  # no worker answered a ping
    live = Client().get("/livez")
    assert live.status_code == 200 and live.json() == {"status": "alive"}
    ready = _get("/readyz")
    assert ready.status_code == 503
    # an answer, not a server error: `make dev` polls it each second while it starts
    assert not [r for r in caplog.records if r.name == "django.request"]
    body = ready.json()
    assert body["status"] == "not_ready"
    assert body["checks"]["workers"]["ok"] is False and body["checks"]["beat"]["ok"] is False
    assert body["checks"]["reaper"] == {"ok": False, "last_tick": None, "ms": body["checks"]["reaper"]["ms"]}
    assert body["checks"]["database"]["ok"] is True

    Heartbeat.objects.create(name="beat", seen_at=timezone.now())
    cache.set("health:workers", ["w1@host"], 5)
    assert _get("/readyz").status_code == 503  # every part but the reaper
    Heartbeat.objects.create(
        name="reaper", seen_at=timezone.now(), detail={"by": "worker@h:1", "seconds": 0.01}
    )
    ready = _get("/readyz")
    assert ready.status_code == 200 and ready.json()["status"] == "ready"
    assert ready.json()["checks"]["reaper"]["by"] == "worker@h:1"
    # Which release answers (with the details: a rollout is checked with the metrics token).
    assert ready.json()["version"] == importlib.metadata.version("catacloud")
    assert Client().get("/readyz").json() == {"status": "ready"}  # anyone: its status only


def test_readyz_is_503_when_the_reaper_stopped_ticking(settings: Any) -> None:
    """The safety net is part of being ready: its last tick older than three intervals is."""
    from datetime import timedelta

    from django.core.cache import cache
    from django.utils import timezone

    from apps.core.models import Heartbeat

    cache.set("health:workers", ["w1@host"], 5)
    Heartbeat.objects.create(name="beat", seen_at=timezone.now())
    late = timezone.now() - timedelta(seconds=3 * settings.CATACLOUD_REAPER_INTERVAL + 10)
    Heartbeat.objects.create(name="reaper", seen_at=late)
    body = _get("/readyz").json()
    assert body["status"] == "not_ready" and body["checks"]["reaper"]["ok"] is False
    assert _get("/healthz").json()["status"] == "degraded"


@override_settings(CELERY_BROKER_URL="redis://127.0.0.1:1/0")
def test_a_process_whose_broker_is_down_is_alive_but_not_ready() -> None:
    assert Client().get("/livez").status_code == 200
    assert _get("/readyz").status_code == 503
