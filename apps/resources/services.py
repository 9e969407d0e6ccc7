"""Resources: the resource instance state machine (wells come with acquisition)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from apps.core.transitions import change_state
from apps.resources.choices import RESOURCE_TRANSITIONS, ResourceStatus
from apps.resources.models import ResourceInstance

_STAMPS = {
    ResourceStatus.READY: "ready_at",
    ResourceStatus.HELD: "held_at",
    ResourceStatus.RELEASING: "releasing_at",
    ResourceStatus.DESTROYED: "destroyed_at",
}


def resource_transition(
    *,
    resource_id: Any,
    to: str,
    from_: Iterable[str] | None = None,
    actor: str = "",
    reason: str = "",
    **changes: Any,
) -> ResourceInstance:
    """Compare-and-set a resource instance's status (``resource.<status>`` event)."""
    return change_state(
        ResourceInstance,
        resource_id,
        graph=RESOURCE_TRANSITIONS,
        to=to,
        event_prefix="resource",
        from_=from_,
        stamps=_STAMPS,
        actor=actor,
        reason=reason,
        **changes,
    )
