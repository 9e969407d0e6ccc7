"""Database calls from the async agent views.

Under the agent server (ASGI):
- the hot statements (a heartbeat, a poll's look-up) run on the event loop itself, through a
  small pool of asynchronous psycopg connections (:func:`fetchone`, at most
  ``CATACLOUD_AGENT_DB_CONNECTIONS``), as server-side prepared statements: no thread hand-off,
  no ORM, no parse and plan per call;
- every ORM call (a handshake, a job's payload, the other agent endpoints) runs on a small,
  fixed pool of threads (:func:`run`, ``CATACLOUD_AGENT_DB_THREADS``), each with its own
  persistent Django connection.
A poll that waits holds no thread and no connection: thousands of agents share a few of each.
Anywhere else (a WSGI thread, the test client) both run on the request's own thread and Django
connection, as ``sync_to_async(thread_sensitive=True)`` does, so tests see their transaction.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from asgiref.sync import sync_to_async
from django.db import DatabaseError, close_old_connections, connection
from psycopg_pool import AsyncConnectionPool

T = TypeVar("T")
_executor: ThreadPoolExecutor | None = None
_connections = 0
_pool: AsyncConnectionPool | None = None
_pool_opening: asyncio.Lock | None = None


def serve_pooled(threads: int, connections: int = 4) -> None:
    """Called by the agent server at start-up (the async pool opens on first use, on the
    server's event loop)."""
    global _executor, _connections
    _executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="agent-db")
    _connections = connections


def pooled() -> bool:
    return _executor is not None


_local = threading.local()
# How often a database thread checks its connection's age and health (Django does it per request,
# which here would add a round trip to every heartbeat).
CHECK_EVERY = 5.0


def _in_pool_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    now = time.monotonic()
    if now - getattr(_local, "checked", 0.0) > CHECK_EVERY:
        close_old_connections()  # drop a connection that broke or outlived DATABASE_CONN_MAX_AGE
        _local.checked = now
    try:
        return fn(*args, **kwargs)
    except DatabaseError:
        if connection.connection is not None and not connection.is_usable():
            connection.close()  # PostgreSQL restarted or dropped us: the next call reconnects
        raise


async def run(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` (synchronous, may use the ORM) from async code."""
    if _executor is None:
        return await sync_to_async(fn, thread_sensitive=True)(*args, **kwargs)
    # Straight to the pool (asgiref's adapter costs a context copy and a shielded task per call,
    # a tenth of a heartbeat's CPU); nothing here needs the caller's context variables.
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_executor, functools.partial(_in_pool_thread, fn, *args, **kwargs))


# ---- the hot statements ----------------------------------------------------------------------


def _connect_kwargs() -> dict[str, Any]:
    """Django's own connection parameters, for psycopg directly (autocommit; no Django cursor
    class or adapters: the hot statements take and return plain values)."""
    params = dict(connection.get_connection_params())
    params.pop("cursor_factory", None)
    params.pop("context", None)
    params["prepare_threshold"] = None  # prepared explicitly, per statement (below)
    params["autocommit"] = True
    # The only write here is a heartbeat's timestamp: it need not wait for its WAL to reach the
    # disk (a crash loses at most the last fraction of a second of heartbeats, which the lost rule
    # reads as slightly older ones), so a checkpoint's flush never stalls a fleet's heartbeats.
    params["options"] = f"{params.get('options', '')} -c synchronous_commit=off".strip()
    return params


async def _async_pool() -> AsyncConnectionPool:
    global _pool, _pool_opening
    if _pool is not None:
        return _pool
    if _pool_opening is None:
        _pool_opening = asyncio.Lock()
    async with _pool_opening:
        if _pool is None:
            kwargs = await sync_to_async(_connect_kwargs, thread_sensitive=False)()
            pool = AsyncConnectionPool(
                kwargs=kwargs,
                min_size=1,
                max_size=max(1, _connections),
                open=False,
                name="agent-hot",
                # a connection PostgreSQL dropped is found by the failing statement and discarded
                # by the pool; keep the ones left from outliving a server-side restart for long
                max_idle=300,
                timeout=10,
            )
            await pool.open()
            _pool = pool
    return _pool


def _fetchone_django(sql: str, params: Sequence[Any]) -> tuple[Any, ...] | None:
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchone()


async def fetchone(sql: str, params: Sequence[Any]) -> tuple[Any, ...] | None:
    """One statement's first row. Under the agent server: on the event loop, on a pooled async
    connection, prepared on that connection the first time it runs there."""
    if _executor is None:
        return await run(_fetchone_django, sql, params)
    pool = await _async_pool()
    async with pool.connection() as conn:
        cursor = await conn.execute(sql, params, prepare=True)
        return await cursor.fetchone()


async def close() -> None:
    """Close the async pool (the agent server's shutdown; tests)."""
    global _pool
    if _pool is not None:
        pool, _pool = _pool, None
        await pool.close()
