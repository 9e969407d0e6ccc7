"""Claiming a ready machine in one statement, shared by pool acquires and job placement.

The move itself (ready → claimed, its timestamps, its event kind) is the instance state
machine's (``INSTANCE_STATES.statement_move``: the same graph check and registry as every other
move), written into this statement so the claim stays one round trip.

``WITH c AS (SELECT … ORDER BY … LIMIT 1 FOR UPDATE SKIP LOCKED) UPDATE … FROM c RETURNING``
plus the event insert and (pool claims) the refill signal, as a single round trip: no
broker call on the claim path. Never
``filter(pk__in=qs.select_for_update(skip_locked=True)[:1]).update(...)``: PostgreSQL may
re-evaluate an IN subquery and update more rows than the LIMIT.
"""

from __future__ import annotations

import functools
import uuid
from datetime import timedelta
from typing import Any

from django.db import connection
from django.db.models import Field, Model
from django.utils import timezone

from apps.core import tracing
from apps.core.actors import Actor
from apps.core.db import fetch_one_prepared, sql_literals
from apps.core.ids import JobId
from apps.core.transitions import StatementMove
from apps.events.kinds import EventKind
from apps.events.models import Event
from apps.machines.choices import InstanceStatus
from apps.machines.models import MachineInstance, MachineType, ProviderAccount
from apps.machines.services import INSTANCE_STATES

_COLUMNS = [f.column for f in MachineInstance._meta.concrete_fields]
_ATTNAMES = [f.attname for f in MachineInstance._meta.concrete_fields]
# Columns whose raw value Django converts on the way out of the database (JSON arrives as text).
_CONVERTED = [
    (i, f) for i, f in enumerate(MachineInstance._meta.concrete_fields) if hasattr(f, "from_db_value")
]

# Table and column names come from the models (a renamed field breaks here, not in production).
_INSTANCES = MachineInstance._meta.db_table
_TYPES = MachineType._meta.db_table
_ACCOUNTS = ProviderAccount._meta.db_table
_EVENTS = Event._meta.db_table
# The pool table through the instance's foreign key: machines never imports the pools app.
_POOLS = MachineInstance._meta.get_field("pool").related_model._meta.db_table


def _col(model: type[Model], name: str) -> str:
    field = model._meta.get_field(name)
    assert isinstance(field, Field) and field.column  # a concrete column, checked at import
    return connection.ops.quote_name(field.column)


# The event each claim appends, in the statement: (Event field, SQL value) pairs. Times are
# the statement's (clock_timestamp()), not its transaction's start (now()): a placement's
# transaction may begin before the previous job released the machine it then claims, and the
# cost attribution orders a machine's claims and releases by these times.
EVENT_VALUES: tuple[tuple[str, str], ...] = (
    ("org", "u.org_id"),
    ("kind", "%(kind)s"),
    ("created_at", "clock_timestamp()"),
    ("actor", "%(actor)s"),
    ("reason", "''"),
    ("pool_id", "u.pool_id"),
    ("instance_id", "u.id"),
    ("job_id", "%(job)s"),
    (
        "data",
        "jsonb_build_object('claim_id', %(claim)s::text, 'acquired_by', %(by)s::text,"
        " 'acquired_for', %(for)s::text)",
    ),
)


# The refill signal: the claim that takes a member of a pool with no refill pending marks the
# pool and notifies the refill listener (apps/pools/refill.py), inside the same statement.
REFILL_CHANNEL = "catacloud_refill"
_SIGNAL = f"""
, r AS (
    UPDATE {_POOLS} p SET refill_requested_at = now()
    FROM u WHERE p.id = u.pool_id AND p.refill_requested_at IS NULL
    RETURNING p.id
), n AS (
    SELECT pg_notify('{REFILL_CHANNEL}', r.id::text) FROM r
)"""


_SIGNAL_COUNT = ", (SELECT count(*) FROM n)"  # makes the notify CTE run


def _move(event: EventKind) -> StatementMove[EventKind]:
    """ready → claimed as the instance state machine writes it (its graph, its timestamps at the
    statement's time, the registered event), for the statement below."""
    return INSTANCE_STATES.statement_move(
        to=InstanceStatus.CLAIMED,
        from_=[InstanceStatus.READY],
        now_sql="clock_timestamp()",
        alias="m",
        event=event,
    )


