"""The Agent API is a separate principal: the handshake, and who may call what."""

from __future__ import annotations

import pytest
from django.test import override_settings
from django.utils import timezone
from rest_framework.test import APIClient

from apps.machines.choices import InstanceStatus
from apps.machines.lifecycle import bootstrap_token_for
from apps.machines.models import MachineInstance
from apps.pools.services import pool_create
from testkit.builders import enroll, enrolled_agent, job_config, job_row, warming_instance
from tests.conftest import World

pytestmark = pytest.mark.django_db
S = InstanceStatus


def test_enroll_then_heartbeat_makes_the_member_ready(world: World) -> None:
    pool = pool_create(org=world.org, name="p", machine_type=world.machine_type, target_size=1, max_size=1)
    instance = warming_instance(world.org, world.machine_type, pool=pool)
    client, token = enroll(instance)
    instance.refresh_from_db()
    assert (
        instance.status == S.WARMING and instance.agent_token_hash and token not in instance.agent_token_hash
    )
    beat = client.post("/api/agent/v1/heartbeat", {"running_job": None}, format="json")
    assert beat.status_code == 200 and beat.json() == {"cancel": [], "terminate": False}
    instance.refresh_from_db()
    assert instance.status == S.READY and instance.warmed_at is not None


def test_the_async_agent_endpoints_need_no_csrf_cookie(world: World) -> None:
    """Agents send a token header, never a cookie: the web's CSRF check must not refuse them."""
    agent, token = enroll(warming_instance(world.org, world.machine_type))
    strict = APIClient(enforce_csrf_checks=True)
    strict.credentials(HTTP_AUTHORIZATION=f"Agent {token}")
    assert strict.post("/api/agent/v1/heartbeat", {"running_job": None}, format="json").status_code == 200
    assert strict.get("/api/agent/v1/work?wait=0").status_code == 204


