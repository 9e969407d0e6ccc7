"""Boundary: one agent cannot tie up the API for everyone.

Shown on main: one agent token holding 200 long polls stalled the whole API (``/healthz``
timed out, ``GET /jobs/`` took 37.6 s): there was no per-agent limit.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from django.db import connection
from django.test import override_settings

from apps.machines.models import MachineInstance
from testkit.builders import enrolled_agent
from tests.conftest import World


@pytest.mark.django_db(transaction=True)
@override_settings(CATACLOUD_AGENT_POLL_TIMEOUT=60)
def test_a_second_long_poll_of_the_same_agent_replaces_the_first(tworld: World) -> None:
    agent, _ = enrolled_agent(tworld.org, tworld.machine_type)
    answers: dict[str, Any] = {}

    def poll(name: str) -> None:
        answers[name] = agent.get("/api/agent/v1/work?wait=60")
        connection.close()

    first = threading.Thread(target=poll, args=("first",))
    first.start()
    first.join(1.0)  # let it settle into its long poll
    second = threading.Thread(target=poll, args=("second",))
    second.start()

    first.join(20)  # far below its 60 s wait: only being replaced ends it
    assert not first.is_alive(), "two long polls of one agent held two API workers"
    assert answers["first"].status_code == 204
    assert second.is_alive(), "the newer poll is the one still waiting"
    # A third replaces the second the same way, so one agent holds at most one worker.
    third = threading.Thread(target=poll, args=("third",))
    third.start()
    second.join(20)
    assert not second.is_alive()
    third.join(0.1)
    assert third.is_alive()
    MachineInstance.objects.all().update(status="terminated")
    from apps.core.broker import redis_client
    from apps.jobs.dispatch import POLL_KEY

    redis_client().incr(POLL_KEY.format(MachineInstance.objects.get().pk))  # end the last poll
    from apps.jobs.dispatch import wake_agent

    wake_agent(MachineInstance.objects.get().pk)
    third.join(20)


@pytest.mark.django_db
@override_settings(CATACLOUD_AGENT_RATE="5/min")
def test_each_agent_has_its_own_rate_limit(world: World) -> None:
    from django.core.cache import caches

    caches["local"].clear()  # the throttle counts in the web process's memory
    agent, _ = enrolled_agent(world.org, world.machine_type)
    other, _ = enrolled_agent(world.org, world.machine_type)
    answers = [agent.post("/api/agent/v1/heartbeat", {"running_job": None}, format="json") for _ in range(6)]
    assert [a.status_code for a in answers[:5]] == [200] * 5
    assert answers[5].status_code == 429 and answers[5].json()["code"] == "throttled"
    assert other.post("/api/agent/v1/heartbeat", {"running_job": None}, format="json").status_code == 200


# ---- the agent server's connections (issue 26) --------------------------------------------------


def _closed_by_server(sock: Any, within: float) -> bool:
    """Whether the server closes ``sock`` (reads end of file) within ``within`` seconds."""

    sock.settimeout(within)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


@pytest.mark.e2e
@pytest.mark.django_db(transaction=True)
def test_the_agent_server_closes_idle_and_slow_header_connections_and_caps_each_client(
    tworld: World, tmp_path: Any
) -> None:
    """300 connections that sent nothing, or their header a byte at a time, stayed open for a
    whole 45 s probe: no header timeout and no limit per client."""
    import http.client
    import socket
    import time
    from urllib.parse import urlsplit

    from testkit.processes import TESTS

    env = {"CATACLOUD_AGENT_HEADER_TIMEOUT": "2", "CATACLOUD_AGENT_MAX_CONNECTIONS_PER_CLIENT": "20"}
    with TESTS.agent_server(tmp_path, **env) as (url, _):
        port = urlsplit(url).port
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(10)]
        slow = socket.create_connection(("127.0.0.1", port))
        slow.sendall(b"GET /api/agent/v1/work HTTP/1.1\r\nHost: x\r\n")
        extra = [socket.create_connection(("127.0.0.1", port)) for _ in range(15)]  # 26 in all
        try:
            for _ in range(3):  # a header trickling in does not keep it open
                time.sleep(0.3)
                slow.sendall(b"X")
            refused = sum(_closed_by_server(s, 0.1) for s in extra)
            assert refused == 6, "connections beyond the cap of 20 are closed at once"
            assert all(_closed_by_server(s, 10) for s in idle), "idle connections outlived the timeout"
            assert _closed_by_server(slow, 10), "a slow header outlived the timeout"
            # ... and once they are gone, the same client is served as before
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.request("GET", "/api/agent/v1/work?wait=0")
            assert conn.getresponse().status == 401
            conn.close()
        finally:
            for s in [*idle, slow, *extra]:
                s.close()