def _sql(candidates: str, move: StatementMove[EventKind], *, signal: bool = False) -> str:
    event_columns = ", ".join(_col(Event, name) for name, _ in EVENT_VALUES)
    event_values = ", ".join(value for _, value in EVENT_VALUES).replace("%(kind)s", f"'{move.kind}'")
    return f"""
WITH c AS (
    {candidates}
    LIMIT 1
    FOR UPDATE OF m SKIP LOCKED
), u AS (
    UPDATE {_INSTANCES} m
    SET {move.set_sql},
        claim_id = %(claim)s,
        claimed_by = %(by)s, claimed_for = %(for)s, lease_expires_at = %(lease)s,
        last_config_id = COALESCE(%(last_config)s::uuid, m.last_config_id)
    FROM c WHERE m.id = c.id AND {move.where_sql}
    RETURNING m.*
), e AS (
    INSERT INTO {_EVENTS} ({event_columns})
    SELECT {event_values}
    FROM u
){_SIGNAL if signal else ""}
SELECT {", ".join(f"u.{c}" for c in _COLUMNS)}, mt.name, pa.kind, mt.server_type, mt.location,
       COALESCE(pa.config->>'ssh_user', ''){_SIGNAL_COUNT if signal else ""}
FROM u
JOIN {_TYPES} mt ON mt.id = u.machine_type_id
JOIN {_ACCOUNTS} pa ON pa.id = u.provider_account_id
"""


# Pool acquire: the oldest ready member of a pool in one of the ``active`` statuses (partial
# index instance_ready_by_pool). The statuses are the pools app's (machines never imports it)
# and constant, so they are written into the statement rather than sent as an array parameter
# with every claim.
def _pool_candidates(active: frozenset[str], order: str) -> str:
    statuses = sql_literals(active)  # enum values: safe as literals
    return f"""SELECT m.id FROM {_INSTANCES} m
    JOIN {_POOLS} p ON m.pool_id = p.id AND p.id = %(pool)s AND p.status IN ({statuses})
        AND (%(org)s::uuid IS NULL OR p.org_id = %(org)s::uuid)
    WHERE m.status = 'ready'
    ORDER BY {order}"""


# Whether a machine's image store holds the job's image (``%(image)s``: its reference, NULL
# for a job without one): placement prefers such a machine, whose job starts without a pull.
HOLDS_IMAGE = "COALESCE(m.images @> jsonb_build_array(%(image)s::text), false)"


@functools.cache
def pool_sql(active: frozenset[str], *, in_transaction: bool) -> str:
    """The pool claim. In autocommit (the REST acquire) the statement signals the refill
    itself. Inside a longer transaction (job placement) it does not (its row lock would be
    held until that transaction ends, stalling other claims; the caller signals after commit)
    and takes a member holding the job's image first."""
    if in_transaction:
        candidates = _pool_candidates(active, f"{HOLDS_IMAGE} DESC, m.ready_at")
        return _sql(candidates, _move(EventKind.POOL_MEMBER_CLAIMED))
    return _sql(_pool_candidates(active, "m.ready_at"), _move(EventKind.POOL_MEMBER_CLAIMED), signal=True)


# Job placement on an idle machine kept for reuse: prefer the one that holds the job's image,
# then the one that last ran the same configuration (warm caches), then the one that became
# idle first.
IDLE_SQL = _sql(
    f"""SELECT m.id FROM {_INSTANCES} m
    WHERE m.pool_id IS NULL AND m.status = 'ready' AND m.org_id = %(org)s AND m.machine_type_id = %(mt)s
      AND m.machine_type_version = %(version)s
    ORDER BY {HOLDS_IMAGE} DESC, (m.last_config_id IS NOT DISTINCT FROM %(config)s) DESC, m.ready_at""",
    _move(EventKind.INSTANCE_CLAIMED),
)


def claim(
    sql: str,
    *,
    actor: Actor = Actor.UNNAMED,
    by: str = "",
    for_: str = "",
    job_id: JobId | None = None,
    lease_seconds: float | None = None,
    **params: Any,
) -> tuple[uuid.UUID, MachineInstance | None]:
    """Run a claim statement; returns (claim id, the claimed instance or None). With
    ``lease_seconds`` the claim expires then and the reaper releases the machine."""
    claim_id = uuid.uuid4()
    values = {
        "lease": timezone.now() + timedelta(seconds=lease_seconds) if lease_seconds else None,
        "claim": claim_id,
        "by": by[:200],
        "for": for_[:200],
        "actor": actor[:200],
        "job": str(job_id) if job_id else None,
        "last_config": None,  # the configuration of the job it is claimed for: placement prefers it
        **params,
    }
    with tracing.span("claim", by=by[:64]) as span:
        row = fetch_one_prepared(sql, values)
        if span is not None:
            span.set_attribute("claimed", row is not None)
    if row is None:
        return claim_id, None
    raw = list(row[: len(_ATTNAMES)])
    for i, field in _CONVERTED:
        raw[i] = field.from_db_value(raw[i], None, connection)
    instance = MachineInstance.from_db(connection.alias, _ATTNAMES, raw)
    # What an answer names besides the row (the acquire endpoint needs no second query),
    # including how to reach the machine (server type, location, the account's SSH user).
    n = len(_ATTNAMES)
    instance.machine_type_name = row[n]  # type: ignore[attr-defined]
    instance.provider_kind = row[n + 1]  # type: ignore[attr-defined]
    instance.machine_server_type = row[n + 2]  # type: ignore[attr-defined]
    instance.machine_location = row[n + 3]  # type: ignore[attr-defined]
    instance.ssh_user = row[n + 4]  # type: ignore[attr-defined]
    return claim_id, instance
