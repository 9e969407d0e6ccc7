from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from uuid import UUID

from django.db.models import Model

from apps.core.actors import Actor
from apps.core.ids import RowRef
from apps.core.registry import registered
from apps.core.transitions import NewEvent
from apps.events.kinds import EventKind
from apps.events.models import Event


def event_record(
    *,
    kind: EventKind,
    org: RowRef = None,
    actor: Actor = Actor.UNNAMED,
    reason: str = "",
    pool: RowRef = None,
    instance: RowRef = None,
    job: RowRef = None,
    **data: Any,
) -> Event:
    """Append an event. Call it inside the transaction of the change it records.

    ``org``, ``pool``, ``instance`` and ``job`` accept a model instance or a primary key.
    ``data`` must be JSON-serialisable and must never hold a secret.
    """

    return Event.objects.create(
        kind=registered(kind, EventKind),
        org_id=pk(org),
        actor=actor[:200],
        reason=reason,
        pool_id=pk(pool),
        instance_id=pk(instance),
        job_id=pk(job),
        data=data,
    )


REFS = ("org", "pool", "instance", "job")


def events_record(events: Sequence[NewEvent[EventKind]]) -> list[Event]:
    """Append many events in one INSERT (a state machine's bulk move), in the transaction of the
    change. Each names its ``org``/``pool``/``instance``/``job`` in ``refs``; the rest of
    ``refs`` is its data (JSON-serialisable, never a secret)."""
    return Event.objects.bulk_create(
        Event(
            kind=registered(event.kind, EventKind),
            org_id=pk(event.refs.get("org")),
            actor=event.actor[:200],
            reason=event.reason,
            pool_id=pk(event.refs.get("pool")),
            instance_id=pk(event.refs.get("instance")),
            job_id=pk(event.refs.get("job")),
            data={k: v for k, v in event.refs.items() if k not in REFS},
        )
        for event in events
    )


def pk(value: RowRef) -> UUID | str | None:
    """A row's primary key, or the id given."""
    return value.pk if isinstance(value, Model) else value
