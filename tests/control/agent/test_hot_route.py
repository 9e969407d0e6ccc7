"""The agent server answers heartbeat and work from its own lean ASGI route (no Django request
or response on the path every agent takes all day). What an agent sees must not depend on which
server it reached: every answer here is compared with the Django views' (the WSGI web's)."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from apps.core.crypto import hash_token, new_token
from apps.machines.models import MachineInstance
from testkit.builders import job_config, job_row, ready_instance, warming_instance
from testkit.processes import TESTS
from tests.conftest import World

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def agent_server(tmp_path: Path) -> Iterator[str]:
    with TESTS.agent_server(tmp_path, CATACLOUD_AGENT_POLL_TIMEOUT="30") as (url, _proc):
        yield url


def call(
    url: str, method: str, path: str, body: bytes | None = None, **headers: str
) -> tuple[int, Any, dict]:
    """One request to the agent server: status, JSON body (None when empty), headers (lower case)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        raw = response.read()
        headers = {k.lower(): v for k, v in response.getheaders()}
        return response.status, json.loads(raw) if raw else None, headers
    finally:
        conn.close()


def django(method: str, path: str, body: bytes | None = None, **headers: str) -> tuple[int, Any, Any]:
    """The same request through the Django views (what the WSGI web serves)."""
    client = Client(headers=headers)
    response = client.generic(method, path, data=body or b"", content_type="application/json")
    raw = response.content
    return response.status_code, json.loads(raw) if raw else None, response


def agent(world: World, provider_id: str = "p-1") -> tuple[MachineInstance, str]:
    """A ready machine whose agent enrolled (its agent token)."""
    token = new_token("ca")
    machine = ready_instance(
        world.machine_type, org=world.org, provider_id=provider_id, agent_token_hash=hash_token(token)
    )
    machine.save()
    return machine, token


HB = "/api/agent/v1/heartbeat"
WORK = "/api/agent/v1/work?wait=0"


def test_refusals_are_the_same_as_the_django_views(tworld: World, agent_server: str) -> None:
    _, token = agent(tworld)
    cases: list[tuple[str, str, bytes | None, dict[str, str]]] = [
        ("POST", HB, b"{}", {}),  # no credentials
        ("POST", HB, b"{}", {"Authorization": "Bearer x"}),  # another scheme
        ("POST", HB, b"{}", {"Authorization": "Agent not-a-token"}),
        ("POST", HB, b"{}", {"Authorization": f"Agent {new_token('ca')}"}),  # nobody's token
        ("GET", WORK, None, {"Authorization": f"Agent {new_token('ca')}"}),
        ("POST", HB, b"{not json", {"Authorization": f"Agent {token}"}),
        ("POST", HB, b"[1, 2]", {"Authorization": f"Agent {token}"}),
        ("POST", HB, b'{"running_job": "nope"}', {"Authorization": f"Agent {token}"}),
        ("GET", HB, None, {"Authorization": f"Agent {token}"}),  # wrong method: Django answers
        ("POST", WORK, None, {"Authorization": f"Agent {token}"}),
    ]
    for method, path, body, headers in cases:
        status, answer, got = call(agent_server, method, path, body, **headers)
        d_status, d_answer, d_response = django(method, path, body, **headers)
        assert (status, answer) == (d_status, d_answer), (method, path, body, headers)
        assert status in (400, 401, 405), (method, path, status)
        assert answer["code"] and answer["detail"]
        for header in ("WWW-Authenticate", "Allow"):
            assert got.get(header.lower()) == d_response.get(header), (header, method, path)


def test_a_body_larger_than_a_heartbeat_is_refused_with_413(tworld: World, agent_server: str) -> None:
    machine, token = agent(tworld)
    status, answer, _ = call(
        agent_server, "POST", HB, b'{"pad": "' + b"x" * 100_000 + b'"}', Authorization=f"Agent {token}"
    )
    assert status == 413 and answer["code"] == "payload_too_large"
    machine.refresh_from_db()
    assert machine.last_heartbeat_at is not None  # untouched: the builder's own value


def test_a_heartbeat_records_itself_and_tells_the_agent_what_to_cancel(
    tworld: World, agent_server: str
) -> None:
    machine, token = agent(tworld)
    before = machine.last_heartbeat_at
    config = job_config(tworld.org, tworld.machine_type, "c", "sleep 60")
    doomed = job_row(
        config, status="running", instance=machine, started_at=timezone.now(), cancel_requested=True
    )
    job_row(config, status="running", instance=machine, started_at=timezone.now())  # not cancelled

    status, answer, headers = call(
        agent_server, "POST", HB, b'{"running_job": null}', Authorization=f"Agent {token}"
    )
    assert status == 200 and headers["content-type"] == "application/json"
    assert answer == {"cancel": [str(doomed.pk)], "terminate": False}
    machine.refresh_from_db()
    assert machine.last_heartbeat_at > before

    MachineInstance.objects.filter(pk=machine.pk).update(status="terminating")
    assert call(agent_server, "POST", HB, b"", Authorization=f"Agent {token}")[1]["terminate"] is True


def test_the_first_heartbeat_of_a_warming_machine_makes_it_ready(tworld: World, agent_server: str) -> None:
    token = new_token("ca")
    machine = warming_instance(tworld.org, tworld.machine_type, agent_token_hash=hash_token(token))
    status, answer, _ = call(agent_server, "POST", HB, b"{}", Authorization=f"Agent {token}")
    assert status == 200 and answer == {"cancel": [], "terminate": False}
    machine.refresh_from_db()
    assert machine.status == "ready" and machine.last_heartbeat_at is not None


