from __future__ import annotations

from typing import Any

from apps.core.registry import registered
from apps.events.kinds import EventKind
from apps.events.models import Event


def event_record(
    *,
    kind: EventKind,
    org: Any = None,
    actor: str = "",
    reason: str = "",
    pool: Any = None,
    instance: Any = None,
    job: Any = None,
    **data: Any,
) -> Event:
    """Append an event. Call it inside the transaction of the change it records.

    ``org``, ``pool``, ``instance`` and ``job`` accept a model instance or a primary key.
    ``data`` must be JSON-serialisable and must never hold a secret.
    """

    def pk(value: Any) -> Any:
        return getattr(value, "pk", value)

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
