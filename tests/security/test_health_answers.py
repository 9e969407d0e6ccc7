"""Boundary: what the health answers tell someone with no credentials.

Shown on main: ``/healthz`` and ``/readyz`` told anyone which part was down (database, broker,
workers, beat), how long each took to answer and how many workers ran.
"""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.test import Client, override_settings

pytestmark = pytest.mark.django_db

CHECKS = {"database", "broker", "workers", "beat", "reaper"}  # the reaper: its last tick, and by whom


@override_settings(CATACLOUD_METRICS_TOKEN="metrics-secret")
def test_health_answers_carry_only_their_status_without_the_metrics_token_or_a_staff_session() -> None:
    for path in ("/healthz", "/readyz"):
        anonymous = Client().get(path)
        assert set(anonymous.json()) == {"status"}, f"{path} told anyone its details"

        scraper = Client().get(path, HTTP_AUTHORIZATION="Bearer metrics-secret")
        assert scraper.status_code == anonymous.status_code
        assert scraper.json()["status"] == anonymous.json()["status"]
        assert set(scraper.json()["checks"]) == CHECKS

        wrong = Client().get(path, HTTP_AUTHORIZATION="Bearer guessed")
        assert wrong.status_code == 401 and wrong.json()["code"] == "not_authenticated"
        assert "checks" not in wrong.json()

        staff = Client()
        staff.force_login(get_user_model().objects.create_user(f"op{path[1:]}", is_staff=True))
        assert set(staff.get(path).json()["checks"]) == CHECKS
        member = Client()
        member.force_login(get_user_model().objects.create_user(f"user{path[1:]}"))
        assert set(member.get(path).json()) == {"status"}


def test_without_a_metrics_token_the_details_need_a_staff_session() -> None:
    assert set(Client().get("/healthz").json()) == {"status"}
    given = Client().get("/healthz", HTTP_AUTHORIZATION="Bearer ")
    assert given.status_code == 401 and "checks" not in given.json()
