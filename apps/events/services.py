from __future__ import annotations

from typing import Any
from uuid import UUID

from django.db.models import Model

from apps.core.ids import RowRef
from apps.core.registry import registered
from apps.events.kinds import EventKind
from apps.events.models import Event


def event_record(
    *,
    kind: EventKind,
    org: RowRef = None,
    actor: str = "",
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

    def pk(value: RowRef) -> UUID | str | None:
        return value.pk if isinstance(value, Model) else value

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
