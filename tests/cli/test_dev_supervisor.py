"""`make dev` survives a crash: the supervisor restarts a program that dies and says so;
Ctrl-C still stops everything."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from catacloud.cli import dev_programs
from catacloud.supervisor import Supervisor
from testkit.processes import ROOT, TESTS, free_port, wait_for


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
    programs = dev_programs(env=TESTS.env(), home=tmp_path, port=1, flower_port=1)
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


@pytest.mark.e2e
@pytest.mark.django_db(transaction=True)
def test_ctrl_c_lets_the_worker_finish_its_task_and_stop_its_own_pool(tmp_path: Path, tworld: object) -> None:
    """Ctrl-C signalled the worker's whole process group: its pool children died under their
    tasks (``Process 'ForkPoolWorker-1' … exited with 'signal 15 (SIGTERM)'``, WorkerLostError,
    and SIGKILL when a task outlived the stop timeout). Only the worker itself is asked to stop:
    it finishes the task in flight (a warm shutdown) and ends its pool in order."""
    import psycopg

    from apps.core.broker import enqueue
    from apps.machines.models import MachineInstance
    from apps.pools.models import InstancePool
    from config.celery import app
    from testkit.builders import fake_machine_type
    from testkit.processes import database_url

    mt, grant = fake_machine_type(tworld.org, grant={"max_pool_size": 5, "max_instances": 5})  # type: ignore[attr-defined]
    pool = InstancePool.objects.create(org=grant.org, name="p", machine_type=mt, target_size=1, max_size=1)
    name = f"dev-{uuid.uuid4().hex[:8]}@localhost"
    worker = next(
        p for p in dev_programs(env=TESTS.env(), home=tmp_path, port=1, flower_port=1) if p.name == "worker"
    )
    worker.argv += ["-n", name, "--without-gossip", "--without-mingle"]
    out = Output()
    supervisor = Supervisor([worker], out=out, stop_timeout=20)
    thread = threading.Thread(target=supervisor.run, daemon=True)
    thread.start()
    try:
        with psycopg.connect(database_url()) as other:
            wait_for(
                lambda: bool(app.control.ping(destination=[name], timeout=0.5)), 90, "the worker to answer"
            )
            # The refill waits for the grant's row lock, which this connection holds: a task in flight.
            other.execute("SELECT 1 FROM machines_orgmachinetype WHERE id = %s FOR UPDATE", [grant.pk])
            enqueue("apps.pools.tasks.pool_refill_task", str(pool.pk))
            waiting = "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            with psycopg.connect(database_url(), autocommit=True) as watcher:  # a fresh view each time
                wait_for(
                    lambda: watcher.execute(waiting).fetchone()[0] > 0,  # type: ignore[index]
                    30,
                    "the refill to wait for the lock",
                )
            supervisor.stop()  # Ctrl-C
            time.sleep(2)
            other.rollback()  # the task goes on and ends
        thread.join(30)
    finally:
        supervisor.stop()
        thread.join(30)
    stopping = out.getvalue().split("stopping worker", 1)[-1]
    assert "exited with" not in stopping and "WorkerLostError" not in stopping, stopping
    assert "SIGKILL" not in stopping, stopping
    assert MachineInstance.objects.filter(pool=pool).count() == 1  # the refill finished its work


@pytest.mark.e2e
@pytest.mark.django_db(transaction=True)
def test_make_devs_web_serves_metrics_and_its_root_leads_to_the_console(tmp_path: Path) -> None:
    """`/metrics` answered 403 in `make dev` while the API walkthrough and the configuration
    page said it was open; "/" (the console's "View site") was a debug 404."""
    import urllib.error
    import urllib.request

    from catacloud.cli import dev_env

    port = free_port()
    (tmp_path / "prometheus").mkdir()
    env = dev_env(TESTS.env(), port=port, agent_port=free_port(), metrics_dir=tmp_path / "prometheus")
    web = next(p for p in dev_programs(env=env, home=tmp_path, port=port, flower_port=1) if p.name == "web")
    out = Output()
    supervisor = Supervisor([web], out=out, stop_timeout=10)
    thread = threading.Thread(target=supervisor.run, daemon=True)
    thread.start()

    def get(path: str) -> tuple[int, str, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
                return answer.status, answer.url, answer.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.url, exc.read().decode()
        except OSError:
            return 0, "", ""

    try:
        wait_for(lambda: get("/livez")[0] == 200, 60, "the dev web to answer")
        status, _, body = get("/metrics")
        assert status == 200 and "catacloud_" in body, (status, body[:300])
        status, url, _ = get("/")  # redirected to the console, then to its login
        assert status == 200 and url.startswith(f"http://127.0.0.1:{port}/admin/login/"), (status, url)
    finally:
        supervisor.stop()
        thread.join(30)


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


def test_a_burst_of_stop_signals_still_stops_every_program(tmp_path: Path) -> None:
    """`make` and the `kill` that stops it each send SIGTERM, a user presses Ctrl-C again: the
    stop signals come close together. A handler that called Event.set() was entered again inside
    it by the next signal and waited for its own lock forever (`make dev` never returned)."""
    # as in `make dev`, whose own handlers come back after the run and ignore what comes late
    late = "import signal\nfor s in (2, 1, 15):\n    signal.signal(s, signal.SIG_IGN)\n"
    proc = subprocess.Popen(
        [sys.executable, "-c", late + SCRIPT],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        started = 0
        while started < 2:
            line = proc.stdout.readline()
            assert line, "the supervisor exited before starting its programs"
            started += "started" in line
        # signals all the while (one handler's run inside another's needs a signal to come
        # while a handler runs: those that come together are handled once, one after the other)
        until = time.monotonic() + 3
        with contextlib.suppress(ProcessLookupError):
            while proc.poll() is None and time.monotonic() < until:
                for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                    os.kill(proc.pid, signum)
        assert proc.wait(30) == 0, "the supervisor hung in its own signal handler"
        assert "stopping a, b" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


STUBBORN = """
import signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # like gunicorn waiting out long polls on SIGTERM
signal.signal(signal.SIGINT, lambda *_: sys.exit(0))  # its quick shutdown
print("up", flush=True)
time.sleep(300)
"""


def run_then_stop(supervisor: Supervisor, name: str) -> float:
    """Run ``supervisor`` until its one program (STUBBORN) says it is up, then stop it (Ctrl-C)
    and wait for the stop; returns when the stop was asked (time.monotonic())."""
    thread = threading.Thread(target=supervisor.run)
    thread.start()
    wait_for(lambda: f"{name} | up" in supervisor.out.getvalue(), 30, "the program to start")  # type: ignore[attr-defined]
    started = time.monotonic()
    supervisor.stop()
    thread.join(30)
    return started


def test_a_program_stops_on_its_own_stop_signal_without_a_kill() -> None:
    """gunicorn's SIGTERM waits for open requests (agents' long polls) up to its graceful
    timeout; `make dev` asks it with SIGINT, its quick shutdown, so Ctrl-C needs no SIGKILL."""
    from catacloud.supervisor import Program

    out = Output()
    web = Program("web", [sys.executable, "-c", STUBBORN], stop_signal=signal.SIGINT)
    supervisor = Supervisor([web], out=out, stop_timeout=10)
    started = run_then_stop(supervisor, "web")
    assert time.monotonic() - started < 5
    assert "SIGKILL" not in out.getvalue()
    programs = {p.name: p for p in dev_programs(env={}, home=Path("/tmp"), port=1, flower_port=2)}
    assert programs["web"].stop_signal == signal.SIGINT


def test_what_runs_on_stop_does_not_wait_for_a_program_that_takes_its_stop_timeout() -> None:
    """`make dev` ends its local machines when stopped. It did so only once every program had
    ended: a worker whose database had gone (`make clean`) took the whole stop timeout, and the
    machines ran on meanwhile. What runs on a stop now starts with the stop, and the stop returns
    only after it."""
    from catacloud.supervisor import Program

    out = Output()
    ran: list[float] = []
    stubborn = Program("worker", [sys.executable, "-c", STUBBORN])  # ignores SIGTERM
    supervisor = Supervisor([stubborn], out=out, stop_timeout=4, on_stop=lambda: ran.append(time.monotonic()))
    started = run_then_stop(supervisor, "worker")
    assert ran and ran[0] - started < 1.5, (ran, started)  # with the stop, not after the program's 4 s
    assert time.monotonic() - started >= 4 and "ignored SIGTERM for 4s: SIGKILL" in out.getvalue()


@contextlib.contextmanager
def readyz(not_ready: int = 0) -> Iterator[str]:
    """A /readyz on loopback that answers 503 ``not_ready`` times, then 200 ready; yields its URL."""
    import http.server

    answers = iter([(503, {"status": "not_ready"})] * not_ready)

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            code, answer = next(answers, (200, {"status": "ready"}))
            body = json.dumps(answer).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/readyz"
    finally:
        server.shutdown()


def test_the_banner_comes_again_once_healthy() -> None:
    """The first banner scrolls away under the Celery banners: it is printed again when
    /readyz says every part is up (503 until then)."""
    from catacloud.cli import _announce_when_healthy

    supervisor = Supervisor([], out=Output())
    with readyz(not_ready=2) as url:
        _announce_when_healthy(supervisor, url, ["  token    cc_x"], time.monotonic())
    text = supervisor.out.getvalue()  # type: ignore[attr-defined]
    assert "Catacloud is ready (" in text and "token    cc_x" in text


def test_the_ready_banner_counts_the_users_whole_wait() -> None:
    """`make dev` passes the time it started (before creating the venv and installing), and the
    ready banner counts from there, not from when the Python program began."""
    from catacloud.cli import _announce_when_healthy, dev_started_at

    dry_run = subprocess.run(["make", "-n", "dev"], cwd=ROOT, capture_output=True, text=True, check=True)
    passed = re.search(r"CATACLOUD_DEV_STARTED=(\d+) ", dry_run.stdout)
    assert passed and abs(int(passed[1]) - time.time()) < 60, dry_run.stdout

    supervisor = Supervisor([], out=Output())
    with readyz() as url:
        started = dev_started_at({"CATACLOUD_DEV_STARTED": str(int(time.time()) - 47)})
        _announce_when_healthy(supervisor, url, [], started)
    took = re.search(r"Catacloud is ready \((\d+) s;", supervisor.out.getvalue())  # type: ignore[attr-defined]
    assert took and 46 <= int(took[1]) <= 50, supervisor.out.getvalue()  # type: ignore[attr-defined]


@pytest.mark.e2e
def test_flower_starts_without_inspect_warnings(tmp_path: Path) -> None:
    """Flower starts with the worker, before any worker can answer its first questions: that
    must not print four "Inspect method … failed" lines at every start."""
    import urllib.request

    port = free_port()
    programs = dev_programs(env=TESTS.env(), home=tmp_path, port=1, flower_port=port)
    flower = next(p for p in programs if p.name == "flower")
    out = Output()
    supervisor = Supervisor([flower], out=out, stop_timeout=10)
    thread = threading.Thread(target=supervisor.run, daemon=True)
    thread.start()

    def answers() -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthcheck", timeout=1) as response:
                return response.status == 200
        except OSError:
            return False

    try:
        wait_for(answers, 60, "Flower to answer")
        time.sleep(3)  # its first inspection waits for answers for 1 s
    finally:
        supervisor.stop()
        thread.join(30)
    log = out.getvalue()
    assert "Connected to redis" in log, log  # it did ask the broker
    assert "Inspect method" not in log, log


ORPHANED = """
import sys
from collections.abc import Iterator
from pathlib import Path
from catacloud.supervisor import Program, Supervisor
sleep = [sys.executable, "-c", "import time; time.sleep(300)"]
marker = sys.argv[1]
cleanup = [sys.executable, "-c", f"open({marker!r}, 'w').write('cleaned')"]
Supervisor(
    [Program("a", sleep), Program("b", sleep)], on_orphan=cleanup, state_file=Path(sys.argv[2])
).run()
"""


def test_every_program_dies_with_a_sigkilled_supervisor_and_its_clean_up_runs(tmp_path: Path) -> None:
    """kill -9 of `make dev`'s supervisor (the OOM killer, a CI timeout, a closed terminal)
    left gunicorn, beat and PostgreSQL running; the next `make dev` could not bind its port."""
    from catacloud.supervisor import leftovers

    marker, state = tmp_path / "cleaned", tmp_path / "dev.programs.json"
    proc = subprocess.Popen(
        [sys.executable, "-c", ORPHANED, str(marker), str(state)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    pids: list[int] = []
    try:
        assert proc.stdout is not None
        while len(pids) < 2:
            line = proc.stdout.readline()
            assert line, "the supervisor exited before starting its programs"
            if "started" in line:
                pids.append(int(re.search(r"pid (\d+)", line).group(1)))  # type: ignore[union-attr]
        wait_for(lambda: len(leftovers(state)) == 2, 10, "the programs recorded in the state file")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        wait_for(lambda: all(gone(pid) for pid in pids), 20, "every program gone with its supervisor")
        wait_for(marker.exists, 20, "the supervisor's clean-up (local machines, services) run")
        assert leftovers(state) == []
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)


def test_a_start_refuses_to_run_beside_a_live_stack_of_the_same_home(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from catacloud.cli import DEV_STATE, _dev_lock

    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from catacloud.cli import _dev_lock;"
            f" lock = _dev_lock(Path({str(tmp_path)!r})); print('held', flush=True); time.sleep(60)",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        assert _dev_lock(tmp_path) is None
        assert f"pid {holder.pid}" in capsys.readouterr().err
    finally:
        holder.kill()
        holder.wait()
    # its supervisor is gone but one of its programs still runs (here: a sleep we started)
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        started = psutil.Process(orphan.pid).create_time()
        (tmp_path / DEV_STATE).write_text(
            json.dumps({"supervisor": 1, "programs": {"web": {"pid": orphan.pid, "started": started}}})
        )
        assert _dev_lock(tmp_path) is None
        err = capsys.readouterr().err
        assert f"web (pid {orphan.pid}" in err and f"kill {orphan.pid}" in err
    finally:
        orphan.kill()
        orphan.wait()
    lock = _dev_lock(tmp_path)  # nothing left: it starts
    assert lock is not None
    lock.close()


def test_gunicorns_control_socket_lives_under_catacloud_home(tmp_path: Path) -> None:
    """It was ~/.gunicorn/gunicorn.ctl, one for every `make dev` on the host."""
    web = next(p for p in dev_programs(env={}, home=tmp_path, port=1, flower_port=2) if p.name == "web")
    assert web.argv[web.argv.index("--control-socket") + 1] == str(tmp_path / "gunicorn.ctl")


CTRL_C = """
import signal, sys, time
from catacloud.cli import _own_terminal
give_back = _own_terminal() if sys.argv[1] == "own" else (lambda: None)
def stop(*_):
    give_back()
    sys.exit(0)
signal.signal(signal.SIGINT, stop)
print("ready", flush=True)
time.sleep(60)
"""


def _make_dev_ctrl_c(tmp_path: Path, mode: str) -> int | None:
    """Run `make dev` (a script that stops on SIGINT) in a real terminal (a pty), press Ctrl-C
    once it is ready; make's exit status (None: still running after 20 s)."""
    import fcntl
    import pty
    import termios

    tmp_path.mkdir(exist_ok=True)
    script = tmp_path / "stop.py"
    script.write_text(CTRL_C)
    (tmp_path / "Makefile").write_text(f"dev:\n\t@{sys.executable} {script} {mode}\n")
    master, slave = pty.openpty()

    def controlling_terminal() -> None:
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)
        # as a terminal's shell starts a foreground job: Ctrl-C not ignored, whatever this
        # process inherited (a background `make test` runs with SIGINT ignored)
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    make = subprocess.Popen(
        ["make", "-s", "-C", str(tmp_path), "dev"],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        start_new_session=True,
        preexec_fn=controlling_terminal,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    os.close(slave)
    try:
        seen = b""
        while b"ready" not in seen:
            seen += os.read(master, 1024)
        os.write(master, b"\x03")  # what the terminal sends for Ctrl-C
        try:
            return make.wait(20)
        except subprocess.TimeoutExpired:
            return None
    finally:
        if make.poll() is None:
            os.killpg(make.pid, signal.SIGKILL)
        os.close(master)


def test_ctrl_c_in_a_terminal_ends_make_dev_with_status_0(tmp_path: Path) -> None:
    """Ctrl-C reached `make` too, which died of SIGINT (status 130) whatever the supervisor
    did. Under make in a real terminal, the dev runner takes the terminal's foreground for
    itself, so make sees a clean exit."""
    assert _make_dev_ctrl_c(tmp_path, "own") == 0


def test_without_taking_the_terminal_make_dies_of_ctrl_c(tmp_path: Path) -> None:
    """The control case: without taking the terminal, make dies of the SIGINT (what users saw)."""
    assert _make_dev_ctrl_c(tmp_path, "shared") == -signal.SIGINT
