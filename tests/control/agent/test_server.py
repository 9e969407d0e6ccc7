"""The agent server (ASGI) holds a fleet's idle long polls without a thread or a database
connection each: the user API and heartbeats are answered while 500 agents wait for work, and
an assignment wakes exactly its machine's poll."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest
from django.db import connection
from django.utils import timezone

from apps.core.broker import redis_client
from apps.core.crypto import hash_token, new_token
from apps.jobs.dispatch import POLL_KEY, wake_agent
from apps.machines.models import MachineInstance
from testkit.builders import bulk_create, job_config, job_row, ready_instance
from testkit.processes import TESTS, wait_for
from tests.conftest import World

N = int(os.environ.get("FLEET_TEST_N", "500"))
DB_THREADS = 4
DB_CONNECTIONS = 2


def enrolled(world: World, n: int) -> list[tuple[MachineInstance, str]]:
    """``n`` ready machines with agent tokens (as enrolment leaves them), without n enrolments."""
    tokens = [new_token("ca") for _ in range(n)]
    now = timezone.now()
    rows = bulk_create(
        ready_instance(
            world.machine_type,
            org=world.org,
            now=now,
            provider_id=f"p-{i}",
            agent_token_hash=hash_token(token),
        )
        for i, token in enumerate(tokens)
    )
    return list(zip(rows, tokens, strict=True))


def database_connections_of(pid: int) -> int:
    port = connection.settings_dict.get("PORT") or 5432
    return sum(
        1
        for c in psutil.Process(pid).net_connections(kind="tcp")
        if c.raddr and c.raddr.port == int(port) and c.status == psutil.CONN_ESTABLISHED
    )


class Fleet:
    """N agents long-polling from one event loop in a thread of this test."""

    def __init__(self, url: str, tokens: list[str]) -> None:
        self.url, self.tokens = url, tokens
        self.answers: dict[int, tuple[int, Any]] = {}
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.tasks: list[asyncio.Future] = []

    def call(self, coro: Any, timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _open(self) -> None:
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def _poll(self, i: int) -> None:
        headers = {"Authorization": f"Agent {self.tokens[i]}"}
        async with self.session.get(f"{self.url}/api/agent/v1/work?wait=120", headers=headers) as r:
            self.answers[i] = (r.status, await r.json() if r.status == 200 else None)

    def start_polls(self) -> None:
        self.call(self._open())
        self.tasks = [
            asyncio.run_coroutine_threadsafe(self._poll(i), self.loop) for i in range(len(self.tokens))
        ]

    async def _heartbeat(self, i: int) -> tuple[int, Any]:
        headers = {"Authorization": f"Agent {self.tokens[i]}"}
        async with self.session.post(
            f"{self.url}/api/agent/v1/heartbeat", json={"running_job": None}, headers=headers
        ) as r:
            return r.status, await r.json()

    def heartbeat(self, i: int) -> tuple[int, Any]:
        return self.call(self._heartbeat(i))

    def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        if hasattr(self, "session"):
            self.call(self.session.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.mark.e2e
@pytest.mark.django_db(transaction=True)
def test_500_idle_polls_hold_no_thread_and_no_connection_and_the_apis_still_answer(
    tworld: World, tmp_path: Path
) -> None:
    machines = enrolled(tworld, N)
    env = {
        "CATACLOUD_AGENT_POLL_TIMEOUT": "120",
        "CATACLOUD_AGENT_DB_THREADS": str(DB_THREADS),
        "CATACLOUD_AGENT_DB_CONNECTIONS": str(DB_CONNECTIONS),
        # 500 agents connect at once from one address (loopback)
        "CATACLOUD_AGENT_MAX_UNAUTHENTICATED": "0",
        "CATACLOUD_AGENT_MAX_UNAUTHENTICATED_PER_ADDRESS": "0",
    }
    with TESTS.agent_server(tmp_path, **env) as (url, server):
        fleet = Fleet(url, [token for _, token in machines])
        try:
            fleet.start_polls()
            # Each poll announces itself in Redis once it is subscribed and waiting.
            redis = redis_client()
            try:
                wait_for(
                    lambda: sum(redis.exists(POLL_KEY.format(m.pk)) for m, _ in machines) == N,
                    60,
                    f"{N} polls waiting",
                    interval=0.5,
                )
            except AssertionError:
                waiting = sum(redis.exists(POLL_KEY.format(m.pk)) for m, _ in machines)
                print(server.output()[-4000:], list(fleet.answers.items())[:3], waiting)
                raise
            assert fleet.answers == {}, "an idle poll answered before its wait"

            # Structure, not timing: the user API answers while every poll still waits ...
            jobs = tworld.client("member").get("/api/v1/jobs/")
            assert jobs.status_code == 200
            # ... and so does a heartbeat on the same agent server, from an agent that is polling.
            status, body = fleet.heartbeat(7)
            assert status == 200 and body == {"cancel": [], "terminate": False}
            assert fleet.answers == {}, "a poll ended before its wait (at least 90 s)"

            # 500 waiting polls hold neither threads nor database connections of the server.
            process = psutil.Process(server.popen.pid)
            assert process.num_threads() < 30, process.num_threads()
            assert database_connections_of(server.popen.pid) <= DB_THREADS + DB_CONNECTIONS

            # An assignment wakes its machine's poll (and no other) with the job.
            machine = machines[N // 4][0]
            config = job_config(tworld.org, tworld.machine_type, "c", "echo hi")
            job = job_row(config, status="assigned", instance=machine, assigned_at=timezone.now())
            wake_agent(machine.pk)
            wait_for(lambda: N // 4 in fleet.answers, 20, "the assigned machine's poll to answer")
            status, body = fleet.answers[N // 4]
            assert status == 200 and body["job"]["id"] == str(job.pk)
            assert list(fleet.answers) == [N // 4]
        finally:
            fleet.close()
