"""The agent as a real process for the tests: start it against a fake Agent API, read its log.

The fixtures (``api``, ``work_dir``, ``start_agent``) are registered by ``conftest.py``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from tests.agent.fake_server import FakeAgentAPI

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable


def alive(pid: int) -> bool:
    """A process that still runs (zombies waiting for a reaper count as gone)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def wait_gone(pids: list[int], timeout: float = 3.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(pid) for pid in pids):
        time.sleep(0.05)
    return [pid for pid in pids if alive(pid)]


def values(output: str, key: str) -> list[str]:
    return [line.split("=", 1)[1] for line in output.splitlines() if line.startswith(key + "=")]


class AgentProcess:
    """``python -m catacloud.agent agent ...`` with its log in a file."""

    def __init__(self, proc: subprocess.Popen[bytes], log_path: Path) -> None:
        self.proc = proc
        self.log_path = log_path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait(self, timeout: float = 10.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the agent did not exit within {timeout} s:\n{self.log()}") from None


@pytest.fixture
def api() -> Iterator[FakeAgentAPI]:
    fake = FakeAgentAPI(heartbeat_interval=0.2, poll_timeout=0.5)
    fake.start()
    yield fake
    fake.stop()


@pytest.fixture
def work_dir() -> Iterator[Path]:
    """Outside pytest's 0700 tmp folders: the agent (root here) runs jobs as an unprivileged
    user, who must be able to reach its working directory."""
    parent = Path(tempfile.mkdtemp(prefix="catacloud-test-work-"))
    parent.chmod(0o711)
    yield parent / "work"
    shutil.rmtree(parent, ignore_errors=True)


@pytest.fixture
def start_agent(api: FakeAgentAPI, tmp_path: Path, work_dir: Path) -> Iterator[Callable[..., AgentProcess]]:
    started: list[AgentProcess] = []

    def start(
        *extra: str, token: str | None = None, token_via_env: bool = False, env_extra: dict | None = None
    ) -> AgentProcess:
        token = api.bootstrap_token if token is None else token
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", **(env_extra or {})}
        command = [PY, "-m", "catacloud.agent", "agent", "--url", api.url, "--work-dir", str(work_dir)]
        if token_via_env:
            env["CATACLOUD_BOOTSTRAP_TOKEN"] = token
        else:
            env.pop("CATACLOUD_BOOTSTRAP_TOKEN", None)
            token_file = tmp_path / f"bootstrap-token-{len(started)}"
            token_file.write_text(token + "\n")
            token_file.chmod(0o600)
            command += ["--bootstrap-token-file", str(token_file)]
        log_path = tmp_path / f"agent-{len(started)}.log"
        with open(log_path, "wb") as log_file:
            proc = subprocess.Popen(
                [*command, *extra], cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT
            )
        agent = AgentProcess(proc, log_path)
        started.append(agent)
        return agent

    yield start
    for agent in started:
        if agent.proc.poll() is None:
            agent.proc.send_signal(signal.SIGTERM)
            try:
                agent.proc.wait(10)
            except subprocess.TimeoutExpired:
                agent.proc.kill()
                agent.proc.wait()


def assert_no_secrets(api: FakeAgentAPI, agent: AgentProcess) -> None:
    log = agent.log()
    assert api.agent_token not in log
    assert api.bootstrap_token not in log
