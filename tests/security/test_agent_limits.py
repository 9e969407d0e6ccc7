"""Boundary: one agent cannot tie up the API for everyone.

Shown on main: one agent token holding 200 long polls stalled the whole API (``/healthz``
timed out, ``GET /jobs/`` took 37.6 s): there was no per-agent limit. Later: one job holding
100 connections to the agent server used up its address's cap (100 per peer address), so
another organization's agent on the same host had its connections reset: its ``echo hi`` took
57 s instead of 2.5 s and its log came out empty (the agent gave up on it before its deadline).
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
def test_the_agent_server_closes_idle_and_slow_header_connections_and_bounds_unauthenticated_ones(
    tworld: World, tmp_path: Any
) -> None:
    """300 connections that sent nothing, or their header a byte at a time, stayed open for a
    whole 45 s probe: no header timeout and no limit. Now a header is due within the timeout,
    and past the unauthenticated budget of an address its oldest connections make room."""
    import http.client
    import socket
    import time
    from urllib.parse import urlsplit

    from testkit.processes import TESTS

    env = {"CATACLOUD_AGENT_HEADER_TIMEOUT": "4", "CATACLOUD_AGENT_MAX_UNAUTHENTICATED_PER_ADDRESS": "20"}
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
            shed = [_closed_by_server(s, 0.05) for s in idle]
            assert shed == [True] * 6 + [False] * 4, "the 6 oldest make room for the newest"
            assert not any(_closed_by_server(s, 0.05) for s in extra)
            assert all(_closed_by_server(s, 10) for s in idle[6:] + extra), (
                "idle connections outlived the timeout"
            )
            assert _closed_by_server(slow, 10), "a slow header outlived the timeout"
            # ... and once they are gone, the same client is served as before
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.request("GET", "/api/agent/v1/work?wait=0")
            assert conn.getresponse().status == 401
            conn.close()
        finally:
            for s in [*idle, slow, *extra]:
                s.close()


# ---- per machine, not per address ---------------------------------------------------------------


def _machine(org: Any, machine_type: Any, name: str) -> tuple[MachineInstance, str]:
    """A ready machine of ``org`` and its agent token (as enrolment leaves them)."""
    from apps.core.crypto import hash_token, new_token
    from testkit.builders import ready_instance

    token = new_token("ca")
    instance = ready_instance(machine_type, org=org, provider_id=name, agent_token_hash=hash_token(token))
    instance.save()
    return instance, token


def _answer(sock: Any, within: float) -> bytes:
    """The whole answer the server sent on ``sock`` (head and body; b"" when it closed without
    answering, b"waiting" when nothing came within ``within`` seconds)."""
    sock.settimeout(within)
    data = b""
    try:
        while True:
            head, end, body = data.partition(b"\r\n\r\n")
            if end:
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in head.lower().split(b"\r\n")
                        if line.startswith(b"content-length:")
                    ),
                    0,
                )
                if len(body) >= length:
                    return data
            more = sock.recv(4096)
            if not more:
                return data
            data += more
    except TimeoutError:
        return data or b"waiting"
    except ConnectionResetError:
        return data


def _still_open(sock: Any) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


@pytest.mark.e2e
@pytest.mark.django_db(transaction=True)
def test_a_flood_of_connections_from_one_address_never_stops_another_machines_agent(
    tworld: World, tmp_path: Any
) -> None:
    """One client (machine A's job, say) opens 1,000 connections from the address machine B
    (another organization) also uses: long polls with A's own token, then idle ones and
    half-sent headers. A gets 429 ``too_many_connections`` beyond its own budget; B heartbeats
    and polls as ever; the junk holds no more than the unauthenticated budget, and never
    pushes out a connection A holds."""
    import http.client
    import json
    import socket
    import time
    from urllib.parse import urlsplit

    from testkit.processes import TESTS, wait_for

    _, token_a = _machine(tworld.org, tworld.machine_type, "a")
    _, token_b = _machine(tworld.other_org, tworld.machine_type, "b")
    per_machine, per_address = 16, 200
    env = {
        "CATACLOUD_AGENT_HEADER_TIMEOUT": "120",  # junk stays unless the budget closes it
        "CATACLOUD_AGENT_POLL_TIMEOUT": "60",
        "CATACLOUD_AGENT_MAX_CONNECTIONS_PER_MACHINE": str(per_machine),
        "CATACLOUD_AGENT_MAX_UNAUTHENTICATED_PER_ADDRESS": str(per_address),
    }
    with TESTS.agent_server(tmp_path, **env) as (url, _):
        port = urlsplit(url).port
        junk: list[socket.socket] = []
        polls_a: list[socket.socket] = []
        poll_a = (
            f"GET /api/agent/v1/work?wait=60 HTTP/1.1\r\nHost: x\r\nAuthorization: Agent {token_a}\r\n\r\n"
        )
        try:
            # A's agent token in 40 long polls (each newer one ends the one before with 204)
            polls_a = [socket.create_connection(("127.0.0.1", port)) for _ in range(40)]
            for sock in polls_a:
                sock.sendall(poll_a.encode())
            answers = [_answer(s, 3) for s in polls_a]  # (A's newest poll still waits)

            # then 960 connections that never authenticate: idle, or a header that never ends
            for i in range(960):
                sock = socket.create_connection(("127.0.0.1", port))
                if i % 4 == 1:
                    sock.sendall(b"GET /api/agent/v1/work HTTP/1.1\r\nHost: x\r\nAuthoriz")
                junk.append(sock)

            # B, on the same address, is served as ever
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            started = time.monotonic()
            conn.request(
                "POST", "/api/agent/v1/heartbeat", body=b"{}", headers={"Authorization": f"Agent {token_b}"}
            )
            beat = conn.getresponse()
            assert beat.status == 200, beat.read()
            beat.read()
            conn.request("GET", "/api/agent/v1/work?wait=1", headers={"Authorization": f"Agent {token_b}"})
            poll = conn.getresponse()
            assert poll.status == 204
            poll.read()
            assert time.monotonic() - started < 10
            conn.close()

            # A's first 16 connections are its own, the other 24 were refused with a code and
            # Retry-After, and closed
            refused = [a for a in answers if a.startswith(b"HTTP/1.1 429")]
            assert len(refused) == len(polls_a) - per_machine, [a.split(b"\r\n", 1)[0] for a in answers]
            head, body = refused[0].split(b"\r\n\r\n", 1)
            assert b"retry-after: 1" in head.lower()
            assert json.loads(body)["code"] == "too_many_connections"
            held_by_a = [
                s for s, a in zip(polls_a, answers, strict=True) if not a.startswith(b"HTTP/1.1 429")
            ]

            # the junk holds no more than its budget: its oldest were closed to make room, and
            # never a connection a machine holds
            wait_for(
                lambda: sum(_still_open(s) for s in junk) <= per_address,
                10,
                "the server to close the junk beyond its budget",
            )
            assert all(_still_open(s) for s in held_by_a)
        finally:
            for sock in [*junk, *polls_a]:
                sock.close()


# ---- a machine's log is never lost to a refusing server --------------------------------------------


def test_output_the_server_refused_until_the_deadline_is_still_delivered_in_order() -> None:
    """The agent server refused every log post (connections reset) for most of the time the
    agent gives a job's output before its report: the agent gave up before its deadline (its
    next retry fell past it) and the job's log came out empty. Now the last try comes at the
    deadline, from the spool, with every chunk in order."""
    import time

    from catacloud.agent.runner import LogStreamer

    back_at = [float("inf")]
    posts: list[tuple[float, list[dict[str, Any]]]] = []

    def send(chunks: list[dict[str, Any]]) -> bool:
        posts.append((time.monotonic(), [dict(c) for c in chunks]))
        if time.monotonic() < back_at[0]:
            raise ConnectionResetError("connection reset by peer")
        return False

    # retries 0.5, 1, 2, 4 s apart, then every 4 s: tries at 0, 0.5, 1.5, 3.5 and 7.5 s fail,
    # the next would come at 11.5 s, past the deadline at 10 s; the server is back at 8.5 s
    streamer = LogStreamer(send, flush_interval=0.01, retry_base=0.5, retry_cap=4.0)
    streamer.start()
    lines = [f"line {i}\n" for i in range(200)]
    for line in lines:
        streamer.feed("stdout", line.encode())
    streamer.end_stream("stdout")
    streamer.end_stream("stderr")
    back_at[0] = time.monotonic() + 8.5

    assert streamer.close(timeout=10.0), "the job's output was dropped before its deadline"
    delivered = {c["seq"]: c for at, post in posts if at >= back_at[0] for c in post}
    assert sorted(delivered) == list(range(len(delivered)))
    assert "".join(delivered[seq]["data"] for seq in sorted(delivered)) == "".join(lines)


def test_a_refused_log_post_is_retried_after_retry_after_and_the_log_is_complete(
    api: Any, start_agent: Any
) -> None:
    """The agent server answers a machine's log posts 429 ``too_many_connections`` with
    ``Retry-After`` (and drops one): the agent waits as asked, sends the same chunks again, and
    the job's report comes only once its whole output is in."""
    refusal = (429, {"code": "too_many_connections", "detail": "..."}, {"Retry-After": "2"})
    api.answers["jobs/spooled/logs"] = [refusal, "drop", refusal, refusal]
    start_agent()
    api.wait_for(lambda: api.calls("GET", "work"), what="a poll")
    api.assign("for i in $(seq 1 50); do echo line-$i; sleep 0.02; done", job_id="spooled")

    assert api.wait_finished("spooled", timeout=30)["outcome"] == "succeeded"
    assert api.output("spooled") == "".join(f"line-{i}\n" for i in range(1, 51))
    posts = api.calls("POST", "jobs/spooled/logs")
    refused_at = [posts[i].at for i in (0, 2, 3)]
    after = [posts[i + 1].at for i in (0, 2, 3)]
    assert all(b - a >= 1.95 for a, b in zip(refused_at, after, strict=True)), "sooner than asked"
    first = posts[0].body["chunks"]
    assert posts[1].body["chunks"][: len(first)] == first, "the same chunks again, the same seqs"
    last_chunk_at = max(at for _, at in api.logs["spooled"].values())
    assert api.finished["spooled"][1] >= last_chunk_at, "reported before its output was in"
