"""Threads for the race tests: each on its own database connection, as separate processes
would be (the tests that use them run with ``transaction=True``)."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable

import psycopg
from django.db import connection, connections


def in_threads(*fns: Callable[[], object], timeout: float | None = 30) -> None:
    """Run each of ``fns`` in a thread of its own, on its own database connection (closed when
    it ends), and wait for them all: ``timeout`` seconds each, None for as long as they take."""

    def on_own_connection(fn: Callable[[], object]) -> None:
        try:
            fn()
        finally:
            connection.close()

    threads = [threading.Thread(target=on_own_connection, args=(fn,)) for fn in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)


def released_together(*fns: Callable[[], object], timeout: float | None = 30) -> None:
    """:func:`in_threads`, the threads held at a barrier until every one has started."""
    barrier = threading.Barrier(len(fns))

    def after_barrier(fn: Callable[[], object]) -> None:
        barrier.wait()
        fn()

    in_threads(*(functools.partial(after_barrier, fn) for fn in fns), timeout=timeout)


def at_once(n: int, fn: Callable[[], object], timeout: float | None = 30) -> None:
    """Run ``fn`` in ``n`` threads released together, each on its own database connection."""
    released_together(*[fn] * n, timeout=timeout)


def holder_connection() -> psycopg.Connection:
    """A connection of its own, outside Django and with autocommit off: what it writes holds its
    row locks until it commits, as another service's open transaction would."""
    kwargs = {**connections["default"].get_connection_params(), "autocommit": False}
    kwargs.pop("cursor_factory", None)
    kwargs.pop("context", None)
    return psycopg.connect(**kwargs)
