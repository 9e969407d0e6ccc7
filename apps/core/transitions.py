"""Compare-and-set state changes, the one way any status in Catacloud changes.

``UPDATE … SET status = to WHERE id = pk AND status IN (allowed sources)``: a row count
other than 1 means another actor won the race (or the move is not allowed); we re-read and
raise :class:`InvalidTransition`, never overwrite.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any, Generic, Protocol, TypeVar
from uuid import UUID

from django.db import models, transaction
from django.utils import timezone

from apps.core.errors import InvalidTransition
from apps.core.ids import RowRef

Graph = Mapping[str, frozenset[str]]
K = TypeVar("K", bound=StrEnum)
K_contra = TypeVar("K_contra", bound=StrEnum, contravariant=True)


class Recorder(Protocol[K_contra]):
    """What records a state change's event in its transaction (``apps.events.services.event_record``:
    the events app sits above core, so each state machine is handed it where it is built)."""

    def __call__(
        self,
        *,
        kind: K_contra,
        org: RowRef = ...,
        actor: str = ...,
        reason: str = ...,
        pool: RowRef = ...,
        instance: RowRef = ...,
        job: RowRef = ...,
        **data: Any,
    ) -> object: ...


def sources_for(graph: Graph, target: str) -> frozenset[str]:
    """Every state from which ``target`` may be reached in one step."""
    return frozenset(src for src, targets in graph.items() if target in targets)


def _has_field(model: type[models.Model], name: str) -> bool:
    return any(f.name == name for f in model._meta.concrete_fields)


def transition(
    model: type[models.Model],
    pk: UUID,
    *,
    graph: Graph,
    to: str,
    from_: Iterable[str] | None = None,
    field: str = "status",
    where: Mapping[str, Any] | None = None,
    **changes: Any,
) -> None:
    """Move row ``pk`` of ``model`` to state ``to`` if its current state allows it.

    ``from_`` narrows the allowed sources further (e.g. only ``ready → claimed``).
    ``where`` adds conditions (e.g. the job is still this machine's). Extra keyword
    arguments are written in the same UPDATE.
    """
    allowed = sources_for(graph, to)
    now = timezone.now()
    if field == "status" and _has_field(model, "status_changed_at"):
        changes.setdefault("status_changed_at", now)
    if _has_field(model, "updated_at"):  # auto_now holds only for save(), not for update()
        changes.setdefault("updated_at", now)
    if from_ is not None:
        allowed = allowed & frozenset(from_)
    rows = model._default_manager.filter(pk=pk)
    updated = rows.filter(**{f"{field}__in": allowed}, **(where or {})).update(**{field: to}, **changes)
    if updated != 1:
        current = rows.values_list(field, flat=True).first()
        raise InvalidTransition(str(model._meta.verbose_name).capitalize(), pk, current, to)


@dataclass(frozen=True)
class StateMachine(Generic[K]):
    """One model's state machine: its graph, the timestamp each state stamps, the event each
    state records, and what entering a state does besides (``on_enter``). Every status
    change of that model goes through :meth:`move` (or :meth:`try_move`).

    Event kinds are members of ``kinds`` (the event registry, ``apps.events.kinds.EventKind``):
    ``<event_prefix>.<state>`` unless ``events`` names another; a state whose kind is not
    registered fails when the machine is built (at import), not when it is first entered."""

    model: type[models.Model]
    graph: Graph
    event_prefix: str
    kinds: type[K]
    record: Recorder[K]
    stamps: Mapping[Any, str] = field(default_factory=dict)
    # state -> event kind when it is not ``<event_prefix>.<state>``
    events: Mapping[Any, K] = field(default_factory=dict)
    # state -> called with (row, now) inside the transaction, after the change
    on_enter: Mapping[Any, Callable[[Any, datetime], None]] = field(default_factory=dict)
    _kind_of: dict[str, K] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        states = set(self.graph) | {t for targets in self.graph.values() for t in targets}
        object.__setattr__(
            self,
            "_kind_of",
            {s: self.events.get(s) or self.kinds(f"{self.event_prefix}.{s}") for s in sorted(states)},
        )

    def kind_for(self, state: str) -> K:
        """The event kind entering ``state`` records (unless a move names another)."""
        return self._kind_of[state]

    def move(
        self,
        pk: UUID,
        *,
        to: str,
        from_: Iterable[str] | None = None,
        actor: str = "",
        reason: str = "",
        event: K | None = None,
        now: datetime | None = None,
        event_data: Mapping[str, Any] | None = None,
        where: Mapping[str, Any] | None = None,
        **changes: Any,
    ) -> Any:
        """Compare-and-set row ``pk`` to ``to``, stamp the state's timestamp, record its event
        (the model's ``event_refs()`` names the org/pool/instance/job) and run ``on_enter``, in
        one transaction. Returns the row as it is after the change; raises
        :class:`InvalidTransition` (changing nothing) when another actor won."""
        now = now or timezone.now()
        stamp = self.stamps.get(to)
        if stamp and stamp not in changes:
            changes[stamp] = now
        with transaction.atomic():
            transition(self.model, pk, graph=self.graph, to=to, from_=from_, where=where, **changes)
            row = self.model._default_manager.get(pk=pk)
            self.record(
                kind=event or self._kind_of[to],
                actor=actor,
                reason=reason,
                **row.event_refs(),  # type: ignore[attr-defined]  # every stateful model has it
                **{"status": to, **(event_data or {})},
            )
            entered = self.on_enter.get(to)
            if entered is not None:
                entered(row, now)
        return row

    def try_move(self, pk: UUID, **kwargs: Any) -> Any | None:
        """:meth:`move`, or None when the row was not in a state that allows it (a lost race:
        the other actor's outcome stands)."""
        try:
            return self.move(pk, **kwargs)
        except InvalidTransition:
            return None
