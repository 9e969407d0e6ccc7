"""The reaper's election (apps/control/election.py): one leader among every worker and beat,
a new one within a tick when it dies, and every tick recorded where /readyz and the metrics read
it. Real threads, each loop on its own connections; then real Celery processes, SIGKILLed."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from django.db import connection

from apps.control.election import ReaperLoop
from apps.core.locks import REAPER_LEADER
from apps.core.models import Heartbeat
from testkit.processes import TESTS, wait_for

pytestmark = pytest.mark.django_db(transaction=True)

INTERVAL = 1.0


def _last_tick() -> tuple[Any, str]:
    row = Heartbeat.objects.filter(name="reaper").values_list("seen_at", "detail").first()
    return (row[0], row[1].get("by", "")) if row else (None, "")


def _ticks_by(name: str, n: int, timeout: float = 15) -> None:
    wait_for(lambda: _last_tick()[1] == name and _count() >= n, timeout, f"{n} ticks by {name}")


def _count() -> int:
    row = Heartbeat.objects.filter(name="reaper").values_list("detail", flat=True).first()
    return int((row or {}).get("count", 0))


@pytest.fixture
def loops() -> Iterator[list[ReaperLoop]]:
    started: list[ReaperLoop] = []
    yield started
    for loop in started:
        loop.stop()


def _start(loops: list[ReaperLoop], name: str) -> ReaperLoop:
    loop = ReaperLoop(name=name, interval=INTERVAL, poll=0.1, repair_threads=1).start()
    loops.append(loop)
    return loop


def test_one_loop_leads_and_ticks_and_another_takes_over_within_a_tick(loops: list[ReaperLoop]) -> None:
    a, b = _start(loops, "a"), _start(loops, "b")
    wait_for(lambda: a.leading or b.leading, 10, "a leader")
    leader, other = (a, b) if a.leading else (b, a)
    _ticks_by(leader.name, 3)
    assert not other.leading and other.ticks == 0
    before, _ = _last_tick()
    leader.stop()  # gives the lead up (a killed process loses its connection: below)
    _ticks_by(other.name, _count() + 1)
    after, _ = _last_tick()
    # the next tick comes on time: an interval after the last one, not an interval after the
    # new leader won (poll 0.1 s; slack for a loaded machine)
    assert (after - before).total_seconds() < INTERVAL + 2.0
    detail = Heartbeat.objects.get(name="reaper").detail
    assert detail["count"] >= 4 and detail["buckets"][-1] == detail["count"]  # every tick under 60 s


def test_a_leader_whose_connection_is_cut_stops_ticking_and_stands_again(loops: list[ReaperLoop]) -> None:
    """PostgreSQL restarted (here: the leader's session terminated): the lock went with the
    session, the loop notices at its next check and stands again; ticks go on."""
    a = _start(loops, "a")
    _ticks_by("a", 2)
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_locks "
            "WHERE locktype = 'advisory' AND objid = %s AND granted",
            [REAPER_LEADER & 0xFFFFFFFF],
        )
        assert cursor.fetchone() is not None
    n = _count()
    _ticks_by("a", n + 2)
    assert a.leading


def test_a_second_process_cannot_lead_while_the_lock_is_held(loops: list[ReaperLoop]) -> None:
    from testkit.processes import database_url

    with psycopg.connect(database_url(), autocommit=True) as other:
        other.execute("SELECT pg_advisory_lock(%s)", [REAPER_LEADER])
        a = _start(loops, "a")
        time.sleep(INTERVAL * 1.5)
        assert not a.leading and _last_tick() == (None, "")
    _ticks_by("a", 1)  # the holder's session ended: a leads at once (no tick recorded yet)


# ---- real processes ---------------------------------------------------------------------------


def test_the_leader_process_killed_mid_life_another_worker_ticks_within_a_tick(tmp_path: Path) -> None:
    """Two workers and beat all stand; SIGKILL whichever leads (twice): the next leader ticks
    within about one interval of the last tick, and every tick shows in its process's log."""
    env = {"CATACLOUD_REAPER_INTERVAL": f"{INTERVAL:g}", "CATACLOUD_REAPER_IN_WORKERS": "1"}
    with (
        TESTS.celery_worker(tmp_path, concurrency=1, **env) as w1,
        TESTS.celery_worker(tmp_path, concurrency=1, **env) as w2,
        TESTS.celery_beat(tmp_path, **env) as beat,
    ):
        procs = {p.popen.pid: p for p in (w1, w2, beat)}
        killed: list[int] = []
        for _ in range(2):
            wait_for(lambda: _leader_pid(procs, killed) is not None, 30, "a tick by a live process")
            pid = _leader_pid(procs, killed)
            assert pid is not None
            n = _count()
            wait_for(lambda n=n: _count() >= n + 2, 15, "two more ticks by the leader")
            last, _ = _last_tick()
            os.killpg(pid, signal.SIGKILL)
            procs[pid].popen.wait()
            killed.append(pid)
            wait_for(lambda: _leader_pid(procs, killed) is not None, 15, "a tick by another process")
            first, by = _last_tick()
            gap = (first - last).total_seconds()
            assert gap < INTERVAL * 3 + 2, f"{by} ticked {gap:.1f}s after the dead leader's last tick"
        survivor = next(p for pid, p in procs.items() if pid not in killed)
        assert "reaper: tick in" in survivor.output()
        assert "leads (a tick every 1s)" in survivor.output()


def test_a_worker_started_while_redis_is_down_leads_and_ticks(tmp_path: Path) -> None:
    """Beat dead and Redis gone: a worker (re)started meanwhile never reaches its broker, yet it
    stands and ticks, since the reaper needs none. (It stood only once the broker answered.)"""
    import uuid

    from testkit.processes import Proc, free_port, worker_args

    env = {
        "CATACLOUD_REAPER_INTERVAL": f"{INTERVAL:g}",
        "CATACLOUD_REAPER_IN_WORKERS": "1",
        "REDIS_URL": f"redis://127.0.0.1:{free_port()}/0",  # nothing listens there
    }
    name = f"{TESTS.prefix}-nobroker-{uuid.uuid4().hex[:8]}@localhost"
    args = worker_args(name, concurrency=1, loglevel=TESTS.loglevel)
    proc = Proc("worker", args, TESTS.env(**env), tmp_path / "worker.log")
    try:

        def ticking() -> bool:
            proc.check()
            return _last_tick()[1].endswith(f":{proc.popen.pid}") and _count() >= 2

        wait_for(ticking, 60, "two ticks by the worker without a broker")
        assert "reaper: tick in" in proc.output()
    finally:
        proc.stop()


def _leader_pid(procs: dict[int, Any], killed: list[int]) -> int | None:
    _, by = _last_tick()
    pid = int(by.rsplit(":", 1)[1]) if ":" in by else None
    return pid if pid in procs and pid not in killed else None


def test_every_tick_is_in_the_metrics_whichever_process_serves_them() -> None:
    from apps.control.reaper import reaper_tick
    from apps.core.metrics import render

    for _ in range(2):
        reaper_tick(reconcile=False, by="worker@h:1")
    body = render()[0].decode()
    assert "catacloud_reaper_tick_seconds_count 2.0" in body
    assert 'catacloud_reaper_tick_seconds_bucket{le="+Inf"} 2.0' in body
    seen = Heartbeat.objects.get(name="reaper").seen_at.timestamp()
    line = next(x for x in body.splitlines() if x.startswith("catacloud_reaper_last_tick_timestamp_seconds "))
    assert abs(float(line.split()[1]) - seen) < 0.001
