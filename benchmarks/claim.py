"""Part 1: claim throughput and latency through the real claim service.

Concurrent claimers are forked processes, one database connection each, all claiming from
one pool holding enough ready members. In every run, at the same concurrency, three variants
take turns on fresh pools:

- ``service``: :func:`apps.pools.services.pool_claim` (one-statement CTE, SKIP LOCKED, event
  insert, refill enqueued to Celery after commit);
- ``naive``: the same service path with the same statement locking with plain ``FOR UPDATE``
  (no SKIP LOCKED): claimers queue behind the oldest member's row lock;
- ``no_enqueue`` (diagnostic): the service's statement and transaction without the Celery
  refill enqueue after commit, to show what the enqueue costs;
- ``floor``: a raw psycopg loop, ``UPDATE … WHERE id = (SELECT … FOR UPDATE SKIP LOCKED)
  RETURNING id`` + commit: what one claim costs PostgreSQL and nothing else.

Every claimed id is collected and checked: no instance may be handed out twice.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import time
from typing import Any

from benchmarks.harness import (
    Figure,
    PartResult,
    Progress,
    add_ready_members,
    database_url,
    median,
    percentile,
    say,
    tenant,
)

VARIANTS = ("service", "naive", "floor", "no_enqueue")

FLOOR_SQL = """
UPDATE machines_machineinstance SET status = 'claimed', claimed_at = now()
WHERE id = (SELECT id FROM machines_machineinstance WHERE pool_id = %s AND status = 'ready'
            ORDER BY ready_at LIMIT 1 FOR UPDATE SKIP LOCKED)
RETURNING id
"""


def _naive_sql() -> str:
    from apps.machines import claims

    sql = claims.POOL_SQL.replace("FOR UPDATE OF m SKIP LOCKED", "FOR UPDATE OF m")
    assert sql != claims.POOL_SQL, "the claim statement changed: update the naive baseline"
    return sql


def naive_claim(*, pool_id: Any, acquired_by: str = "", acquired_for: str = "", enqueue: bool = True) -> Any:
    """pool_claim with plain FOR UPDATE (the baseline); same statement (autocommit), event and
    refill signal. With ``enqueue=False``: the service's own statement without the refill signal."""
    from apps.core.errors import PoolEmpty
    from apps.machines import claims
    from apps.pools.choices import POOL_ACTIVE
    from apps.pools.services import _enqueue_refill

    _, instance = claims.claim(
        _NAIVE_SQL if enqueue else claims.POOL_SQL_NO_SIGNAL,
        by=acquired_by,
        for_=acquired_for,
        pool=str(pool_id),
        active=sorted(POOL_ACTIVE),
        org=None,
    )
    if instance is None:
        raise PoolEmpty("empty")
    if enqueue:
        _enqueue_refill(str(pool_id))
    return instance


_NAIVE_SQL = ""


# ---- the claimer processes ----------------------------------------------------------------------


def _child(pipe: Any, url: str, redis_url: str) -> None:
    """A claimer process: one Django connection and one raw psycopg connection, reused.

    Started with "spawn", not "fork": forking a process that runs threads (a live server,
    a browser driver, a Redis client) can leave the child stuck on a lock held at fork time.
    """
    global _NAIVE_SQL
    import os

    os.environ.update(DATABASE_URL=url, REDIS_URL=redis_url)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    import django

    django.setup()
    import psycopg
    from django.db import connection

    from apps.core.errors import PoolEmpty
    from apps.pools.services import pool_claim

    _NAIVE_SQL = _naive_sql()
    pipe.send("ready")  # set up: the parent starts the clock only when every claimer is
    raw = psycopg.connect(url)
    connection.ensure_connection()
    while True:
        msg = pipe.recv()
        if msg is None:
            break
        variant, pool_id, start_at, duration = msg
        latencies: list[float] = []
        ids: list[str] = []
        while time.monotonic() < start_at:
            time.sleep(0.0005)
        end = start_at + duration
        empty = False
        while time.monotonic() < end:
            t0 = time.perf_counter()
            try:
                if variant == "service":
                    ids.append(str(pool_claim(pool_id=pool_id, acquired_by="bench").instance.pk))
                elif variant == "naive":
                    ids.append(str(naive_claim(pool_id=pool_id, acquired_by="bench").pk))
                elif variant == "no_enqueue":
                    ids.append(str(naive_claim(pool_id=pool_id, acquired_by="bench", enqueue=False).pk))
                else:
                    row = raw.execute(FLOOR_SQL, (pool_id,)).fetchone()
                    raw.commit()
                    if row is None:
                        raise PoolEmpty("empty")
                    ids.append(str(row[0]))
            except PoolEmpty:
                empty = True
                break
            latencies.append(time.perf_counter() - t0)
        pipe.send({"latencies": latencies, "ids": ids, "ended": time.monotonic(), "empty": empty})
    raw.close()
    connection.close()


