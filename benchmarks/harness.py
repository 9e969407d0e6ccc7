"""Shared benchmark plumbing: the bench database, the tenant fixture, statistics, results.
Real processes and the row builders come from ``testkit`` (shared with the tests).

The bench runs against its own database ``catacloud_bench`` on the server named by
``DATABASE_URL`` (created and migrated when missing, flushed between parts) and Redis
database 14, so a running ``make dev`` (database ``catacloud``, Redis 0) is never touched.
Inside pytest (the smoke tests) the parts use pytest-django's test database and Redis 15
instead: everything here derives the URLs from the live Django connection and settings.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from testkit.builders import granted_type, provider_account
from testkit.processes import purge_redis

BENCH_DB = "catacloud_bench"
BENCH_REDIS_DB = 14

# The parts `python -m benchmarks` runs, in the order the report shows them (chaos, run on its
# own by `make chaos`, comes after them in the report).
PARTS = (
    "claim",
    "rest",
    "submit",
    "replenish",
    "reaper",
    "admission",
    "cost",
    "fleet",
    "ci",
    "ci_limits",
    "images",
    "containers",
    "tail",
    "hosts",
    "selection",
)

Progress = Callable[[str], None]


def say(message: str) -> None:
    print(message, flush=True)


def save_figure(fig: Any, path: Path) -> str:
    """Lay a plot out, write it as a PNG at ``path`` and close it; returns its file name."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


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


def analyze(*tables: str) -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {', '.join(tables)}")


@contextlib.contextmanager
def temp_dir(prefix: str) -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix=f"catacloud-bench-{prefix}-") as tmp:
        yield Path(tmp)


# ---- fixtures ---------------------------------------------------------------------------------


@dataclass
class Tenant:
    org: Any
    account: Any
    machine_type: Any
    grant: Any
    user: Any


def end_on_sigterm() -> None:
    """Stopped by SIGTERM (``kill``, a CI timeout), the bench exits as from an error: the
    context managers that started its stacks (web, worker, beat, machines) unwind and end them,
    instead of leaving them running against the bench database."""
    import signal
    import sys

    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def tenant(
    name: str,
    *,
    kind: str = "fake",
    state_dir: Path | None = None,
    cpus: int = 2,
    machine_type: dict[str, Any] | None = None,
    config: dict[str, Any] | None = None,
    **grant: Any,
) -> Tenant:
    """An org with one machine type (provider ``kind``; ``machine_type`` overrides its price
    and billing; ``config`` adds to its provider account's) granted to it; names made unique."""
    from django.contrib.auth import get_user_model

    from apps.orgs.models import Organization
    from apps.orgs.services import membership_set

    suffix = uuid.uuid4().hex[:6]
    org = Organization.objects.create(slug=f"{name}-{suffix}", name=f"Bench {name}")
    user = get_user_model().objects.create_user(f"{name}-{suffix}")
    membership_set(org=org, user=user, role="admin")
    base = {"state_dir": str(state_dir)} if kind == "local" else {"account": f"bench-{suffix}"}
    account = provider_account(kind, f"{name}-{suffix}", {**base, **(config or {})})
    defaults = {"max_pool_size": 1_000_000, "max_instances": 1_000_000, "max_concurrent_jobs": 1000}
    mt, g = granted_type(
        org,
        account,
        f"{name}-{suffix}",
        cpus=cpus,
        memory_mb=2048,
        grant={**defaults, **grant},
        **{"price_per_hour": Decimal("0.0095"), "billing_increment_seconds": 3600, **(machine_type or {})},
    )
    return Tenant(org=org, account=account, machine_type=mt, grant=g, user=user)


# ---- statistics ---------------------------------------------------------------------------------


def job_until(
    t: Any, cfg: Any, stamp: str, fields: tuple[str, ...], timeout: float, interval: float = 0.005
) -> tuple[Any, tuple[Any, ...]]:
    """Submit a job of ``cfg`` for ``t``'s org and wait (:func:`job_when`, every ``interval``
    seconds) until its ``stamp`` (``started_at``, ``finished_at``) is set: its id, and its
    ``fields`` then."""
    from apps.jobs.submission import job_submit

    job = job_submit(org=t.org, config=cfg, actor="bench")
    return job.pk, job_when(job.pk, stamp, fields, timeout, interval)


def job_when(
    job_id: Any, stamp: str, fields: tuple[str, ...], timeout: float, interval: float
) -> tuple[Any, ...]:
    """Poll a job's row every ``interval`` seconds until its ``stamp`` is set: its ``fields``."""
    from apps.jobs.models import Job
    from testkit.processes import wait_for

    rows = Job.objects.filter(pk=job_id, **{f"{stamp}__isnull": False}).values_list(*fields)
    return wait_for(rows.first, timeout, f"job {job_id}'s {stamp}", interval)


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
    # Over the part's interleaved runs: how many there were, the lowest and highest value of
    # what the target judges (the ratio when there is one, else the value), and in how many
    # runs the target was met. A target met in some runs and missed in others is noise.
    runs: int = 0
    spread: list[float] | None = None
    met_runs: int | None = None

    def status(self) -> str:
        if self.met is None:
            return ""
        verdict = "met" if self.met else "not met"
        if self.met_runs is not None and 0 < self.met_runs < self.runs:
            return f"{verdict}, within noise ({self.met_runs} of {self.runs} runs met it)"
        return verdict


