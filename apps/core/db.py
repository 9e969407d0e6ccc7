"""Hot-path statements as server-side prepared statements on Django's own connection."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import psycopg
from django.db import connection


def sql_literals(values: Iterable[object]) -> str:
    """Constant values written into a statement as SQL string literals, sorted (``'a', 'b'``):
    the code's own choices (status values), never input; each must be an identifier."""
    literals = sorted(str(v) for v in values)
    assert all(v.isidentifier() for v in literals), literals  # nothing to quote or escape
    return ", ".join(f"'{v}'" for v in literals)


# psycopg's own loader for timestamptz text (its C one when psycopg[binary] is installed).
_TIMESTAMPTZ_LOADER = psycopg.adapters.get_loader(
    psycopg.adapters.types["timestamptz"].oid, psycopg.pq.Format.TEXT
)


def _prepared_cursor() -> psycopg.Cursor[Any]:
    """The connection's one cursor for prepared statements, made once per connection.

    It loads ``timestamptz`` with psycopg's own loader rather than Django's, which subclasses
    psycopg's pure-Python loader (no C parsing) and adds a ``replace(tzinfo=…)`` per value: the
    same aware datetimes, since Django sets the session's time zone to the one its loader
    attaches. Made once, its adapters are not copied again for every statement."""
    connection.ensure_connection()
    raw = connection.connection
    held: tuple[Any, psycopg.Cursor[Any]] | None = getattr(connection, "_catacloud_prepared", None)
    if held is not None and held[0] is raw and not held[1].closed:
        return held[1]
    if raw.prepare_threshold is None:
        # Django turns psycopg's preparation off (its client-side cursors never prepare);
        # server-side cursors like this one may use it.
        raw.prepare_threshold = 0
    cursor = psycopg.Cursor(raw)
    if _TIMESTAMPTZ_LOADER is not None:
        cursor.adapters.register_loader("timestamptz", _TIMESTAMPTZ_LOADER)
    connection._catacloud_prepared = (raw, cursor)  # type: ignore[attr-defined]
    return cursor


def fetch_one_prepared(sql: str, params: dict[str, Any] | list[Any]) -> tuple[Any, ...] | None:
    """Run ``sql`` on Django's connection (in its transaction, if any) as a server-side
    prepared statement and return the first row.

    Django binds parameters on the client, so PostgreSQL parses and plans every statement it
    sends; for the claim CTE that was half of the claim's time. Prepared, it is planned once
    per connection. Logged like Django's own queries when query logging is on (so query
    budgets in tests still count it)."""
    started = time.perf_counter()
    # Django's error wrapping: a lost connection is a django.db error, and marked so that the
    # connection is checked (and replaced) before its next use.
    with connection.wrap_database_errors:
        cursor = _prepared_cursor()
        cursor.execute(sql, params, prepare=True)
        row = cursor.fetchone()
    if connection.queries_logged:
        connection.queries_log.append({"sql": sql, "time": f"{time.perf_counter() - started:.3f}"})
    return row
