"""Shared benchmark plumbing: the bench database, real processes, fixtures, statistics, results.

The bench runs against its own database ``catacloud_bench`` on the server named by
``DATABASE_URL`` (created and migrated when missing, flushed between parts) and Redis
database 14, so a running ``make dev`` (database ``catacloud``, Redis 0) is never touched.
Inside pytest (the smoke tests) the parts use pytest-django's test database and Redis 15
instead: everything here derives the URLs from the live Django connection and settings.
"""

from __future__ import annotations

import contextlib
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

ROOT = Path(__file__).resolve().parent.parent
BENCH_DB = "catacloud_bench"
BENCH_REDIS_DB = 14

Progress = Callable[[str], None]


def say(message: str) -> None:
    print(message, flush=True)


# ---- the bench database -------------------------------------------------------------------------


def setup_django_for_bench() -> None:
    """Point Django at ``catacloud_bench`` and Redis 14, create and migrate the database."""
    import psycopg

    url = os.environ.get("DATABASE_URL")
    if not url:
        raise SystemExit("DATABASE_URL is not set: run through `make bench` (it starts embedded services)")
    parts = urlsplit(url)
    bench_url = url if parts.path.strip("/") == BENCH_DB else urlunsplit(parts._replace(path=f"/{BENCH_DB}"))
    admin_url = urlunsplit(parts._replace(path="/postgres"))
    with psycopg.connect(admin_url, autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [BENCH_DB]).fetchone():
            conn.execute(f'CREATE DATABASE "{BENCH_DB}"')
    redis = urlsplit(os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    os.environ.update(
        DATABASE_URL=bench_url,
        REDIS_URL=urlunsplit(redis._replace(path=f"/{BENCH_REDIS_DB}")),
        DJANGO_SETTINGS_MODULE="config.settings",
        CATACLOUD_EMBEDDED="1",
        DATABASE_CONN_MAX_AGE="0",
    )
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0, interactive=False)


def flush() -> None:
    """Empty the bench database and the bench Redis database (between parts)."""
    from django.core.management import call_command
    from django.db import connection

    assert connection.settings_dict["NAME"] in (BENCH_DB,) or "test" in connection.settings_dict["NAME"], (
        "refusing to flush a database that is not the bench or test database"
    )
    call_command("flush", interactive=False, verbosity=0)
    purge_redis()


def purge_redis() -> None:
    import redis
    from django.conf import settings

    redis.Redis.from_url(settings.REDIS_URL).flushdb()


def database_url() -> str:
    from django.db import connection

    s = connection.settings_dict
    auth = quote(s["USER"] or "")
    if s.get("PASSWORD"):
        auth += ":" + quote(s["PASSWORD"])
    return f"postgresql://{auth}@{s.get('HOST') or '127.0.0.1'}:{s.get('PORT') or 5432}/{s['NAME']}"


def analyze(*tables: str) -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {', '.join(tables)}")


# ---- real processes ---------------------------------------------------------------------------


def process_env(**extra: str) -> dict[str, str]:
    from django.conf import settings

    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.update(
        DATABASE_URL=database_url(),
        REDIS_URL=settings.REDIS_URL,
        DJANGO_SETTINGS_MODULE="config.settings",
        PYTHONUNBUFFERED="1",
        CATACLOUD_EMBEDDED="1",
        DJANGO_DEBUG="0",
        DJANGO_ALLOWED_HOSTS="127.0.0.1,localhost",
        LOG_LEVEL="WARNING",
    )
    env.update(extra)  # may override the above (the chaos soak brings its own Redis)
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

    def check(self) -> None:
        if self.popen.poll() is not None:
            raise RuntimeError(f"{self.name} exited:\n{self.output()[-3000:]}")

    def stop(self, timeout: float = 15) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, 9)
                self.popen.wait()
        self._fh.close()


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.02) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def celery_worker(tmp: Path, concurrency: int = 2, **env: str) -> Iterator[Proc]:
    from config.celery import app

    name = f"bench-{uuid.uuid4().hex[:8]}@localhost"
    args = [sys.executable, "-m", "celery", "-A", "config", "worker", "--loglevel", "WARNING", "-n", name]
    args += ["--concurrency", str(concurrency), "--without-gossip", "--without-mingle"]
    proc = Proc("worker", args, process_env(**env), tmp / "worker.log")
    try:

        def ready() -> bool:
            proc.check()
            return bool(app.control.ping(destination=[name], timeout=0.3))

        wait_for(ready, 60, "the celery worker to answer a ping", interval=0.1)
        yield proc
    finally:
        proc.stop()


@contextlib.contextmanager
def celery_beat(tmp: Path, **env: str) -> Iterator[Proc]:
    args = [sys.executable, "-m", "celery", "-A", "config", "beat", "--loglevel", "WARNING"]
    args += ["--schedule", str(tmp / "beat-schedule")]
    proc = Proc("beat", args, process_env(**env), tmp / "beat.log")
    try:
        yield proc
    finally:
        proc.stop()


