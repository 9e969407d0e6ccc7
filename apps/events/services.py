from __future__ import annotations

import logging
from typing import Any

from django.conf import settings

from apps.events.kinds import EventKind
from apps.events.models import Event

log = logging.getLogger(__name__)


def check_kind(kind: str) -> str:
    """``kind`` if registered in EventKind; otherwise an error (strict) or a logged bug."""
    if kind in EventKind._value2member_map_:
        return kind
    if settings.CATACLOUD_STRICT_REGISTRIES:
        raise ValueError(f"event kind {kind!r} is not registered in apps.events.kinds.EventKind")
    log.error("event kind %r is not registered in apps.events.kinds.EventKind", kind)
    return kind


def event_record(
    *,
    kind: str,
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
        kind=check_kind(kind),
        org_id=pk(org),
        actor=actor[:200],
        reason=reason,
        pool_id=pk(pool),
        instance_id=pk(instance),
        job_id=pk(job),
        data=data,
    )
