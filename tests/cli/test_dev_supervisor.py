"""`make dev` survives a crash: the supervisor restarts a program that dies and says so;
Ctrl-C still stops everything."""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import psutil
import pytest

from catacloud.cli import dev_programs
from catacloud.supervisor import Supervisor
from tests.support.processes import ROOT, process_env, wait_for


class Output(io.StringIO):
    """What the supervisor printed (written from several threads under its lock)."""


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.e2e
@pytest.mark.django_db(transaction=True)
def test_a_killed_worker_is_restarted_and_answers_again(tmp_path: Path) -> None:
    from config.celery import app

    name = f"dev-{uuid.uuid4().hex[:8]}@localhost"
    programs = dev_programs(env=process_env(), home=tmp_path, port=1, flower_port=1)
    worker = next(p for p in programs if p.name == "worker")
    worker.argv += ["-n", name, "--concurrency", "1", "--without-gossip", "--without-mingle"]
    out = Output()
    supervisor = Supervisor([worker], out=out, restart_delay=0.5, stop_timeout=10)
    thread = threading.Thread(target=supervisor.run, daemon=True)
    thread.start()

    def answers() -> bool:
        return bool(app.control.ping(destination=[name], timeout=0.5))

    try:
        wait_for(answers, 90, "the dev worker to answer a ping")
        first = supervisor.pid("worker")
        assert first is not None
        os.kill(first, signal.SIGKILL)
        second = wait_for(
            lambda: supervisor.pid("worker") not in (None, first) and supervisor.pid("worker"),
            30,
            "a new worker process",
        )
        wait_for(answers, 90, "the restarted worker to answer a ping")
        log = out.getvalue()
        assert f"worker (pid {first}) exited with signal SIGKILL" in log, log
        assert f"restarted worker (pid {second})" in log, log
    finally:
        supervisor.stop()
        thread.join(30)
    assert not thread.is_alive()
    assert gone(first) and gone(second)
    assert "exited" not in out.getvalue().split("stopping", 1)[-1]  # a clean stop is not a crash


SCRIPT = """
import sys
from catacloud.supervisor import Program, Supervisor
sleep = [sys.executable, "-c", "import time; time.sleep(300)"]
Supervisor([Program("a", sleep), Program("b", sleep)], stop_timeout=5).run()
"""


def test_ctrl_c_stops_every_program(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        lines: list[str] = []
        assert proc.stdout is not None
        while len(lines) < 2:
            line = proc.stdout.readline()
            assert line, "the supervisor exited before starting its programs"
            if "started" in line:
                lines.append(line)
        pids = [int(re.search(r"pid (\d+)", line).group(1)) for line in lines]  # type: ignore[union-attr]
        assert all(not gone(pid) for pid in pids)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
        rest = proc.stdout.read()
        assert "stopping a, b" in rest and "restart" not in rest
        assert all(gone(pid) for pid in pids)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
