"""Boundary: bad input never finds a 500; every error under /api/ is JSON ``{code, detail}``.

Shown on main: two requests creating the same name at once (the loser hit IntegrityError),
deeply nested JSON (RecursionError in the parser) and an oversized body answered 500; under
DEBUG, unknown /api/ paths answered Django's HTML debug page.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from django.db import connection, transaction
from django.test import override_settings

from apps.jobs.models import JobConfiguration
from apps.pools.models import InstancePool
from tests.conftest import World


def waiting_on_a_lock() -> bool:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE wait_event_type = 'Lock' AND datname = current_database()"
        )
        return cursor.fetchone()[0] > 0


def _config_row(world: World) -> None:
    JobConfiguration.objects.create(org=world.org, name="dup", machine_type=world.machine_type, command="x")


def _pool_row(world: World) -> None:
    InstancePool.objects.create(org=world.org, name="dup", machine_type=world.machine_type)


def _config_body(world: World) -> dict:
    return {"name": "dup", "machine_type": str(world.machine_type.pk), "command": "y"}


def _pool_body(world: World) -> dict:
    return {"name": "dup", "machine_type": str(world.machine_type.pk), "target_size": 0, "max_size": 1}


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("url", "insert", "body", "count"),
    [
        ("/api/v1/job-configs/", _config_row, _config_body, JobConfiguration.objects.count),
        ("/api/v1/pools/", _pool_row, _pool_body, InstancePool.objects.count),
    ],
    ids=["job-config", "pool"],
)
def test_a_concurrent_duplicate_name_is_400_duplicate_name(
    tworld: World, url: str, insert: Any, body: Any, count: Any
) -> None:
    """The loser passed the name check before the winner committed: its INSERT meets the
    unique index. Forced deterministically: the winner holds its row uncommitted until the
    loser's INSERT is seen waiting on it."""
    inserted, release = threading.Event(), threading.Event()
    answers: list[Any] = []

    def winner() -> None:
        with transaction.atomic():
            insert(tworld)
            inserted.set()
            release.wait(20)
        connection.close()

    def loser() -> None:
        answers.append(tworld.client("admin").post(url, body(tworld), format="json"))
        connection.close()

    threads = [threading.Thread(target=winner)]
    threads[0].start()
    assert inserted.wait(10)
    threads.append(threading.Thread(target=loser))
    threads[1].start()
    deadline = time.monotonic() + 10
    while not waiting_on_a_lock() and time.monotonic() < deadline:
        time.sleep(0.02)
    release.set()
    for thread in threads:
        thread.join(20)

    (response,) = answers
    assert response.status_code == 400, response.content
    assert response.json()["code"] == "duplicate_name"
    assert count() == 1


@pytest.mark.django_db
@pytest.mark.parametrize("depth", [100, 100_000])
def test_too_deep_json_is_400_parse_error(world: World, depth: int) -> None:
    body = "[" * depth + "]" * depth
    response = world.client("member").generic("POST", "/api/v1/jobs/", body, content_type="application/json")
    assert response.status_code == 400
    assert response.json()["code"] == "parse_error"


@pytest.mark.django_db
def test_an_oversized_body_is_413_payload_too_large(world: World) -> None:
    big = "x" * (3 * 1024 * 1024)  # above DATA_UPLOAD_MAX_MEMORY_SIZE (2.5 MiB)
    client = world.client("admin")
    as_form = client.post("/api/v1/job-configs/", {"name": "big", "command": big}, format="multipart")
    as_json = client.post("/api/v1/job-configs/", {"name": "big", "command": big}, format="json")
    for response in (as_form, as_json):
        assert response.status_code == 413, response.content[:200]
        assert response.json()["code"] == "payload_too_large"
    assert not JobConfiguration.objects.exists()


@pytest.mark.django_db
@override_settings(DEBUG=True)
def test_unknown_paths_and_methods_under_api_are_json_in_debug(world: World) -> None:
    client = world.client("admin")
    missing = client.get("/api/v1/no-such-thing/")
    assert missing.status_code == 404 and missing["Content-Type"].startswith("application/json")
    assert missing.json()["code"] == "not_found"
    wrong = client.put("/api/v1/jobs/", {}, format="json")
    assert wrong.status_code == 405 and wrong.json()["code"] == "method_not_allowed"


# ---- issue 26: bad input that still found a 500 ------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize("param", ["after", "attempt"])
@pytest.mark.parametrize("value", ["100000000000000000000000000000", "-100000000000000000000", "2147483648"])
def test_a_log_cursor_out_of_range_is_400_not_500(world: World, param: str, value: str) -> None:
    """``?after=`` and ``?attempt=`` beyond what the columns hold reached PostgreSQL (a 500)."""
    from testkit.builders import job_config, job_row

    job = job_row(job_config(world.org, world.machine_type, "c", "echo"), status="queued")
    response = world.client("member").get(f"/api/v1/jobs/{job.pk}/logs/?{param}={value}")
    assert response.status_code == 400, response.content
    assert response.json()["code"] == "invalid"
    assert param in response.json()["fields"]
    ok = world.client("member").get(f"/api/v1/jobs/{job.pk}/logs/?after=2147483647&attempt=1")
    assert ok.status_code == 200 and ok.json()["text"] == ""


@pytest.mark.django_db
@pytest.mark.parametrize("depth", [100, 100_000])
def test_a_deeply_nested_heartbeat_with_an_unknown_token_is_4xx(world: World, depth: int) -> None:
    """The heartbeat parsed its body before the token was looked up: deeply nested JSON from
    anyone with a well-formed token raised RecursionError (a 500)."""
    from django.test import Client

    from apps.core.crypto import new_token

    body = '{"a": ' * depth + "1" + "}" * depth
    response = Client(headers={"Authorization": f"Agent {new_token('ca')}"}).generic(
        "POST", "/api/agent/v1/heartbeat", body, content_type="application/json"
    )
    assert response.status_code in (400, 401), response.content
    assert response.json()["code"] == "parse_error"


@pytest.mark.django_db
def test_an_artifact_put_for_a_job_id_that_is_not_a_uuid_is_404(world: World, tmp_path: Any) -> None:
    from tests.jobs.test_artifacts import put, running_job

    _, agent, _ = running_job(world, tmp_path)
    for job_id in ("-" * 36, "0" * 36, "0123456789abcdef-0123456789abcdef-01"):
        assert len(job_id) == 36
        response = put(agent, f"/api/agent/v1/jobs/{job_id}/artifacts/x.txt", b"x")
        assert response.status_code == 404, (job_id, response.content)
        assert response.json()["code"] == "not_found"