def test_work_hands_out_the_assigned_job_and_otherwise_answers_204(tworld: World, agent_server: str) -> None:
    machine, token = agent(tworld)
    other, _ = agent(tworld, provider_id="p-2")
    assert call(agent_server, "GET", WORK, Authorization=f"Agent {token}")[0] == 204

    config = job_config(tworld.org, tworld.machine_type, "c", "echo hi", env={"A": "1"})
    job_row(config, status="assigned", instance=other, assigned_at=timezone.now())  # not this machine's
    assert call(agent_server, "GET", WORK, Authorization=f"Agent {token}")[0] == 204

    job = job_row(config, status="assigned", instance=machine, assigned_at=timezone.now())
    status, answer, _ = call(agent_server, "GET", WORK, Authorization=f"Agent {token}")
    d_status, d_answer, _ = django("GET", WORK, Authorization=f"Agent {token}")
    assert status == 200 and answer["job"]["id"] == str(job.pk) and answer["job"]["command"] == "echo hi"
    assert (status, answer) == (d_status, d_answer)


def test_a_stop_cuts_waiting_polls_instead_of_timing_out_on_them(tworld: World, tmp_path: Path) -> None:
    """Every Ctrl-C of make dev ended with "Cancel 15 running task(s), timeout graceful
    shutdown exceeded": the agents' long polls were waited for, then cancelled."""
    import contextlib
    import threading
    import time

    def poll(token: str) -> None:
        with contextlib.suppress(OSError, http.client.HTTPException):  # the server went away
            call(url, "GET", "/api/agent/v1/work?wait=60", Authorization=f"Agent {token}")

    tokens = [agent(tworld, provider_id=f"p-{i}")[1] for i in range(3)]
    with TESTS.agent_server(tmp_path, CATACLOUD_AGENT_POLL_TIMEOUT="60") as (url, proc):
        polls = [threading.Thread(target=poll, args=(token,), daemon=True) for token in tokens]
        for thread in polls:
            thread.start()
        time.sleep(1.5)  # the three polls wait
        assert all(thread.is_alive() for thread in polls)
        proc.stop(timeout=15)
        assert "timeout graceful shutdown exceeded" not in proc.output(), proc.output()[-2000:]
        for thread in polls:
            thread.join(10)
            assert not thread.is_alive(), "a poll still waits on a stopped server"


def started(job_id: object) -> str:
    return f"/api/agent/v1/jobs/{job_id}/started"


def test_a_jobs_start_is_answered_and_recorded_as_the_django_view_does(
    tworld: World, agent_server: str
) -> None:
    from apps.events.models import Event
    from apps.jobs.models import Job

    machine, token = agent(tworld)
    other, _ = agent(tworld, provider_id="p-2")
    config = job_config(tworld.org, tworld.machine_type, "c", "echo hi")
    auth = {"Authorization": f"Agent {token}"}
    # Refusals: the same status and body from both servers, and the job left as it was
    theirs = job_row(config, status="assigned", instance=other, assigned_at=timezone.now())
    mine = job_row(config, status="assigned", instance=machine, assigned_at=timezone.now())
    cases: list[tuple[object, bytes, dict[str, str], int]] = [
        (theirs.pk, b"{}", auth, 409),  # another machine's job
        ("00000000-0000-4000-8000-000000000000", b"{}", auth, 409),  # no such job
        (mine.pk, b"{}", {"Authorization": f"Agent {new_token('ca')}"}, 401),  # nobody's token
        (mine.pk, b"{}", {}, 401),
        (mine.pk, b"{not json", auth, 400),
        (mine.pk, b"[1]", auth, 400),
        (mine.pk, b'{"agent_ms": "soon"}', auth, 400),
        (mine.pk, b'{"agent_ms": NaN}', auth, 400),  # Python's json reads it; no number to store
        (mine.pk, b'{"agent_ms": "1e400"}', auth, 400),  # infinity
        (mine.pk, b'{"agent_ms": -5}', auth, 400),
    ]
    for job_id, body, headers, expected in cases:
        status, answer, _ = call(agent_server, "POST", started(job_id), body, **headers)
        assert (status, answer) == django("POST", started(job_id), body, **headers)[:2], (job_id, body)
        assert status == expected and answer["code"] and answer["detail"], (job_id, body, answer)
    assert Job.objects.filter(status="running").count() == 0
    # The start: the job runs, stamped, with the event the state machine records
    status, answer, _ = call(agent_server, "POST", started(mine.pk), b'{"agent_ms": 2.5}', **auth)
    assert (status, answer) == (200, {"ok": True})
    mine.refresh_from_db()
    assert mine.status == "running" and mine.started_at is not None
    assert mine.status_changed_at == mine.started_at
    event = Event.objects.get(job_id=mine.pk, kind="job.started")
    assert (event.org_id, event.instance_id, event.actor) == (
        tworld.org.pk,
        machine.pk,
        f"agent:{machine.pk}",
    )
    assert event.data == {"status": "running", "agent_ms": 2.5}
    # A repeated report (a retry after a lost answer) is refused and records nothing more
    assert call(agent_server, "POST", started(mine.pk), b"", **auth)[0] == 409
    assert Event.objects.filter(job_id=mine.pk, kind="job.started").count() == 1
    # Through the Django view: an agent from before protocol's Started (no body)
    later = job_row(config, status="assigned", instance=machine, assigned_at=timezone.now())
    with CaptureQueriesContext(connection) as statements:
        assert django("POST", started(later.pk), b"", **auth)[:2] == (200, {"ok": True})
    assert len(statements) == 1, [q["sql"] for q in statements]  # token, job, event: one round trip
    assert Event.objects.get(job_id=later.pk, kind="job.started").data == {"status": "running"}
    # A path that is not a job's start goes to Django (404), never to the hot route
    assert call(agent_server, "POST", "/api/agent/v1/jobs/not-a-uuid/started", b"{}", **auth)[0] == 404
