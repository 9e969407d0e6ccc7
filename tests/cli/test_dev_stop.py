"""Nothing outlives `make dev`: every kind of stop ends the local machines of its home, and a
start ends what an earlier run left.

Measured before: stacks stopped with SIGTERM once `make clean` had taken their PostgreSQL, Redis
and $CATACLOUD_HOME down, or whose terminal was closed, left their local machines running (a
sandbox and an agent each, retrying a control plane that no longer answers)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import pty
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from catacloud.agent.disk import mounts_under
from catacloud.providers.local import release_areas
from testkit.processes import ROOT, WATCHED_FOLDERS, free_port, wait_for


def machine_processes(home: Path, agent_port: int) -> list[str]:
    """This home's local machines as `ps` shows them: their sandboxes (and keepers) name the
    machine's folder under ``home``, their agents the stack's agent server."""
    found = []
    for proc in psutil.process_iter(["pid", "name", "cmdline", "status"]):
        command = " ".join(proc.info["cmdline"] or [])
        if proc.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        if str(home / "machines") in command or f"--url http://127.0.0.1:{agent_port}" in command:
            found.append(f"{proc.info['pid']} {proc.info['name']}")
    return found


def end_everything_of(home: Path) -> None:
    """Whatever a failed test left of this home: the stack, its services, its machines."""
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if proc.environ().get("CATACLOUD_HOME") == str(home) or str(home) in " ".join(proc.cmdline()):
                proc.kill()


def dev_recipe() -> str:
    """The command line of the project's own `make dev` (its Makefile's recipe), as it is."""
    lines = (ROOT / "Makefile").read_text().splitlines()
    return lines[lines.index("dev: $(STAMP)") + 1].strip().lstrip("@")


class DevStack:
    """`make dev` (a Makefile running the project's own recipe) on its own home and ports, its
    output gathered from a file or a terminal."""

    def __init__(self, home: Path, env: dict[str, str]) -> None:
        self.home = home
        self.port, self.agent_port, self.flower_port = free_port(), free_port(), free_port()
        self.env = {
            **env,
            "CATACLOUD_HOME": str(home),
            "PORT": str(self.port),
            "AGENT_PORT": str(self.agent_port),
            "FLOWER_PORT": str(self.flower_port),
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": str(ROOT),
        }
        variables = f"PY := {sys.executable}\nDEV_STARTED := $(shell date +%s)\n"
        (home / "Makefile").write_text(f"{variables}dev:\n\t@cd {ROOT} && {dev_recipe()}\n")
        self.output = b""

    @property
    def command(self) -> list[str]:
        return ["make", "-s", "-C", str(self.home), "dev"]

    def api(self, path: str, body: dict[str, Any] | None = None) -> Any:
        token = (self.home / "demo_token").read_text().strip()
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/api/v1/{path}",
            data=json.dumps(body).encode() if body is not None else None,
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
            method="POST" if body is not None else "GET",
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())

    def runner(self) -> psutil.Process:
        """The dev runner itself (`python -m catacloud.cli dev`, of this home): `make`'s child,
        which the recipe's `exec` made of the shell `make` starts it through."""
        for proc in psutil.process_iter(["cmdline"]):
            with contextlib.suppress(psutil.Error):
                ours = proc.info["cmdline"] and proc.environ().get("CATACLOUD_HOME") == str(self.home)
                if ours and proc.info["cmdline"][-3:] == ["-m", "catacloud.cli", "dev"]:
                    return proc
        raise AssertionError("no dev runner of this home is running")

    def wait_stopped(self, runner: psutil.Process) -> None:
        """Until the dev runner has ended: its stop's last step (the machines' job areas
        released) comes after its programs and machines have ended."""
        wait_for(lambda: not runner.is_running() or runner.status() == "zombie", 60, "make dev to end")

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/readyz", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def start_machines(self, count: int) -> None:
        """A pool of ``count`` machines, made by the stack's worker; returns once each is ready
        (its agent enrolled and heartbeating)."""
        wait_for(self.ready, 240, "make dev to be ready", interval=0.5)
        machine_type = self.api("machine-types/")["results"][0]["id"]
        pool = {"name": "p", "machine_type": machine_type, "target_size": count, "max_size": count}
        pool_id = self.api("pools/", {**pool, "min_size": 1})["id"]
        wait_for(lambda: self.api(f"pools/{pool_id}/")["status"] == "ready", 120, "the pool", interval=0.5)
        assert sum("python" in p for p in machine_processes(self.home, self.agent_port)) == count


@pytest.fixture
def home() -> Iterator[Path]:
    """A `make dev` home outside pytest's folders, which are closed to the embedded PostgreSQL's
    user (it runs as its own user when the tests run as root)."""
    path = Path(tempfile.mkdtemp(prefix="catacloud-test-dev-"))
    WATCHED_FOLDERS.append(path)  # the run's leftover check looks at its machines and services too
    try:
        yield path
    finally:
        end_everything_of(path)
        release_areas(path)  # what a failed test left mounted
        shutil.rmtree(path, ignore_errors=True)


def own_services_env() -> dict[str, str]:
    """The tests' environment, without their database, broker and settings: `make dev`
    starts embedded PostgreSQL and Redis of its own home, as on a fresh clone."""
    drop = {"DATABASE_URL", "REDIS_URL", "DJANGO_SETTINGS_MODULE", "CATACLOUD_HOME"}
    return {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("PYTEST_")}


@pytest.mark.e2e
@pytest.mark.timeout(420)
def test_sigterm_once_make_clean_took_the_services_down_leaves_no_local_machine(home: Path) -> None:
    """A script runs `make clean` (PostgreSQL and Redis stopped, $CATACLOUD_HOME deleted) and
    stops `make dev` with SIGTERM to its process group. The machines' records had gone with the
    home, so the stop found no machine to stop and every one kept running, retrying a control
    plane that no longer answers. Now the stop finds them by their processes' mark: none is left
    when `make` returns, and nothing is left mounted."""
    stack = DevStack(home, own_services_env())
    log = (home.parent / f"{home.name}.log").open("wb")
    dev = subprocess.Popen(
        stack.command, env=stack.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        stack.start_machines(2)
        runner = stack.runner()

        wipe = f"import pathlib, catacloud.embedded as e; e.wipe(pathlib.Path({str(home)!r}))"
        subprocess.run([sys.executable, "-c", wipe], cwd=ROOT, env=stack.env, check=True, timeout=60)
        os.killpg(dev.pid, signal.SIGTERM)

        # make returns once the runner has stopped everything (no shell between them that
        # dies of the signal at once, letting make return while the runner still stops)
        assert dev.wait(60) is not None
        assert not runner.is_running(), "make dev returned while its runner was still stopping"
        assert machine_processes(home, stack.agent_port) == []
        assert mounts_under(str(home)) == [], "the machines' job areas are still mounted"
    except (AssertionError, subprocess.TimeoutExpired):
        print(Path(log.name).read_text(errors="replace")[-5000:])
        raise
    finally:
        log.close()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(dev.pid, signal.SIGKILL)
        dev.wait()
        Path(log.name).unlink(missing_ok=True)


SHELL = """
import fcntl, os, signal, sys, termios
# An interactive shell in a terminal window: it leads the session, runs the job in a process
# group of its own in the foreground, and when the terminal hangs up, resends SIGHUP to its job.
os.setsid()
fcntl.ioctl(0, termios.TIOCSCTTY, 0)
job = os.fork()
if job == 0:
    os.setpgid(0, 0)
    os.execvp(sys.argv[1], sys.argv[1:])
os.setpgid(job, job)
signal.signal(signal.SIGTTOU, signal.SIG_IGN)
os.tcsetpgrp(0, job)
def hangup(*_):
    os.killpg(job, signal.SIGHUP)
    os._exit(129)
signal.signal(signal.SIGHUP, hangup)
os.waitpid(job, 0)
"""


@pytest.mark.e2e
@pytest.mark.timeout(420)
@pytest.mark.django_db(transaction=True)
def test_closing_the_terminal_of_make_dev_stops_its_local_machines(home: Path) -> None:
    """`make dev` in a terminal window that is closed: the shell sends SIGHUP to its job (make's
    process group), which the dev runner had left to own the terminal's Ctrl-C, and every write
    to the terminal now fails. The stack and its machines ran on; now they stop."""
    from testkit.processes import TESTS, purge_redis

    purge_redis()
    env = {k: v for k, v in TESTS.env().items() if k not in ("DJANGO_SETTINGS_MODULE", "CATACLOUD_HOME")}
    stack = DevStack(home, env)  # on the tests' PostgreSQL and Redis: it stops neither
    master, slave = pty.openpty()
    shell = subprocess.Popen(
        [sys.executable, "-c", SHELL, *stack.command],
        env=stack.env,
        stdin=slave,
        stdout=slave,
        stderr=slave,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # (setsid: in SHELL)
    )
    os.close(slave)
    closing = threading.Event()

    def read_the_terminal() -> None:  # until the window closes (then the terminal hangs up)
        while not closing.is_set():
            if select.select([master], [], [], 0.2)[0]:
                try:
                    stack.output += os.read(master, 65536)
                except OSError:
                    break
        os.close(master)

    reader = threading.Thread(target=read_the_terminal, daemon=True)
    reader.start()
    try:
        stack.start_machines(1)
        runner = stack.runner()

        closing.set()  # the window closes
        reader.join(5)

        wait_for(lambda: not machine_processes(home, stack.agent_port), 15, "the local machines to stop")
        stack.wait_stopped(runner)
        assert mounts_under(str(home)) == [], "the machines' job areas are still mounted"
    except AssertionError:
        print(stack.output.decode(errors="replace")[-5000:])
        raise
    finally:
        closing.set()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(shell.pid, signal.SIGKILL)
        shell.wait()


@pytest.mark.django_db(transaction=True)
def test_a_start_ends_the_machines_of_its_home_that_no_live_row_owns(tworld: Any, tmp_path: Path) -> None:
    """`make dev` marked the rows of the previous run's machines lost but left their processes
    running (and never saw a machine whose record was gone). At start it now ends every process
    of its home's machines that no live row owns, and keeps a machine a live row still owns."""
    from django.core.management import call_command
    from django.test import override_settings

    from apps.machines.lifecycle import owner_labels
    from catacloud.providers import LABEL_INSTANCE, MachineSpec
    from catacloud.providers.local import LocalProvider
    from testkit.builders import instance_row

    home = tmp_path / "home"
    state_dir = home / "machines" / "local"
    tworld.account.config = {"state_dir": str(state_dir)}
    tworld.account.save()
    provider = LocalProvider(config={"state_dir": str(state_dir)}, credentials={})
    pids = {}
    for name, status in (("kept", "ready"), ("ghost", "lost"), ("unrecorded", "terminated")):
        row = instance_row(tworld.org, tworld.machine_type, status=status, provider_id="")
        spec = MachineSpec(
            instance_id=str(row.pk),
            labels={**owner_labels(), LABEL_INSTANCE: str(row.pk)},
            server_type="local",
            image="local",
            command=(sys.executable, "-c", "import time; time.sleep(300)"),
        )
        provider.create(spec)
        row.provider_id = str(row.pk)
        row.save(update_fields=["provider_id"])
        record = state_dir / f"{row.pk}.json"
        pids[name] = json.loads(record.read_text())["pid"]
        if name == "unrecorded":
            record.unlink()  # its record is gone, its processes are not

    try:
        with override_settings(CATACLOUD_HOME=str(home)):
            call_command("dev_bootstrap", org="acme", stdout=io.StringIO(), stderr=io.StringIO())

        def dead(pid: int) -> bool:
            try:
                return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                return True

        wait_for(lambda: dead(pids["ghost"]) and dead(pids["unrecorded"]), 10, "the leftovers to end")
        assert not dead(pids["kept"])
    finally:
        for pid in pids.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
