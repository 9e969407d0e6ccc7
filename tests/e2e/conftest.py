"""The whole system: the live API (pytest-django's live server, in this process), a real
Celery worker and beat in their own processes, the local provider starting real agent
processes. Timings are shortened so a run takes seconds, not minutes."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from django.test import override_settings

from testkit.processes import TESTS, Proc, purge_redis, stop_local_machines, wait_for
from tests.conftest import World

FAST = {
    "CATACLOUD_HEARTBEAT_INTERVAL": "0.5",
    "CATACLOUD_AGENT_LOST_AFTER": "4",
    "CATACLOUD_AGENT_POLL_TIMEOUT": "5",
    "CATACLOUD_REAPER_INTERVAL": "2",
    "CATACLOUD_SCHEDULER_INTERVAL": "2",
    "CATACLOUD_RECONCILE_GRACE": "30",
    "CATACLOUD_GITHUB_RECONCILE_INTERVAL": "2",
}


@dataclass
class Stack:
    world: World
    url: str
    worker: Proc
    beat: Proc
    tmp: Path

    def api(self, who: str = "admin") -> Any:
        return self.world.client(who)

    def wait(self, predicate: Any, timeout: float, what: str) -> Any:
        try:
            return wait_for(predicate, timeout, what, interval=0.1)
        except AssertionError:
            print("---- worker log ----\n", self.worker.output()[-6000:])
            raise


@pytest.fixture
def stack(tworld: World, live_server: Any, tmp_path: Path) -> Iterator[Stack]:
    purge_redis()
    env = {**FAST, "CATACLOUD_PUBLIC_URL": live_server.url}
    state_dir = tworld.account.config["state_dir"]
    overrides = {k: float(v) for k, v in FAST.items()}
    with (
        override_settings(**overrides, CATACLOUD_PUBLIC_URL=live_server.url),
        TESTS.celery_worker(tmp_path, concurrency=4, **env) as worker,
        TESTS.celery_beat(tmp_path, **env) as beat,
    ):
        try:
            yield Stack(world=tworld, url=live_server.url, worker=worker, beat=beat, tmp=tmp_path)
        finally:
            stop_local_machines(state_dir)
