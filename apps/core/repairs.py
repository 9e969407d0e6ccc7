"""Repairs: what the reaper's tick re-drives itself, never through the broker.

A row past its deadline was moved by a message that was lost (Redis down or emptied, a worker
killed): sending the same message again rides the same broker, so a storm that lost the first
would lose the second. The reaper's rules hand such rows to a ``Repairs`` instead, which calls
the same idempotent service the task calls, in the reaper's own process:

- ``InlineRepairs`` runs it at once, in the caller's thread (a tick run on demand, tests);
- ``PooledRepairs`` runs it in a few threads of the reaper's process, so one slow cloud or well
  call never holds the tick up; a row already being repaired is not started twice, and at most
  ``limit`` repairs wait (the rest are found again by the next tick).

A repair that fails is logged and found again by the next tick; a leader that dies mid-repair
leaves the row past its deadline for the next leader (every service here is idempotent).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

log = logging.getLogger(__name__)


class Repairs(Protocol):
    def submit(self, key: str, fn: Callable[..., object], /, *args: Any) -> bool:
        """Run ``fn(*args)`` as the repair of ``key`` (``"resource-destroy:<id>"``); False when
        it was not started (already in flight, or too many waiting)."""
        ...


def _run(key: str, fn: Callable[..., object], args: tuple[Any, ...]) -> None:
    from django.db import close_old_connections

    try:
        fn(*args)
    except Exception:
        log.warning("repair %s failed (the next tick retries it)", key, exc_info=True)
    finally:
        close_old_connections()


class InlineRepairs:
    """Repairs run at once in the caller's thread (a tick on demand; tests)."""

    def __init__(self) -> None:
        self.done: list[str] = []

    def submit(self, key: str, fn: Callable[..., object], /, *args: Any) -> bool:
        self.done.append(key)
        try:
            fn(*args)
        except Exception:
            log.warning("repair %s failed (the next tick retries it)", key, exc_info=True)
        return True


class PooledRepairs:
    """Repairs run by ``threads`` threads of this process, each key once at a time."""

    def __init__(self, *, threads: int = 4, limit: int = 200, name: str = "repair") -> None:
        self.limit = limit
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name)
        self._lock = threading.Lock()
        self._inflight: set[str] = set()
        self.started = 0

    def submit(self, key: str, fn: Callable[..., object], /, *args: Any) -> bool:
        with self._lock:
            if key in self._inflight or len(self._inflight) >= self.limit:
                return False
            self._inflight.add(key)
            self.started += 1
        self._pool.submit(self._repair, key, fn, args)
        return True

    def _repair(self, key: str, fn: Callable[..., object], args: tuple[Any, ...]) -> None:
        try:
            _run(key, fn, args)
        finally:
            with self._lock:
                self._inflight.discard(key)

    def inflight(self) -> int:
        with self._lock:
            return len(self._inflight)

    def shutdown(self, *, wait: bool) -> None:
        self._pool.shutdown(wait=wait, cancel_futures=True)