class Claimers:
    """A fixed set of claimer processes, started once for the whole part."""

    def __init__(self, n: int) -> None:
        from django.conf import settings
        from django.db import connections

        connections.close_all()
        url = database_url()
        ctx = multiprocessing.get_context("spawn")
        self.pipes = []
        self.procs = []
        for _ in range(n):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_child, args=(child, url, settings.CELERY_BROKER_URL), daemon=True)
            proc.start()
            self.pipes.append(parent)
            self.procs.append(proc)
        for pipe in self.pipes:
            if pipe.recv() != "ready":
                raise RuntimeError("a claimer process failed to start")

    def run(self, variant: str, pool_id: str, n: int, duration: float) -> dict[str, Any]:
        start_at = time.monotonic() + 0.2
        for pipe in self.pipes[:n]:
            pipe.send((variant, pool_id, start_at, duration))
        results = [pipe.recv() for pipe in self.pipes[:n]]
        latencies = [x for r in results for x in r["latencies"]]
        ids = [x for r in results for x in r["ids"]]
        elapsed = max(r["ended"] for r in results) - start_at
        return {
            "claims": len(ids),
            "unique": len(set(ids)),
            "elapsed": elapsed,
            "throughput": len(ids) / elapsed if elapsed > 0 else 0.0,
            "p50_ms": percentile(latencies, 50) * 1000,
            "p99_ms": percentile(latencies, 99) * 1000,
            "latencies": latencies,
            "ran_dry": any(r["empty"] for r in results),
        }

    def close(self) -> None:
        for pipe in self.pipes:
            with contextlib.suppress(OSError):
                pipe.send(None)
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()


# ---- the part -----------------------------------------------------------------------------------


def _fresh_pool(t: Any, members: int, tag: str) -> Any:
    from apps.pools.services import pool_create

    pool = pool_create(org=t.org, name=tag, machine_type=t.machine_type, target_size=0, max_size=members)
    add_ready_members(pool, members)
    # Steady state has statistics; without them the planner sorts the whole pool per claim.
    from benchmarks.harness import analyze

    analyze("machines_machineinstance")
    return pool


def _verify(pool: Any, result: dict[str, Any], variant: str) -> int:
    """Double claims, checked: ids handed out twice, and rows claimed vs claims answered."""
    from apps.events.models import Event
    from apps.machines.models import MachineInstance

    twice = result["claims"] - result["unique"]
    claimed_rows = MachineInstance.objects.filter(pool=pool, status="claimed").count()
    twice += abs(claimed_rows - result["claims"])
    if variant != "floor":
        events = Event.objects.filter(pool_id=pool.pk, kind="pool.member_claimed").count()
        twice += abs(events - result["claims"])
    return twice


def _drop(pool: Any) -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("DELETE FROM events_event WHERE pool_id = %s", [pool.pk])
        cursor.execute("DELETE FROM machines_machineinstance WHERE pool_id = %s", [pool.pk])
        cursor.execute("DELETE FROM pools_instancepool WHERE id = %s", [pool.pk])


