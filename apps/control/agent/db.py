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
import itertools
import threading
import time
from collections.abc import Callable, Hashable, Sequence
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


async def fetchall(sql: str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
    """Every row of one statement, as :func:`fetchone` runs it (the pooled path only)."""
    pool = await _async_pool()
    async with pool.connection() as conn:
        cursor = await conn.execute(sql, params, prepare=True)
        return await cursor.fetchall()


Row = tuple[Any, ...]


class Batched:
    """One hot statement shared by the requests that arrive while the previous one runs (group
    commit): a fleet's heartbeats or look-ups cost a few statements a moment, not one each, so
    they never queue for the pool's connections one by one.

    ``one`` answers a single key (``one_params(key)``: its parameters); ``many`` answers a batch
    (``params(keys)``), each row starting with the key it answers, followed by the columns ``one``
    returns. A key ``many`` returned no row for has none (an unknown token, no job); with
    ``retry_missing`` it runs ``one`` alone instead, on its own (``many`` skipped a row another
    transaction holds: the single statement waits for it, the batch never does). Outside the
    agent server (the WSGI web, tests) every call runs ``one`` on the request's connection."""

    def __init__(
        self,
        one: str,
        many: str,
        *,
        params: Callable[[list[Any]], Sequence[Any]],
        one_params: Callable[[Any], Sequence[Any]],
        retry_missing: bool = False,
        limit: int = 1000,
    ) -> None:
        self.one, self.many = one, many
        self.params, self.one_params = params, one_params
        self.retry_missing = retry_missing
        self.limit = limit
        self.statements = 0  # statements run for the agent server's requests (the tests count)
        self._waiting: dict[Hashable, list[asyncio.Future[Row | None]]] = {}
        self._flusher: asyncio.Task[None] | None = None
        self._singles: set[asyncio.Task[None]] = set()

    async def row(self, key: Hashable) -> Row | None:
        """``key``'s row (None: the statement found none)."""
        if _executor is None:
            return await fetchone(self.one, self.one_params(key))
        answer: asyncio.Future[Row | None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(key, []).append(answer)
        if self._flusher is None or self._flusher.done():
            # one flusher per process (one event loop): it starts on the loop's next turn, so
            # every request of this turn shares its first statement already
            self._flusher = asyncio.get_running_loop().create_task(self._flush())
        return await answer

    async def _flush(self) -> None:
        while self._waiting:
            batch = dict(itertools.islice(self._waiting.items(), self.limit))
            for key in batch:
                del self._waiting[key]
            batch = {k: fs for k, fs in batch.items() if not all(f.done() for f in fs)}  # all left
            if not batch:
                continue
            try:
                rows = await self._run(list(batch))
            except asyncio.CancelledError:  # the server stopping: its requests go with it
                _answer(batch.values(), cancel=True)
                raise
            except Exception as exc:  # PostgreSQL away: each request answers 500, its agent retries
                _answer(batch.values(), error=exc)
                continue
            for key, answers in batch.items():
                row = rows.get(key)
                if row is None and self.retry_missing and len(batch) > 1:
                    task = asyncio.get_running_loop().create_task(self._single(key, answers))
                    self._singles.add(task)
                    task.add_done_callback(self._singles.discard)
                else:
                    _answer([answers], row=row)

    async def _run(self, keys: list[Any]) -> dict[Any, Row]:
        self.statements += 1
        if len(keys) == 1:
            row = await fetchone(self.one, self.one_params(keys[0]))
            return {} if row is None else {keys[0]: row}
        return {row[0]: row[1:] for row in await fetchall(self.many, self.params(keys))}

    async def _single(self, key: Any, answers: list[asyncio.Future[Row | None]]) -> None:
        try:
            self.statements += 1
            row = await fetchone(self.one, self.one_params(key))
        except asyncio.CancelledError:
            _answer([answers], cancel=True)
            raise
        except Exception as exc:
            _answer([answers], error=exc)
        else:
            _answer([answers], row=row)


def _answer(
    groups: Any, *, row: Row | None = None, error: BaseException | None = None, cancel: bool = False
) -> None:
    """Settle every request still waiting in ``groups`` (lists of futures) one way."""
    for answers in groups:
        for answer in answers:
            if answer.done():
                continue  # its request went away
            if cancel:
                answer.cancel()
            elif error is not None:
                answer.set_exception(error)
            else:
                answer.set_result(row)


async def close() -> None:
    """Close the async pool (the agent server's shutdown; tests)."""
    global _pool
    if _pool is not None:
        pool, _pool = _pool, None
        await pool.close()