@contextlib.contextmanager
def gunicorn(tmp: Path, *, workers: int = 2, threads: int = 4, **env: str) -> Iterator[str]:
    """The web app under gunicorn (gthread, like `make dev`); yields its base URL."""
    import http.client

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    metrics = tmp / "prometheus"
    metrics.mkdir(exist_ok=True)
    args = [sys.executable, "-m", "gunicorn", "config.wsgi", "--bind", f"127.0.0.1:{port}"]
    args += ["--workers", str(workers), "--threads", str(threads), "--log-level", "warning"]
    proc = Proc(
        "gunicorn",
        args,
        process_env(
            CATACLOUD_PUBLIC_URL=url,
            PROMETHEUS_MULTIPROC_DIR=str(metrics),
            DATABASE_CONN_MAX_AGE="60",
            **env,
        ),
        tmp / "gunicorn.log",
    )

    def healthy() -> bool:
        proc.check()
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/healthz")
            return conn.getresponse().status in (200, 503)
        except OSError:
            return False

    try:
        wait_for(healthy, 60, "gunicorn to answer /healthz", interval=0.1)
        yield url
    finally:
        proc.stop()


@contextlib.contextmanager
def temp_dir(prefix: str) -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix=f"catacloud-bench-{prefix}-") as tmp:
        yield Path(tmp)


def stop_local_machines(state_dir: Path) -> None:
    """Never leave agent processes behind."""
    from catacloud.providers.local import LocalProvider

    provider = LocalProvider(config={"state_dir": str(state_dir), "stop_timeout_seconds": 2}, credentials={})
    for machine in provider.list({}):
        with contextlib.suppress(Exception):
            provider.delete(machine.provider_id)


# ---- fixtures ---------------------------------------------------------------------------------


@dataclass
class Tenant:
    org: Any
    account: Any
    machine_type: Any
    grant: Any
    user: Any


def tenant(
    name: str,
    *,
    kind: str = "fake",
    state_dir: Path | None = None,
    cpus: int = 2,
    **grant: Any,
) -> Tenant:
    """An org with one machine type (provider ``kind``) granted to it; names made unique."""
    from django.contrib.auth import get_user_model

    from apps.machines.models import MachineType, OrgMachineType, ProviderAccount
    from apps.orgs.models import Organization
    from apps.orgs.services import membership_set

    suffix = uuid.uuid4().hex[:6]
    org = Organization.objects.create(slug=f"{name}-{suffix}", name=f"Bench {name}")
    user = get_user_model().objects.create_user(f"{name}-{suffix}")
    membership_set(org=org, user=user, role="admin")
    config = {"state_dir": str(state_dir)} if kind == "local" else {"account": f"bench-{suffix}"}
    account = ProviderAccount.objects.create(name=f"{name}-{suffix}", kind=kind, config=config)
    mt = MachineType.objects.create(
        name=f"{name}-{suffix}",
        provider_account=account,
        server_type="local" if kind == "local" else "f",
        cpus=cpus,
        memory_mb=2048,
        price_per_hour=Decimal("0.0095"),
        billing_increment_seconds=3600,
    )
    defaults = {"max_pool_size": 1_000_000, "max_instances": 1_000_000, "max_concurrent_jobs": 1000}
    g = OrgMachineType.objects.create(org=org, machine_type=mt, **{**defaults, **grant})
    return Tenant(org=org, account=account, machine_type=mt, grant=g, user=user)


def add_ready_members(pool: Any, n: int) -> None:
    """``n`` ready members, inserted directly (what a warmed pool holds)."""
    from datetime import timedelta

    from django.utils import timezone

    from apps.machines.models import MachineInstance

    now = timezone.now()
    mt = pool.machine_type
    MachineInstance.objects.bulk_create(
        (
            MachineInstance(
                org_id=pool.org_id,
                machine_type=mt,
                provider_account_id=mt.provider_account_id,
                machine_type_version=mt.version,
                pool=pool,
                status="ready",
                ready_at=now + timedelta(microseconds=i),
                provisioning_started_at=now,
                last_heartbeat_at=now,
                provider_id=f"bench-{i}",
            )
            for i in range(n)
        ),
        batch_size=2000,
    )


# ---- statistics ---------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


# ---- results ------------------------------------------------------------------------------------


@dataclass
class Figure:
    """One reported number, with its target and what it is compared with."""

    name: str
    value: float
    unit: str = ""
    target: str = ""  # e.g. ">= 5x naive"; "" when the figure is informational
    baseline: str = ""  # what the ratio compares with, e.g. "naive 812/s"
    ratio: float | None = None
    met: bool | None = None
    note: str = ""


@dataclass
class PartResult:
    part: str
    title: str
    figures: list[Figure] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)  # raw numbers for plots and checks
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    quick: bool = False
    date: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PartResult:
        figures = [Figure(**f) for f in data.pop("figures", [])]
        return cls(figures=figures, **data)

    def figure(self, name: str) -> Figure:
        return next(f for f in self.figures if f.name == name)