def test_a_heartbeat_while_the_database_does_not_answer_is_a_503_to_retry(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL restarting: the agent hears 503 database_unavailable (it retries after
    Retry-After), never a 500 page."""
    import psycopg

    from apps.control.agent import views

    agent, _ = enroll(warming_instance(world.org, world.machine_type))

    async def gone(*args: object) -> None:
        raise psycopg.OperationalError("connection failed: Connection refused")

    monkeypatch.setattr(views, "heartbeat_answer", gone)
    agent.raise_request_exception = False
    beat = agent.post("/api/agent/v1/heartbeat", {"running_job": None}, format="json")
    assert beat.status_code == 503 and beat["Retry-After"] == "2"
    assert beat.json()["code"] == "database_unavailable"


def test_a_bootstrap_token_works_once_and_a_forged_one_never(world: World) -> None:
    instance = warming_instance(world.org, world.machine_type)
    enroll(instance)
    again = APIClient().post(
        "/api/agent/v1/enroll", {"bootstrap_token": bootstrap_token_for(instance.pk)}, format="json"
    )
    assert again.status_code == 409 and again.json()["code"] == "already_enrolled"
    forged = bootstrap_token_for(instance.pk)[:-4] + "0000"
    response = APIClient().post("/api/agent/v1/enroll", {"bootstrap_token": forged}, format="json")
    assert response.status_code == 401 and response.json()["code"] == "invalid_bootstrap_token"


def test_user_tokens_cannot_reach_agent_endpoints_and_agent_tokens_cannot_reach_the_api(world: World) -> None:
    instance = warming_instance(world.org, world.machine_type)
    agent, token = enroll(instance)
    user = world.client("admin")
    assert user.post("/api/agent/v1/heartbeat", {}, format="json").status_code == 401
    assert user.get("/api/agent/v1/work?wait=0").status_code == 401
    intruder = APIClient()
    intruder.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    assert intruder.get("/api/v1/instances/").status_code == 401
    intruder.credentials(HTTP_AUTHORIZATION=f"Agent {token}")
    assert intruder.get("/api/v1/instances/").status_code == 401


def test_an_agent_reaches_only_its_own_jobs(world: World) -> None:
    mine, other = (
        warming_instance(world.org, world.machine_type),
        warming_instance(world.org, world.machine_type),
    )
    agent, _ = enroll(mine)
    config = job_config(world.org, world.machine_type, "c", "x")
    theirs = job_row(config, status="assigned", instance=other)
    assert agent.get("/api/agent/v1/work?wait=0").status_code == 204  # not handed another machine's job
    assert agent.post(f"/api/agent/v1/jobs/{theirs.pk}/started").status_code == 409
    logs = agent.post(
        f"/api/agent/v1/jobs/{theirs.pk}/logs",
        {"chunks": [{"seq": 0, "stream": "stdout", "data": "forged"}]},
        format="json",
    )
    assert logs.status_code == 409
    finished = agent.post(
        f"/api/agent/v1/jobs/{theirs.pk}/finished", {"outcome": "succeeded", "exit_code": 0}, format="json"
    )
    assert finished.status_code == 409
    assert agent.get(f"/api/agent/v1/jobs/{theirs.pk}/meta/db").status_code == 409
    theirs.refresh_from_db()
    assert theirs.status == "assigned" and not theirs.log_chunks.exists()


def test_an_ended_machines_agent_is_refused(world: World) -> None:
    instance = warming_instance(world.org, world.machine_type)
    agent, _ = enroll(instance)
    MachineInstance.objects.filter(pk=instance.pk).update(status=S.LOST)
    response = agent.post("/api/agent/v1/heartbeat", {}, format="json")
    assert response.status_code == 401


def test_a_spot_interruption_requeues_the_job_and_retires_the_machine(world: World) -> None:
    instance = warming_instance(world.org, world.machine_type)
    agent, _ = enroll(instance)
    MachineInstance.objects.filter(pk=instance.pk).update(status=S.CLAIMED)
    config = job_config(world.org, world.machine_type, "c", "x")
    job = job_row(config, status="running", instance=instance)
    response = agent.post(
        "/api/agent/v1/interruption", {"kind": "spot", "detail": "terminate at 12:00"}, format="json"
    )
    assert response.status_code == 200
    job.refresh_from_db()
    instance.refresh_from_db()
    assert (job.status, job.attempt, job.instance_id) == ("queued", 2, None)
    # interrupted, not failed: the attempt is free (a job of max_attempts 1 runs again)
    assert (job.requeue_reason, job.free_requeues) == ("spot_interruption", 1)
    assert instance.status == S.TERMINATING
    beat = agent.post("/api/agent/v1/heartbeat", {}, format="json")
    assert beat.json()["terminate"] is True


def test_metrics_show_pool_members_and_the_job_queue(world: World) -> None:
    from apps.pools.services import pool_claim

    pool = pool_create(
        org=world.org, name="gauge", machine_type=world.machine_type, target_size=1, max_size=2
    )
    warming_instance(world.org, world.machine_type, pool=pool)
    ready = warming_instance(world.org, world.machine_type, pool=pool)
    MachineInstance.objects.filter(pk=ready.pk).update(status=S.READY, ready_at=timezone.now())
    pool_claim(pool_id=pool.pk)
    config = job_config(world.org, world.machine_type, "c", "x")
    job_row(config)
    with override_settings(CATACLOUD_METRICS_TOKEN="scrape"):
        body = APIClient().get("/metrics", HTTP_AUTHORIZATION="Bearer scrape").content.decode()
    assert 'catacloud_pool_members{org="acme",pool="gauge",status="warming"} 1.0' in body
    assert 'catacloud_jobs{machine_type="small",org="acme",status="queued"} 1.0' in body
    assert "catacloud_pool_claim_seconds_bucket" in body
    assert "catacloud_job_wait_seconds_bucket" in body


def test_a_job_is_handed_out_in_two_statements_and_still_gets_its_checkpoint_and_resources(
    world: World,
) -> None:
    """The poll's hand-out is on every job's way to its first instruction: one statement loads
    the job with all its payload reads (its configuration and machine type, whether it has a
    checkpoint, whether it holds resources), one stamps its delivery. A job that has a
    checkpoint and holds a resource still gets both."""
    import time

    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from apps.control.agent.views import _assigned
    from apps.jobs.models import Artifact
    from testkit.builders import resource_row

    agent, instance = enrolled_agent(world.org, world.machine_type)
    config = job_config(world.org, world.machine_type)
    plain = job_row(config, status="assigned", instance=instance, assigned_at=timezone.now())
    with CaptureQueriesContext(connection) as queries:
        payload = _assigned(instance.pk, time.time())
    assert payload is not None and payload["id"] == str(plain.pk)
    assert (payload["checkpoint"]["available"], payload["resources"]) == (False, [])
    assert len(queries.captured_queries) == 2, [q["sql"] for q in queries.captured_queries]

    plain.status = "succeeded"
    plain.save(update_fields=["status"])
    held = job_row(config, status="assigned", instance=instance, assigned_at=timezone.now(), attempt=2)
    Artifact.objects.create(
        job=held, org=world.org, kind=Artifact.KIND_CHECKPOINT, name="checkpoint", key="k"
    )
    resource_row(
        world.org, "lab-db", "postgres", job=held, status="held", metadata={"host": "10.0.0.9", "port": 5432}
    )
    payload = agent.get("/api/agent/v1/work?wait=0").json()["job"]
    assert payload["id"] == str(held.pk) and payload["checkpoint"]["available"] is True
    assert payload["resources"] == ["lab-db"]
    assert "10.0.0.9:5432" in payload["network"]["allow"]
