"""The refill signal: how a pool learns, within milliseconds and without a broker round trip
on the claim path, that it lost a member.

- A claim marks its pool (``refill_requested_at``) and sends ``NOTIFY catacloud_refill`` in
  the claim statement itself, only when no refill is pending yet (so a burst of claims costs
  one mark and one notification, and NOTIFY's commit-time lock is rare). Other triggers (a
  member ended, a pool created or resized) call :func:`request_refill`, which does the same
  after their commit.
- One listener in the cluster (the Celery worker that holds the listener's advisory lock;
  another takes over within seconds if it dies) LISTENs, clears each mark it sees
  (compare-and-set, so a mark is taken once) and enqueues that pool's refill task. Every few
  seconds it also sweeps marks whose notification nobody heard.
- The refill clears its pool's mark before it reads the pool, so a claim committed after
  that marks it again. A mark whose refill could not be sent (broker down) is put back and
  sent by a later sweep. Whatever slips through (no listener), the reaper refills every pool
  below its target at each tick, whatever the marks say: the signal only makes things faster.
"""

from __future__ import annotations

import logging
import threading
import time

import psycopg
from django.db import connection, transaction
from psycopg.conninfo import make_conninfo

from apps.core.broker import enqueue
from apps.core.ids import PoolId
from apps.core.locks import REFILL_LISTENER
from apps.machines.claims import REFILL_CHANNEL

# The refill task (apps/pools/tasks.py), sent by its registered name: the tasks import the pool
# services, which import this module.
REFILL_TASK = "apps.pools.tasks.pool_refill_task"

log = logging.getLogger(__name__)
SWEEP_SECONDS = 5.0
# How soon a stop ends the listener's wait for a notification: the wait goes in slices this long
# (a worker's shutdown joins the listener; waiting out a whole sweep interval made every worker
# stop take up to 5 s more: an idle test worker took 6.0 s from SIGTERM to exit, now 2.4 s).
STOP_SLICE_SECONDS = 0.25

_MARK_SQL = f"""
WITH r AS (
    UPDATE pools_instancepool SET refill_requested_at = now()
    WHERE id = %s AND refill_requested_at IS NULL RETURNING id
)
SELECT pg_notify('{REFILL_CHANNEL}', r.id::text) FROM r
"""
_TAKE_SQL = """
UPDATE pools_instancepool SET refill_requested_at = NULL
WHERE id = ANY(%s::uuid[]) AND refill_requested_at IS NOT NULL RETURNING id
"""
# A refill not sent: mark the pool again (a refill that started meanwhile cleared it and reads
# the pool after; marking it again costs at most one more refill).
_PUT_BACK_SQL = """
UPDATE pools_instancepool SET refill_requested_at = COALESCE(refill_requested_at, now())
WHERE id = ANY(%s::uuid[])
"""
_SWEEP_SQL = "SELECT id FROM pools_instancepool WHERE refill_requested_at IS NOT NULL LIMIT 500"


def request_refill(pool_id: PoolId) -> None:
    """Ask for a refill of ``pool_id`` right after the current transaction commits."""
    pool = str(pool_id)

    def mark() -> None:
        with connection.cursor() as cursor:
            cursor.execute(_MARK_SQL, [pool])

    transaction.on_commit(mark)


def clear_mark(pool_id: PoolId) -> None:
    """The refill starts: a claim committed from now on marks the pool again."""
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE pools_instancepool SET refill_requested_at = NULL "
            "WHERE id = %s AND refill_requested_at IS NOT NULL",
            [str(pool_id)],
        )


def _dsn() -> str:
    db = connection.settings_dict
    return make_conninfo(
        host=db["HOST"] or None,
        port=db["PORT"] or None,
        dbname=db["NAME"],
        user=db["USER"] or None,
        password=db.get("PASSWORD") or None,
        application_name="catacloud-refill-listener",
    )


def take_and_enqueue(conn: psycopg.Connection, pool_ids: set[str]) -> int:
    """Clear the marks of ``pool_ids`` (each taken by one listener only) and enqueue their
    refills. A mark whose refill could not be sent (the broker is down) is put back, so the
    next sweep sends it once the broker answers. Returns how many were enqueued."""
    if not pool_ids:
        return 0
    taken = [str(row[0]) for row in conn.execute(_TAKE_SQL, [sorted(pool_ids)]).fetchall()]
    unsent = [pool_id for pool_id in taken if not enqueue(REFILL_TASK, pool_id)]
    if unsent:
        conn.execute(_PUT_BACK_SQL, [unsent])
    return len(taken) - len(unsent)


def listen(stop: threading.Event, *, dsn: str | None = None, sweep_seconds: float = SWEEP_SECONDS) -> None:
    """Run the refill listener until ``stop`` is set (reconnecting after errors)."""
    dsn = dsn or _dsn()
    while not stop.is_set():
        try:
            with psycopg.connect(dsn, autocommit=True) as conn:
                got = conn.execute("SELECT pg_try_advisory_lock(%s)", [REFILL_LISTENER]).fetchone()
                if not got or not got[0]:
                    stop.wait(sweep_seconds)  # another worker listens; try again later
                    continue
                conn.execute(f"LISTEN {REFILL_CHANNEL}")
                log.info("refill listener: listening on %s", REFILL_CHANNEL)
                while not stop.is_set():
                    pending = {str(row[0]) for row in conn.execute(_SWEEP_SQL).fetchall()}
                    take_and_enqueue(conn, pending)
                    pending = _first_notes(conn, stop, sweep_seconds)
                    # Drain what else arrived meanwhile, then act on the whole batch at once.
                    for note in conn.notifies(timeout=0.01):
                        pending.add(note.payload)
                    take_and_enqueue(conn, pending)
        except Exception:  # a listener must outlive database restarts
            log.exception("refill listener failed; reconnecting")
            stop.wait(1.0)


def _first_notes(conn: psycopg.Connection, stop: threading.Event, timeout: float) -> set[str]:
    """The payload of the first notification that comes within ``timeout`` (none: an empty
    set), waited for in slices of :data:`STOP_SLICE_SECONDS` so that ``stop`` ends the wait."""
    deadline = time.monotonic() + timeout
    while not stop.is_set():
        left = deadline - time.monotonic()
        if left <= 0:
            break
        notes = {note.payload for note in conn.notifies(timeout=min(left, STOP_SLICE_SECONDS), stop_after=1)}
        if notes:
            return notes
    return set()


_thread: threading.Thread | None = None
_stop = threading.Event()


def start_listener() -> None:
    """Start the listener thread in this process (Celery workers do, at startup)."""
    global _thread
    if _thread is not None and _thread.is_alive():
        return
    _stop.clear()
    _thread = threading.Thread(target=listen, args=(_stop,), name="refill-listener", daemon=True)
    _thread.start()


def stop_listener() -> None:
    _stop.set()
    if _thread is not None:
        _thread.join(timeout=SWEEP_SECONDS + 1)