def run(
    *,
    concurrencies: tuple[int, ...] = (1, 4, 16, 64),
    runs: int = 3,
    duration: float = 0.6,
    members: int = 2500,
    progress: Progress = say,
) -> PartResult:
    from django.db import connection

    result = PartResult(part="claim", title="Claim throughput and latency (pool_claim)")
    t = tenant("claim")
    per: dict[int, dict[str, list[dict[str, Any]]]] = {c: {v: [] for v in VARIANTS} for c in concurrencies}
    double_claims = 0
    claimers = Claimers(max(concurrencies))
    try:
        for c in concurrencies:
            for r in range(runs):
                progress(f"claim: {c} claimers, run {r + 1}/{runs} (service, naive, floor, no_enqueue)")
                order = VARIANTS[r % 4 :] + VARIANTS[: r % 4]  # rotate who goes first
                for variant in order:
                    pool = _fresh_pool(t, members, f"{variant}-{c}-{r}")
                    connection.close()
                    out = claimers.run(variant, str(pool.pk), c, duration)
                    twice = _verify(pool, out, variant)
                    double_claims += twice
                    out["double_claims"] = twice
                    _drop(pool)
                    per[c][variant].append(out)
    finally:
        claimers.close()

    table: dict[str, dict[str, Any]] = {}
    for c in concurrencies:
        row: dict[str, Any] = {}
        for v in VARIANTS:
            outs = per[c][v]
            row[v] = {
                "throughput": median([o["throughput"] for o in outs]),
                "p50_ms": median([o["p50_ms"] for o in outs]),
                "p99_ms": median([o["p99_ms"] for o in outs]),
                "claims": sum(o["claims"] for o in outs),
                "ran_dry": any(o["ran_dry"] for o in outs),
            }
        # Ratios within each run, then the median of those.
        row["vs_naive"] = median(
            [
                s["throughput"] / n["throughput"]
                for s, n in zip(per[c]["service"], per[c]["naive"], strict=True)
                if n["throughput"]
            ]
        )
        row["vs_floor"] = median(
            [
                s["throughput"] / f["throughput"]
                for s, f in zip(per[c]["service"], per[c]["floor"], strict=True)
                if f["throughput"]
            ]
        )
        row["no_enqueue_vs_floor"] = median(
            [
                s["throughput"] / f["throughput"]
                for s, f in zip(per[c]["no_enqueue"], per[c]["floor"], strict=True)
                if f["throughput"]
            ]
        )
        table[str(c)] = row
    result.data = {
        "concurrencies": list(concurrencies),
        "runs": runs,
        "duration": duration,
        "table": table,
        "double_claims": double_claims,
        # Latency samples of the last run at each concurrency (for the CDF plot).
        "samples_ms": {
            str(c): {v: [x * 1000 for x in per[c][v][-1]["latencies"]][:20000] for v in VARIANTS}
            for c in concurrencies
        },
    }
    key = 16 if 16 in concurrencies else max(concurrencies)
    row = table[str(key)]
    s = row["service"]
    result.figures += [
        Figure(
            f"throughput at {key} claimers vs naive FOR UPDATE",
            round(s["throughput"]),
            "claims/s",
            ">= 5x naive",
            f"naive {row['naive']['throughput']:.0f}/s",
            round(row["vs_naive"], 2),
            row["vs_naive"] >= 5,
        ),
        Figure(
            f"throughput at {key} claimers vs raw psycopg floor",
            round(s["throughput"]),
            "claims/s",
            ">= 50% of floor",
            f"floor {row['floor']['throughput']:.0f}/s",
            round(row["vs_floor"], 2),
            row["vs_floor"] >= 0.5,
        ),
        Figure(
            f"p50 latency at {key} claimers",
            round(s["p50_ms"], 2),
            "ms",
            "",
            f"floor {row['floor']['p50_ms']:.2f} ms",
        ),
        Figure(
            f"p99 latency at {key} claimers",
            round(s["p99_ms"], 2),
            "ms",
            "<= 10 ms",
            f"naive {row['naive']['p99_ms']:.1f} ms",
            met=s["p99_ms"] <= 10,
        ),
        Figure(
            f"diagnostic: claim statement without the refill enqueue, {key} claimers",
            round(row["no_enqueue"]["throughput"]),
            "claims/s",
            "",
            f"floor {row['floor']['throughput']:.0f}/s",
            round(row["no_enqueue_vs_floor"], 2),
            note=f"p99 {row['no_enqueue']['p99_ms']:.1f} ms: the claim statement without the refill enqueue",
        ),
        Figure(
            "instances claimed twice (all runs, all variants)", double_claims, "", "0", met=double_claims == 0
        ),
    ]
    for c in concurrencies:
        if c == key:
            continue
        r = table[str(c)]
        result.figures.append(
            Figure(
                f"throughput at {c} claimers",
                round(r["service"]["throughput"]),
                "claims/s",
                "",
                f"naive {r['naive']['throughput']:.0f}/s, floor {r['floor']['throughput']:.0f}/s",
                round(r["vs_naive"], 2),
                note=f"{r['vs_floor']:.0%} of floor; p99 {r['service']['p99_ms']:.1f} ms",
            )
        )
    return result
