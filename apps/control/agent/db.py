"""Database calls from the async agent views.

Under the agent server (ASGI) every ORM call runs on a small, fixed pool of threads, each with
its own persistent Django connection (``CATACLOUD_AGENT_DB_THREADS``, default 8): a poll that
waits holds no thread and no connection, and a thousand agents share eight connections.
Anywhere else (a WSGI thread, the test client) the call runs on the request's own thread and
connection, as ``sync_to_async(thread_sensitive=True)`` does, so tests see their transaction.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from asgiref.sync import sync_to_async
from django.db import DatabaseError, close_old_connections, connection

T = TypeVar("T")
_executor: ThreadPoolExecutor | None = None


def serve_pooled(threads: int) -> None:
    """Called by the agent server at start-up."""
    global _executor
    _executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="agent-db")


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
