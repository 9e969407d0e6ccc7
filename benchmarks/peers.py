"""The other PostgreSQL work queues a user might reach for, claiming one item at a time on the
same database as our claim: procrastinate's job fetch and pgqueuer's dequeue, each through its
own public API (which runs its own SQL). Bench-only dependencies (`pip install '.[bench]'`,
which `make bench` does); a peer that is not installed is left out of the part.

Each claimer is a process of its own with one connection, like ours; the parent fills a
fresh queue with as many items as our pool has members before each run and empties it after.
"""

from __future__ import annotations

import asyncio
import importlib.util
import time
import uuid
from datetime import timedelta
from typing import Any

PEERS = tuple(name for name in ("procrastinate", "pgqueuer") if importlib.util.find_spec(name))


# ---- procrastinate --------------------------------------------------------------------------------


def _procrastinate_app(url: str) -> Any:
    import procrastinate

    return procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=url))


async def _procrastinate_setup(url: str) -> None:
    import psycopg

    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        exists = await (await conn.execute("SELECT to_regclass('procrastinate_jobs') IS NOT NULL")).fetchone()
    if exists and exists[0]:
        return
    app = _procrastinate_app(url)
    async with app.open_async():
        await app.schema_manager.apply_schema_async()


async def _procrastinate_fill(url: str, queue: str, n: int) -> None:
    from procrastinate import jobs

    app = _procrastinate_app(url)
    async with app.open_async():
        batch = [
            jobs.Job(id=None, queue=queue, lock=None, queueing_lock=None, task_name="bench", task_kwargs={})
            for _ in range(n)
        ]
        for i in range(0, n, 500):
            await app.job_manager.batch_defer_jobs_async(batch[i : i + 500])


async def _procrastinate_claim(url: str, queue: str, start_at: float, end: float) -> tuple[list, list]:
    app = _procrastinate_app(url)
    latencies: list[float] = []
    ids: list[str] = []
    async with app.open_async():
        worker_id = await app.job_manager.register_worker()
        while time.monotonic() < start_at:
            await asyncio.sleep(0.0005)
        while time.monotonic() < end:
            t0 = time.perf_counter()
            job = await app.job_manager.fetch_job(queues=[queue], worker_id=worker_id)
            if job is None:
                break
            latencies.append(time.perf_counter() - t0)
            ids.append(str(job.id))
        await app.job_manager.unregister_worker(worker_id)
    return latencies, ids


async def _procrastinate_drop(url: str, queue: str) -> None:
    import psycopg

    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await conn.execute("DELETE FROM procrastinate_jobs WHERE queue_name = %s", [queue])


# ---- pgqueuer --------------------------------------------------------------------------------------


async def _pgqueuer(url: str) -> tuple[Any, Any]:
    import psycopg
    from pgqueuer.db import PsycopgDriver
    from pgqueuer.queries import Queries

    conn = await psycopg.AsyncConnection.connect(url, autocommit=True)
    return conn, Queries(PsycopgDriver(conn))


async def _pgqueuer_setup(url: str) -> None:
    conn, queries = await _pgqueuer(url)
    try:
        exists = await (await conn.execute("SELECT to_regclass('pgqueuer') IS NOT NULL")).fetchone()
        if not (exists and exists[0]):
            await queries.install()
    finally:
        await conn.close()


async def _pgqueuer_fill(url: str, queue: str, n: int) -> None:
    conn, queries = await _pgqueuer(url)
    try:
        for i in range(0, n, 500):
            k = min(500, n - i)
            await queries.enqueue([queue] * k, [None] * k, [0] * k)
    finally:
        await conn.close()


async def _pgqueuer_claim(url: str, queue: str, start_at: float, end: float) -> tuple[list, list]:
    from pgqueuer.queries import EntrypointExecutionParameter

    conn, queries = await _pgqueuer(url)
    latencies: list[float] = []
    ids: list[str] = []
    entrypoints = {queue: EntrypointExecutionParameter(concurrency_limit=0)}
    manager = uuid.uuid4()
    try:
        while time.monotonic() < start_at:
            await asyncio.sleep(0.0005)
        while time.monotonic() < end:
            t0 = time.perf_counter()
            picked = await queries.dequeue(1, entrypoints, manager, None, timedelta(seconds=300))
            if not picked:
                break
            latencies.append(time.perf_counter() - t0)
            ids.append(str(picked[0].id))
    finally:
        await conn.close()
    return latencies, ids


async def _pgqueuer_drop(url: str, queue: str) -> None:
    conn, _ = await _pgqueuer(url)
    try:
        await conn.execute("DELETE FROM pgqueuer WHERE entrypoint = %s", [queue])
    finally:
        await conn.close()


# ---- what the claim part calls ---------------------------------------------------------------------

_SETUP = {"procrastinate": _procrastinate_setup, "pgqueuer": _pgqueuer_setup}
_FILL = {"procrastinate": _procrastinate_fill, "pgqueuer": _pgqueuer_fill}
_CLAIM = {"procrastinate": _procrastinate_claim, "pgqueuer": _pgqueuer_claim}
_DROP = {"procrastinate": _procrastinate_drop, "pgqueuer": _pgqueuer_drop}


def setup(url: str, peer: str) -> None:
    """Install the peer's schema in the bench database (once)."""
    asyncio.run(_SETUP[peer](url))


def fill(url: str, peer: str, queue: str, n: int) -> None:
    asyncio.run(_FILL[peer](url, queue, n))


def claim(url: str, peer: str, queue: str, start_at: float, duration: float) -> tuple[list, list, bool]:
    """One claimer's run: (latencies, claimed ids, ran dry)."""
    end = start_at + duration
    latencies, ids = asyncio.run(_CLAIM[peer](url, queue, start_at, end))
    return latencies, ids, time.monotonic() < end


def drop(url: str, peer: str, queue: str) -> None:
    asyncio.run(_DROP[peer](url, queue))
