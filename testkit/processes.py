"""Real processes against the database Django is connected to: a Celery worker and beat,
gunicorn, each with its log in a file; polling with a deadline; stopping local machines.

Tests and benchmarks run the same processes with a few settings of their own: a ``Profile``
holds those (``TESTS``, ``BENCH``), everything else is common.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import quote

ROOT = Path(__file__).resolve().parent.parent


class TimedOut(AssertionError, TimeoutError):
    """``wait_for`` ran out of time: a failed assertion in a test, a timeout in a benchmark."""


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    """Poll ``predicate`` until it returns something truthy (returned); ``TimedOut`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimedOut(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def database_url() -> str:
    """The URL of the database Django is connected to (under pytest: the test database)."""
    from django.db import connection

    s = connection.settings_dict
    auth = quote(s["USER"] or "")
    if s.get("PASSWORD"):
        auth += ":" + quote(s["PASSWORD"])
    return f"postgresql://{auth}@{s.get('HOST') or '127.0.0.1'}:{s.get('PORT') or 5432}/{s['NAME']}"


def purge_redis() -> None:
    """Empty the Redis database of the settings (the test or bench one): the broker's queues too."""
    import redis
    from django.conf import settings

    redis.Redis.from_url(settings.REDIS_URL).flushdb()


class Proc:
    """A process in its own session (``kill`` ends its whole group), its output in ``log``."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], log: Path) -> None:
        self.name, self.log = name, log
        self._fh = log.open("wb")
        self.popen = subprocess.Popen(
            args, env=env, cwd=ROOT, stdout=self._fh, stderr=subprocess.STDOUT, start_new_session=True
        )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def check(self) -> None:
        """Raise, with the end of its log, if the process has exited."""
        if self.popen.poll() is not None:
            raise RuntimeError(f"{self.name} exited:\n{self.output()[-3000:]}")

    def stop(self, timeout: float = 15) -> None:
        """SIGTERM, then SIGKILL to the group after ``timeout``."""
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, 9)
                self.popen.wait()
        self._fh.close()

    def kill(self) -> None:
        """SIGKILL the whole group at once (a crash, not a shutdown)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, 9)
        self.popen.wait()
        self._fh.close()


def worker_args(name: str, *, concurrency: int, loglevel: str, events: bool = False) -> list[str]:
    """The command line of one Celery worker of the project's app."""
    args = [sys.executable, "-m", "celery", "-A", "config", "worker", "--loglevel", loglevel, "-n", name]
    args += ["--concurrency", str(concurrency), "--without-gossip", "--without-mingle"]
    return [*args, "-E"] if events else args


@dataclass(frozen=True)
class Profile:
    """What one side (tests, benchmarks) changes in the processes it runs: settings on top of
    the common ones (a caller's own ``**env`` goes on top of both), the worker's log level,
    whether it sends task events, its name and default concurrency."""

    prefix: str
    settings: Mapping[str, str] = field(default_factory=dict)
    loglevel: str = "INFO"
    events: bool = False
    concurrency: int = 2

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of a process against the database and Redis this process uses."""
        from django.conf import settings

        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
        env.update(
            DATABASE_URL=database_url(),
            REDIS_URL=settings.REDIS_URL,
            DJANGO_SETTINGS_MODULE="config.settings",
            PYTHONUNBUFFERED="1",
            CATACLOUD_EMBEDDED="1",
        )
        env.update(self.settings)
        env.update(extra)  # may override the above (the chaos soak brings its own Redis)
        return env

    @contextlib.contextmanager
    def celery_worker(self, tmp: Path, concurrency: int | None = None, **env: str) -> Iterator[Proc]:
        """A worker, yielded once it answers a ping."""
        from config.celery import app

        name = f"{self.prefix}-{uuid.uuid4().hex[:8]}@localhost"
        args = worker_args(
            name, concurrency=concurrency or self.concurrency, loglevel=self.loglevel, events=self.events
        )
        proc = Proc("worker", args, self.env(**env), tmp / f"worker-{name}.log")
        try:

            def ready() -> bool:
                proc.check()
                return bool(app.control.ping(destination=[name], timeout=0.3))

            wait_for(ready, 60, "the celery worker to answer a ping", interval=0.1)
            yield proc
        finally:
            proc.stop()

    @contextlib.contextmanager
    def celery_beat(self, tmp: Path, **env: str) -> Iterator[Proc]:
        args = [sys.executable, "-m", "celery", "-A", "config", "beat", "--loglevel", self.loglevel]
        args += ["--schedule", str(tmp / "beat-schedule")]
        proc = Proc("beat", args, self.env(**env), tmp / "beat.log")
        try:
            yield proc
        finally:
            proc.stop()

    @contextlib.contextmanager
    def gunicorn(
        self, tmp: Path, *, workers: int = 2, threads: int = 4, args: tuple[str, ...] = (), **env: str
    ) -> Iterator[Web]:
        """The web app under gunicorn (gthread, like `make dev`) in multiprocess metrics mode;
        ``args`` go to gunicorn's command line. Yields (url, proc) once it answers /healthz."""
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        metrics = tmp / "prometheus"
        metrics.mkdir(exist_ok=True)
        argv = [sys.executable, "-m", "gunicorn", "config.wsgi", "--bind", f"127.0.0.1:{port}"]
        argv += ["--workers", str(workers), "--threads", str(threads), "--log-level", self.loglevel.lower()]
        argv += ["--no-control-socket"]  # not ~/.gunicorn/gunicorn.ctl, shared with every other run
        web_env = {"CATACLOUD_PUBLIC_URL": url, "PROMETHEUS_MULTIPROC_DIR": str(metrics), **WEB}
        proc = Proc(
            "gunicorn",
            [*argv, *args],
            self.env(**{**web_env, **env}),
            tmp / f"gunicorn-{port}.log",
        )
        with _serving(proc, url) as web:
            yield web

    @contextlib.contextmanager
    def agent_server(
        self, tmp: Path, probe: str = "/api/agent/v1/work", workers: int = 1, **env: str
    ) -> Iterator[Web]:
        """The agent server (uvicorn, config/agent_asgi.py) as `make dev` runs it; yields
        (url, proc) once ``probe`` answers (by default an unauthenticated poll: 401, no
        database connection opened; ``/healthz`` opens one and keeps it)."""
        from catacloud.cli import agent_server_command

        port = free_port()
        url = f"http://127.0.0.1:{port}"
        argv = agent_server_command(host="127.0.0.1", port=port, workers=workers)
        proc = Proc(
            "agent-api",
            argv,
            self.env(**{**WEB, "DATABASE_CONN_MAX_AGE": "60", **env}),
            tmp / "agent-api.log",
        )
        with _serving(proc, url, probe) as web:
            yield web


class Web(NamedTuple):
    url: str
    proc: Proc


# What every web process gets (the hosts the tests and benchmarks call it by).
WEB = {"DJANGO_ALLOWED_HOSTS": "127.0.0.1,localhost"}


@contextlib.contextmanager
def _serving(proc: Proc, url: str, probe: str = "/healthz") -> Iterator[Web]:
    """Wait until ``proc`` answers ``probe`` at ``url`` (/healthz: 200, or 503 while a part is
    down; another path: any answer), stop it at the end."""
    import http.client
    from urllib.parse import urlsplit

    port = urlsplit(url).port

    def healthy() -> bool:
        proc.check()
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", probe)
            status = conn.getresponse().status
            return probe != "/healthz" or status in (200, 503)
        except OSError:
            return False

    try:
        wait_for(healthy, 60, f"{proc.name} to answer {probe}", interval=0.1)
        yield Web(url, proc)
    finally:
        proc.stop()


# Tests: a fresh connection per request (pytest-django's database is dropped at the end) and
# registries strict as in config.settings_test; INFO logs and task events to read on failure.
TESTS = Profile(
    prefix="test",
    # Workers do not stand for the reaper's election (a tick in the middle of a test); beat does.
    settings={
        "DATABASE_CONN_MAX_AGE": "0",
        "CATACLOUD_STRICT_REGISTRIES": "1",
        "CATACLOUD_REAPER_IN_WORKERS": "0",
    },
    loglevel="INFO",
    events=True,
    concurrency=4,
)
# Benchmarks: production-like (no debug, quiet logs, connections kept as `make dev` keeps them:
# the bench's own process runs with 0, which its environment would otherwise hand to every
# worker, a new connection for every task).
BENCH = Profile(
    prefix="bench",
    settings={
        "DJANGO_DEBUG": "0",
        "DJANGO_ALLOWED_HOSTS": "127.0.0.1,localhost",
        "LOG_LEVEL": "WARNING",
        "DATABASE_CONN_MAX_AGE": "60",
    },
    loglevel="WARNING",
    concurrency=2,
)


def local_machines(state_dir: Path | str) -> list[dict[str, Any]]:
    """The local provider's machine records under ``state_dir`` (``<instance_id>.json``: pid,
    create_time, ...), read as they are now; a record being rewritten is skipped."""
    import json

    records = []
    for path in Path(state_dir).glob("*.json"):
        with contextlib.suppress(OSError, ValueError):
            records.append(json.loads(path.read_text()))
    return records


def agent_tree(record: Mapping[str, Any]) -> list[Any]:
    """A local machine's agent process and everything it started (psutil processes), or []
    once it is gone (a reused pid does not count: the start time must match the record's)."""
    import psutil

    try:
        proc = psutil.Process(record["pid"])
        if abs(proc.create_time() - record["create_time"]) > 0.05:
            return []
        return [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return []


def stop_local_machines(
    state_dir: Path | str, *, stop_timeout: float | None = None, ignore_errors: bool = False
) -> None:
    """Never leave agent processes behind: delete every machine the local provider runs under
    ``state_dir``, each even if another fails, then end any process still carrying the mark of
    a machine there (one whose record is gone); then raise the first failure, unless
    ``ignore_errors`` (a benchmark's cleanup must not hide what ended it)."""
    from catacloud.providers.local import LocalProvider, end_processes, machine_processes, release_areas

    config: dict[str, Any] = {"state_dir": str(state_dir)}
    if stop_timeout is not None:
        config["stop_timeout_seconds"] = stop_timeout
    provider = LocalProvider(config=config, credentials={})
    errors: list[Exception] = []

    def delete(provider_id: str) -> None:
        try:
            provider.delete(provider_id)
        except Exception as exc:
            errors.append(exc)

    # side by side: each waits for its agent to exit (up to the stop timeout), and a test's
    # teardown of a dozen machines one after another took seconds
    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(delete, [machine.provider_id for machine in provider.list({})]))
    end_processes([p for procs in machine_processes(state_dir).values() for p in procs])
    release_areas(state_dir)
    if errors and not ignore_errors:
        raise errors[0]


# ---- nothing left behind ------------------------------------------------------------------------

# Every process a test session starts from the tests' environment carries this variable (set in
# the pytest process before any test runs, so workers, web, agent servers, fakes, embedded
# services and agents inherit it). A local machine's environment is scrubbed instead: its sandbox
# carries the machine's mark, ``CATACLOUD_LOCAL_MACHINE=<its folder>``, under the session's
# folders. Redis (and PostgreSQL's children) write over their environment with their process
# title: they are known by their working folder (their data) in the session's folders.
SESSION_ENV = "CATACLOUD_TEST_SESSION"
# The session's folders besides pytest's temporary ones: where a test keeps what it runs outside
# pytest's 0700 folders (a `make dev` home, an embedded PostgreSQL's data: its server runs as a
# user of its own when the tests run as root).
WATCHED_FOLDERS: list[Path] = []


def session_processes(session: str, folders: Sequence[Path], since: float) -> list[Any]:
    """The processes of this host that test session ``session`` started and that still run:
    those carrying ``SESSION_ENV=session``, and those started since ``since`` (a psutil
    ``create_time``) that are a local machine whose folder, or whose working folder, is in
    ``folders``. Not this
    process (nor its ancestors, which do not carry it)."""
    import psutil

    from catacloud.providers.local import MACHINE_ENV

    bases = [os.path.abspath(f).rstrip("/") + "/" for f in folders]

    def inside(path: str) -> bool:
        return any((path.rstrip("/") + "/").startswith(base) for base in bases)

    found = []
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            env = proc.environ()
            marked = env.get(SESSION_ENV) == session
            placed = inside(env.get(MACHINE_ENV, "//")) or inside(proc.cwd())
            if marked or (placed and proc.create_time() >= since):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def describe(proc: Any) -> str:
    """``pid N (name): command line`` of a psutil process, as far as it can still be read."""
    import psutil

    try:
        return f"pid {proc.pid} ({proc.name()}): {' '.join(proc.cmdline())[:200]}"
    except psutil.Error:
        return f"pid {proc.pid} (gone)"


def leftovers_after(session: str, folders: Sequence[Path], since: float, grace: float = 5.0) -> list[str]:
    """What the session left running, once each had ``grace`` seconds to end on its own (a
    process being stopped right now is not a leftover); those are then killed, so a failed run
    still leaves nothing behind. Returns their descriptions (empty: nothing was left)."""
    import psutil

    deadline = time.monotonic() + grace
    while (left := session_processes(session, folders, since)) and time.monotonic() < deadline:
        time.sleep(0.1)
    described = [describe(proc) for proc in left]
    for proc in left:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    return described + mounts_left(folders)


def mounts_left(folders: Sequence[Path]) -> list[str]:
    """File systems (local machines' job areas) still mounted in the session's folders; each is
    unmounted now."""
    from catacloud.agent.disk import mounts_under, release_area

    left = [point for folder in folders for point in mounts_under(str(folder))]
    for point in sorted(left, key=len, reverse=True):
        release_area(point)
    return [f"a file system still mounted at {point}" for point in left]
