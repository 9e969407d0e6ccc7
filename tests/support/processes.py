"""Real Celery worker and beat processes for end-to-end tests.

They run as separate processes against the test database (pytest-django's
``test_catacloud``) and a Redis database reserved for tests, exactly as in production.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from django.conf import settings

from benchmarks.harness import database_url

ROOT = Path(__file__).resolve().parents[2]


# The URL of the database Django is connected to (under pytest: the test database).
test_database_url = database_url


def process_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.update(
        DATABASE_URL=test_database_url(),
        REDIS_URL=settings.REDIS_URL,
        DJANGO_SETTINGS_MODULE="config.settings",
        PYTHONUNBUFFERED="1",
        CATACLOUD_EMBEDDED="1",
        DATABASE_CONN_MAX_AGE="0",
        CATACLOUD_STRICT_REGISTRIES="1",
        **extra,
    )
    return env


class Proc:
    def __init__(self, name: str, args: list[str], env: dict[str, str], log: Path) -> None:
        self.name, self.log = name, log
        self._fh = log.open("wb")
        self.popen = subprocess.Popen(
            args, env=env, cwd=ROOT, stdout=self._fh, stderr=subprocess.STDOUT, start_new_session=True
        )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self, timeout: float = 15) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, 9)
                self.popen.wait()
        self._fh.close()


def wait_for(predicate, timeout: float, what: str, interval: float = 0.05):
    """Poll ``predicate`` until it returns something truthy; fail with ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def purge_broker() -> None:
    import redis

    redis.Redis.from_url(settings.REDIS_URL).flushdb()


@contextmanager
def celery_worker(tmp: Path, concurrency: int = 4, **env: str) -> Iterator[Proc]:
    from config.celery import app

    name = f"test-{uuid.uuid4().hex[:8]}@localhost"
    proc = Proc(
        "worker",
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "config",
            "worker",
            "--loglevel",
            "INFO",
            "-n",
            name,
            "--concurrency",
            str(concurrency),
            "--without-gossip",
            "--without-mingle",
            "-E",
        ],
        process_env(**env),
        tmp / f"worker-{name}.log",
    )
    try:

        def ready() -> bool:
            if proc.popen.poll() is not None:
                raise AssertionError(f"celery worker died:\n{proc.output()[-3000:]}")
            return bool(app.control.ping(destination=[name], timeout=0.3))

        wait_for(ready, 60, "the celery worker to answer a ping")
        yield proc
    finally:
        proc.stop()


@contextmanager
def celery_beat(tmp: Path, **env: str) -> Iterator[Proc]:
    proc = Proc(
        "beat",
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "config",
            "beat",
            "--loglevel",
            "INFO",
            "--schedule",
            str(tmp / "beat-schedule"),
        ],
        process_env(**env),
        tmp / "beat.log",
    )
    try:
        yield proc
    finally:
        proc.stop()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def gunicorn(
    tmp: Path, *, workers: int = 2, threads: int = 8, args: tuple[str, ...] = (), **env: str
) -> Iterator[tuple[str, Proc]]:
    """The web app under gunicorn (gthread, as `make dev` runs it) in multiprocess metrics
    mode; yields its base URL and the process (its log holds the access log)."""
    import http.client

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    metrics = tmp / "prometheus"
    metrics.mkdir(exist_ok=True)
    argv = [sys.executable, "-m", "gunicorn", "config.wsgi", "--bind", f"127.0.0.1:{port}"]
    argv += ["--workers", str(workers), "--threads", str(threads), *args]
    proc = Proc(
        "gunicorn",
        argv,
        process_env(
            CATACLOUD_PUBLIC_URL=url,
            PROMETHEUS_MULTIPROC_DIR=str(metrics),
            DJANGO_ALLOWED_HOSTS="127.0.0.1,localhost",
            **env,
        ),
        tmp / f"gunicorn-{port}.log",
    )

    def healthy() -> bool:
        if proc.popen.poll() is not None:
            raise AssertionError(f"gunicorn died:\n{proc.output()[-3000:]}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/healthz")
            return conn.getresponse().status in (200, 503)
        except OSError:
            return False

    try:
        wait_for(healthy, 60, "gunicorn to answer /healthz", interval=0.1)
        yield url, proc
    finally:
        proc.stop()


@contextmanager
def agent_server(tmp: Path, **env: str) -> Iterator[tuple[Proc, str]]:
    """The agent server (uvicorn, config/agent_asgi.py) as `make dev` runs it: (process, URL)."""
    import urllib.error
    import urllib.request

    from catacloud.cli import agent_server_command

    port = free_port()
    proc = Proc(
        "agent-api",
        agent_server_command(host="127.0.0.1", port=port),
        {**process_env(), "DATABASE_CONN_MAX_AGE": "60", **env},
        tmp / "agent-api.log",
    )
    url = f"http://127.0.0.1:{port}"

    def answers() -> bool:
        if proc.popen.poll() is not None:
            raise AssertionError(f"the agent server died:\n{proc.output()[-3000:]}")
        try:
            urllib.request.urlopen(f"{url}/api/agent/v1/work", timeout=2)
        except urllib.error.HTTPError:
            return True  # 401: it is up
        except OSError:
            return False
        return True

    try:
        wait_for(answers, 60, "the agent server to answer")
        yield proc, url
    finally:
        proc.stop()