def of_runs(
    name: str,
    values: list[float],
    unit: str = "",
    target: str = "",
    baseline: str = "",
    *,
    ratios: list[float] | None = None,
    check: Callable[[float], bool] | None = None,
    digits: int = 2,
    note: str = "",
) -> Figure:
    """A figure from per-run numbers: the median, and the spread of what ``check`` judges
    (``ratios`` when given: each run's ratio to its baseline measured in the same run)."""
    judged = ratios if ratios is not None else values
    places = 2 if ratios is not None else digits  # ratios keep two decimals
    central = median(judged)
    value = round(median(values), digits)
    return Figure(
        name,
        int(value) if digits == 0 else value,
        unit,
        target,
        baseline,
        round(central, 2) if ratios else None,
        None if check is None or not judged else check(central),
        note,
        runs=len(judged),
        spread=[round(min(judged), places), round(max(judged), places)] if judged else None,
        met_runs=None if check is None else sum(1 for x in judged if check(x)),
    )


# Whose CPU time it is, by the stack's programs: a process's name (PostgreSQL, Redis), else its
# command line (the Python programs), first match. The rest is the machines' (agents, their
# sandboxes, jobs and pastas), this process's and the host's own.
CPU_OWNERS = (
    ("PostgreSQL", "name", "postgres"),
    ("Redis", "name", "redis-server"),
    ("agent server", "cmdline", "uvicorn"),
    ("API (gunicorn)", "cmdline", "gunicorn"),
    ("Celery beat", "cmdline", "celery beat"),
    ("Celery worker", "cmdline", "celery"),
)


def cpu_seconds() -> dict[str, float]:
    """CPU seconds used so far: ``all`` (every process on this machine, /proc/stat's busy time),
    each of :data:`CPU_OWNERS` (their live processes' own time; PostgreSQL's with its ended
    backends', which its postmaster reaped) and ``bench`` (this process). Two snapshots' difference
    says where a part's CPU went; a process that ended between them is left in ``all`` only."""
    import psutil

    times = psutil.cpu_times()
    used = {"all": sum(times) - times.idle - getattr(times, "iowait", 0.0)}
    for owner, _, _ in CPU_OWNERS:
        used[owner] = 0.0
    for proc in psutil.process_iter(["name", "cmdline", "cpu_times"]):
        info = proc.info
        cpu = info["cpu_times"]
        if cpu is None:
            continue
        text = {"name": info["name"] or "", "cmdline": " ".join(info["cmdline"] or [])}
        for owner, where, needle in CPU_OWNERS:
            if needle in text[where]:
                used[owner] += cpu.user + cpu.system
                if owner == "PostgreSQL":
                    used[owner] += cpu.children_user + cpu.children_system
                break
    me = psutil.Process().cpu_times()
    used["bench"] = me.user + me.system
    return used


def cpu_per_job(before: dict[str, float], after: dict[str, float], jobs: int) -> dict[str, float]:
    """Milliseconds of CPU per job between two :func:`cpu_seconds`: every process's, each
    owner's, and the rest (``machines and the rest``)."""
    spent = {k: max(0.0, after[k] - before[k]) * 1000 / max(jobs, 1) for k in after}
    named = sum(v for k, v in spent.items() if k != "all")
    spent["machines and the rest"] = max(0.0, spent["all"] - named)
    return {k: round(v, 1) for k, v in spent.items()}


class LoadSampler:
    """The machine's load while a part runs (a shared machine makes numbers move): the 1-minute
    load average and the whole machine's CPU use, sampled every ``interval`` seconds."""

    def __init__(self, interval: float = 1.0) -> None:
        import threading

        self.interval = interval
        self.load: list[float] = []
        self.busy: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="load-sampler", daemon=True)

    def _run(self) -> None:
        import psutil

        psutil.cpu_percent(None)
        while not self._stop.wait(self.interval):
            self.load.append(os.getloadavg()[0])
            self.busy.append(psutil.cpu_percent(None))

    def __enter__(self) -> LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def summary(self) -> dict[str, Any]:
        load = self.load or [os.getloadavg()[0]]
        return {
            "cores": os.cpu_count(),
            "samples": len(self.load),
            "load_1m": {"min": min(load), "median": median(load), "max": max(load)},
            "cpu_busy_percent": {"median": median(self.busy), "max": max(self.busy)} if self.busy else None,
        }


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
    load: dict[str, Any] = field(default_factory=dict)  # LoadSampler.summary() while it ran

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PartResult:
        figures = [Figure(**f) for f in data.pop("figures", [])]
        return cls(figures=figures, **data)

    def figure(self, name: str) -> Figure:
        return next(f for f in self.figures if f.name == name)
