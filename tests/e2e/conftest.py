"""The whole system: the live API (pytest-django's live server, in this process), a real
Celery worker and beat in their own processes, the local provider starting real agent
processes. Timings are shortened so a run takes seconds, not minutes."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
from django.test import override_settings

from testkit.processes import TESTS, Proc, TimedOut, purge_redis, stop_local_machines, wait_for
from tests.conftest import World

FAST = {
    "CATACLOUD_HEARTBEAT_INTERVAL": "0.5",
    "CATACLOUD_AGENT_LOST_AFTER": "4",
    "CATACLOUD_AGENT_POLL_TIMEOUT": "5",
    "CATACLOUD_REAPER_INTERVAL": "2",
    "CATACLOUD_SCHEDULER_INTERVAL": "2",
    "CATACLOUD_RECONCILE_GRACE": "30",
    "CATACLOUD_GITHUB_RECONCILE_INTERVAL": "2",
    "CATACLOUD_GITLAB_RECONCILE_INTERVAL": "2",
}


@dataclass
class Stack:
    world: World
    url: str
    worker: Proc
    beat: Proc
    tmp: Path
    # A folder made for jobs (every uid may write it): /shared inside every machine. Nothing else
    # of this host is visible to a job.
    shared: Path
    # What a timed-out wait prints besides the worker's log (a test's view of what is left).
    on_timeout: Any = None

    def machine_processes(self, instance_id: str) -> list[psutil.Process]:
        """Every process of a local machine (its sandbox and what runs in it), as this host sees them."""
        record = Path(self.world.account.config["state_dir"]) / f"{instance_id}.json"
        try:
            root = psutil.Process(json.loads(record.read_text())["pid"])
            return [root, *root.children(recursive=True)]
        except (OSError, ValueError, psutil.Error):
            return []

    def agent_process(self, instance_id: str) -> psutil.Process:
        for process in self.machine_processes(instance_id):
            with contextlib.suppress(psutil.Error):
                # (its keeper, a shell, and bubblewrap hold its command line too)
                if process.name() not in ("bwrap", "sh") and "catacloud.agent" in " ".join(process.cmdline()):
                    return process
        raise AssertionError(f"no agent process for {instance_id}")

    def api(self, who: str = "admin") -> Any:
        return self.world.client(who)

    def wait(self, predicate: Any, timeout: float, what: str) -> Any:
        try:
            return wait_for(predicate, timeout, what, interval=0.1)
        except TimedOut as exc:
            print("---- worker log ----\n", self.worker.output()[-6000:])
            if self.on_timeout is None:
                raise
            # In the message, not only printed: a run's summary shows it where the captured
            # output is cut.
            raise TimedOut(f"{exc}; left: {self.on_timeout()}") from None


@pytest.fixture
def stack(tworld: World, live_server: Any, tmp_path: Path) -> Iterator[Stack]:
    purge_redis()
    env = {**FAST, "CATACLOUD_PUBLIC_URL": live_server.url}
    state_dir = tworld.account.config["state_dir"]
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o1777)
    shared.chmod(0o1777)
    tworld.account.config["mounts"] = [{"source": str(shared), "target": "/shared", "writable": True}]
    tworld.account.save(update_fields=["config"])
    overrides = {k: float(v) for k, v in FAST.items()}
    try:
        with (
            override_settings(**overrides, CATACLOUD_PUBLIC_URL=live_server.url),
            TESTS.celery_worker(tmp_path, concurrency=4, **env) as worker,
            TESTS.celery_beat(tmp_path, **env) as beat,
        ):
            yield Stack(
                world=tworld, url=live_server.url, worker=worker, beat=beat, tmp=tmp_path, shared=shared
            )
            # Ended at once, as a crash ends them: a warm shutdown waits for the tasks in hand
            # (3-7 s a test); nothing of them is kept (the next test starts with an empty
            # broker and database; the machines are stopped below), and `make dev`'s own stop
            # is tested on its own (tests/cli/test_dev_stop.py).
            worker.kill()
            beat.kill()
    finally:
        # Once the worker and beat are stopped: a pool refill of the worker's last seconds
        # started a machine after an earlier clean-up, and it outlived the run.
        stop_local_machines(state_dir)


@contextlib.contextmanager
def cloud_control_plane(
    live_server: Any, tmp_path: Path, *, cooldown: float = 180.0, **settings: Any
) -> Iterator[None]:
    """A worker and beat of the live server's database serving an agent wheel (without one no
    cloud machine is made), with a capacity ``cooldown`` and ``settings`` (JSON in the
    processes' environment, themselves in this one)."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "catacloud_agent-0.1.0-py3-none-any.whl").write_bytes(b"an agent wheel")
    purge_redis()
    env = {
        **FAST,
        "CATACLOUD_PUBLIC_URL": live_server.url,
        "CATACLOUD_CAPACITY_COOLDOWN": str(cooldown),
        "CATACLOUD_AGENT_WHEEL": str(wheels),
        **{k: json.dumps(v) for k, v in settings.items()},
    }
    with (
        override_settings(
            **{k: float(v) for k, v in FAST.items()},
            CATACLOUD_PUBLIC_URL=live_server.url,
            CATACLOUD_CAPACITY_COOLDOWN=cooldown,
            CATACLOUD_AGENT_WHEEL=str(wheels),
            **settings,
        ),
        TESTS.celery_worker(tmp_path, concurrency=2, **env) as worker,
        TESTS.celery_beat(tmp_path, **env) as beat,
    ):
        yield
        worker.kill()
        beat.kill()
