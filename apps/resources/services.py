"""Resources: the resource instance state machine (wells come with acquisition)."""

from __future__ import annotations

from apps.core.transitions import StateMachine
from apps.events.kinds import EventKind
from apps.events.services import event_record, events_record
from apps.resources.choices import RESOURCE_TRANSITIONS, ResourceStatus
from apps.resources.models import ResourceInstance

_STAMPS = {
    ResourceStatus.READY: "ready_at",
    ResourceStatus.HELD: "held_at",
    ResourceStatus.RELEASING: "releasing_at",
    ResourceStatus.DESTROYED: "destroyed_at",
}


# Every resource status change: RESOURCE_STATES.move(resource_id, to=..., ...).
RESOURCE_STATES = StateMachine(
    ResourceInstance,
    RESOURCE_TRANSITIONS,
    "resource",
    kinds=EventKind,
    record=event_record,
    record_many=events_record,
    stamps=_STAMPS,
)
