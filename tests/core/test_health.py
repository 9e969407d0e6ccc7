from __future__ import annotations

import pytest
from django.test import Client, override_settings

pytestmark = pytest.mark.django_db


def test_healthz_reports_database_and_broker() -> None:
    response = Client().get("/healthz")
    assert response.status_code == 200
    checks = response.json()["checks"]
    assert checks["database"]["ok"] is True
    assert checks["broker"]["ok"] is True
    assert set(checks) == {"database", "broker", "workers", "beat"}


@override_settings(CELERY_BROKER_URL="redis://127.0.0.1:1/0")
def test_healthz_is_503_when_the_broker_is_down() -> None:
    response = Client().get("/healthz")
    assert response.status_code == 503
    body = response.json()
    assert body["status"] == "unhealthy"
    assert body["checks"]["broker"]["ok"] is False
    assert body["checks"]["database"]["ok"] is True
