"""The reaper's loop: in every Celery worker and in beat, one of them leads and ticks.

Each process runs a ``ReaperLoop`` thread (config/celery.py starts it when a worker is ready and
when beat starts). The loops hold an election through a PostgreSQL advisory lock
(``REAPER_LEADER``) taken on a connection of their own, outside Django's: whoever holds it ticks
every ``CATACLOUD_REAPER_INTERVAL`` seconds; the others try to take it every ``poll`` seconds (a
quarter of the interval, at most 2 s). A leader that dies (killed, mid-tick or not) loses its
connection and with it the lock, so another process takes over within a tick; a leader whose
connection breaks (PostgreSQL restarted, a network cut: TCP keepalives end it within about
30 s) stops ticking until it wins again. Neither the broker nor a worker's pool is involved:
the tick reads and writes PostgreSQL, and its repairs run in threads of the leader
(apps/core/repairs.py).

A new leader ticks at once when the last recorded tick (the ``reaper`` heartbeat row) is an
interval old or more, else when that interval ends, so a change of leader never makes a tick
late nor brings two ticks close together.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any

import psycopg
from django.conf import settings
from django.db import close_old_connections, connection
from django.utils import timezone

from apps.control.reaper import log_tick, reaper_tick
from apps.core.locks import REAPER_LEADER
from apps.core.models import Heartbeat
from apps.core.repairs import PooledRepairs

log = logging.getLogger("apps.control.reaper")  # one logger for every reaper line

# libpq's keepalives (TCP connections only): a leader whose host vanished loses the lock after
# about idle + interval * count seconds.
KEEPALIVES = {"keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 5, "keepalives_count": 3}


def process_name(role: str) -> str:
    return f"{role}@{socket.gethostname()}:{os.getpid()}"


class ReaperLoop:
    """One process's candidacy: a thread that leads and ticks, or waits to lead."""

    def __init__(
        self,
        *,
        name: str,
        interval: float | None = None,
        poll: float | None = None,
        repair_threads: int | None = None,
    ) -> None:
        self.name = name
        self.interval = interval or settings.CATACLOUD_REAPER_INTERVAL
        self.poll = poll or min(self.interval / 4, 2.0)
        self.repair_threads = repair_threads or settings.CATACLOUD_REAPER_REPAIR_THREADS
        self.leading = False
        self.ticks = 0
        self.repairs: PooledRepairs | None = None
        self._stop = threading.Event()
        self._conn: psycopg.Connection[Any] | None = None
        self._thread: threading.Thread | None = None

    # ---- the thread ---------------------------------------------------------------------------

    def start(self) -> ReaperLoop:
        self._thread = threading.Thread(target=self.run, name="reaper", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop ticking and give the lead up (a tick under way ends first, within ``timeout``)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self._resign("stopping")

    def run(self) -> None:
        due: float | None = None  # time.monotonic() of the next tick while leading
        while not self._stop.is_set():
            try:
                if not self._lead():
                    due = None
                    self._stop.wait(self.poll)
                    continue
                if due is None:
                    due = self._first_due()
                wait = due - time.monotonic()
                if wait > 0:
                    self._stop.wait(min(wait, self.poll))  # wakes to check the lead is still ours
                    continue
                due = max(due + self.interval, time.monotonic())
                self._tick()
            except Exception:
                log.exception("reaper: %s: the loop failed; standing again", self.name)
                self._resign("failed")
                due = None
                self._stop.wait(self.poll)
            finally:
                close_old_connections()
        self._resign("stopped")

    def _tick(self) -> None:
        report = reaper_tick(repairs=self.repairs, by=self.name)
        if report.ran:
            self.ticks += 1
        log_tick(report)

    def _first_due(self) -> float:
        """When a new leader ticks first: an interval after the last recorded tick (at once if
        that is past)."""
        last = Heartbeat.objects.filter(name="reaper").values_list("seen_at", flat=True).first()
        if last is None:
            return time.monotonic()
        age = (timezone.now() - last).total_seconds()
        return time.monotonic() + max(0.0, min(self.interval, self.interval - age))

    # ---- the election -------------------------------------------------------------------------

    def _lead(self) -> bool:
        """Whether this process leads now: checks the lead it holds, or tries to take it."""
        if self._conn is None or self._conn.closed:
            self.leading = False
            self._conn = self._connect()
        if self.leading:
            self._conn.execute("SELECT 1")  # raises when the connection (so the lock) is gone
            return True
        row = self._conn.execute("SELECT pg_try_advisory_lock(%s)", [REAPER_LEADER]).fetchone()
        if row is None or not row[0]:
            return False
        self.leading = True
        self.repairs = PooledRepairs(threads=self.repair_threads, name="reaper-repair")
        log.info("reaper: %s leads (a tick every %gs)", self.name, self.interval)
        return True

    def _connect(self) -> psycopg.Connection[Any]:
        params = dict(connection.get_connection_params())
        for django_only in ("cursor_factory", "context", "prepare_threshold"):
            params.pop(django_only, None)
        params.setdefault("connect_timeout", 5)
        params["application_name"] = f"catacloud reaper {self.name}"[-63:]  # its pid last
        if params.get("host") and not str(params["host"]).startswith("/"):
            params = {**KEEPALIVES, **params}
        return psycopg.connect(autocommit=True, **params)

    def _resign(self, why: str) -> None:
        was_leading, self.leading = self.leading, False
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()  # the session's advisory lock goes with it
            except Exception:
                log.debug("reaper: closing the election connection failed", exc_info=True)
        if self.repairs is not None:
            self.repairs.shutdown(wait=False)
            self.repairs = None
        if was_leading:
            log.info("reaper: %s no longer leads (%s)", self.name, why)


_loop: ReaperLoop | None = None
_loop_lock = threading.Lock()


def stand(role: str) -> ReaperLoop:
    """Start this process's reaper loop (once per process, whichever calls first)."""
    global _loop
    with _loop_lock:
        if _loop is None:
            _loop = ReaperLoop(name=process_name(role)).start()
        return _loop


def step_down() -> None:
    """Stop this process's loop, giving the lead up at once (a worker shutting down)."""
    global _loop
    with _loop_lock:
        loop, _loop = _loop, None
    if loop is not None:
        loop.stop()
