"""A live system for the parts that need one, as `make dev` runs it: gunicorn (the user API),
the agent server (the Agent API the machines talk to), a Celery worker and beat, and the local
provider starting real agent processes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness import temp_dir
from testkit.processes import BENCH, purge_redis, stop_local_machines, wait_for

ENV = {
    "CATACLOUD_HEARTBEAT_INTERVAL": "1",
    "CATACLOUD_AGENT_POLL_TIMEOUT": "10",
    "CATACLOUD_AGENT_LOST_AFTER": "30",
}


@dataclass
class Stack:
    url: str
    tmp: Path
    state_dir: Path
    agent_url: str = ""  # the agent server (the Agent API machines and hosts talk to)


@contextlib.contextmanager
def live_stack(name: str, **extra: str) -> Iterator[Stack]:
    """The stack with ``ENV`` and ``extra`` settings in every process."""
    purge_redis()
    settings = {**ENV, **extra}
    with temp_dir(name) as tmp:
        state_dir = tmp / "machines"
        state_dir.mkdir()
        try:
            with (
                BENCH.gunicorn(tmp, workers=2, threads=16, **settings) as (url, _),
                BENCH.agent_server(tmp, **settings) as (agent_url, _),
            ):
                env = {**settings, "CATACLOUD_PUBLIC_URL": url, "CATACLOUD_AGENT_URL": agent_url}
                with BENCH.celery_worker(tmp, concurrency=2, **env), BENCH.celery_beat(tmp, **env):
                    try:
                        yield Stack(url=url, tmp=tmp, state_dir=state_dir, agent_url=agent_url)
                    finally:
                        stop_local_machines(state_dir, stop_timeout=2, ignore_errors=True)
        finally:
            stop_local_machines(state_dir, stop_timeout=2, ignore_errors=True)


def pool_quiet(pool_id: Any, target: int) -> bool:
    """The pool holds ``target`` ready members and nothing is on its way or going."""
    from apps.machines.models import MachineInstance

    members = list(MachineInstance.objects.filter(pool_id=pool_id).values_list("status", flat=True))
    busy = sum(1 for s in members if s in ("pending", "provisioning", "warming", "terminating"))
    return members.count("ready") >= target and busy == 0


def wait_quiet(pool_id: Any, target: int, timeout: float = 90) -> None:
    wait_for(
        lambda: pool_quiet(pool_id, target), timeout, f"pool {pool_id} to hold {target} ready members", 0.05
    )
