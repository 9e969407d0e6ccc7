"""Compare-and-set state changes, the one way any status in Catacloud changes.

``UPDATE … SET status = to WHERE id = pk AND status IN (allowed sources)``: a row count
other than 1 means another actor won the race (or the move is not allowed); we re-read and
raise :class:`InvalidTransition`, never overwrite.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any, Generic, Protocol, TypeVar
from uuid import UUID

from django.db import models, transaction
from django.utils import timezone

from apps.core.actors import Actor
from apps.core.db import sql_literals
from apps.core.errors import InvalidTransition
from apps.core.ids import RowRef

Graph = Mapping[str, frozenset[str]]
K = TypeVar("K", bound=StrEnum)
K_contra = TypeVar("K_contra", bound=StrEnum, contravariant=True)
M = TypeVar("M", bound=models.Model)


class Recorder(Protocol[K_contra]):
    """What records a state change's event in its transaction (``apps.events.services.event_record``:
    the events app sits above core, so each state machine is handed it where it is built)."""

    def __call__(
        self,
        *,
        kind: K_contra,
        org: RowRef = ...,
        actor: Actor = ...,
        reason: str = ...,
        pool: RowRef = ...,
        instance: RowRef = ...,
        job: RowRef = ...,
        **data: Any,
    ) -> object: ...


@dataclass(frozen=True)
class NewEvent(Generic[K]):
    """One event of a bulk move: its kind, who, and what it names (``org``, ``pool``,
    ``instance``, ``job``; anything else goes to its data)."""

    kind: K
    actor: Actor
    refs: Mapping[str, Any]
    reason: str = ""


class BulkRecorder(Protocol[K]):
    """What records a bulk move's events in one statement, in its transaction
    (``apps.events.services.events_record``)."""

    def __call__(self, events: Sequence[NewEvent[K]]) -> object: ...


def sources_for(graph: Graph, target: str) -> frozenset[str]:
    """Every state from which ``target`` may be reached in one step."""
    return frozenset(src for src, targets in graph.items() if target in targets)


def _has_field(model: type[models.Model], name: str) -> bool:
    return any(f.name == name for f in model._meta.concrete_fields)


def _assign(row: models.Model, values: Mapping[str, Any]) -> None:
    """Set on ``row`` in memory what an UPDATE wrote: a foreign key given as its id goes to the
    id's attribute."""
    for name, value in values.items():
        field = row._meta.get_field(name)
        if field.many_to_one and value is not None and not isinstance(value, models.Model):
            setattr(row, field.attname, value)  # type: ignore[union-attr]  # a concrete foreign key
        else:
            setattr(row, name, value)


def _allowed(graph: Graph, to: str, from_: Iterable[str] | None) -> frozenset[str]:
    allowed = sources_for(graph, to)
    return allowed if from_ is None else allowed & frozenset(from_)


def _compare_and_set(
    rows: models.QuerySet[Any],
    *,
    graph: Graph,
    to: str,
    from_: Iterable[str] | None,
    field: str = "status",
    where: Mapping[str, Any] | None = None,
    **changes: Any,
) -> int:
    """``UPDATE … SET field = to WHERE <rows> AND field IN (allowed)``: how many rows moved."""
    model = rows.model
    now = timezone.now()
    if field == "status" and _has_field(model, "status_changed_at"):
        changes.setdefault("status_changed_at", now)
    if _has_field(model, "updated_at"):  # auto_now holds only for save(), not for update()
        changes.setdefault("updated_at", now)
    allowed = _allowed(graph, to, from_)
    return rows.filter(**{f"{field}__in": allowed}, **(where or {})).update(**{field: to}, **changes)


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
    rows = model._default_manager.filter(pk=pk)
    updated = _compare_and_set(rows, graph=graph, to=to, from_=from_, field=field, where=where, **changes)
    if updated != 1:
        current = rows.values_list(field, flat=True).first()
        raise InvalidTransition(str(model._meta.verbose_name).capitalize(), pk, current, to)


@dataclass(frozen=True)
class StatementMove(Generic[K]):
    """A move written into a statement of one's own (:meth:`StateMachine.statement_move`): the
    claim's single round trip updates the row, inserts its event and signals the refill in one
    CTE, so it cannot call :meth:`StateMachine.move`; it takes its SQL from here instead."""

    set_sql: str  # the status, its timestamps: ``status = 'claimed', status_changed_at = …``
    where_sql: str  # the allowed sources: ``status = 'ready'``
    kind: K  # the event the move records (the statement inserts it)


@dataclass(frozen=True)
class StateMachine(Generic[M, K]):
    """One model's state machine: its graph, the timestamp each state stamps, the event each
    state records, and what entering a state does besides (``on_enter``). Every status
    change of that model goes through it: :meth:`move` (or :meth:`try_move`) for one row,
    :meth:`move_many` for a batch the caller holds locked (admission), and
    :meth:`statement_move` for a statement of one's own (the claim); all three check the move
    against the graph and record the state's registered event.

    Event kinds are members of ``kinds`` (the event registry, ``apps.events.kinds.EventKind``):
    ``<event_prefix>.<state>`` unless ``events`` names another; a state whose kind is not
    registered fails when the machine is built (at import), not when it is first entered."""

    model: type[M]
    graph: Graph
    event_prefix: str
    kinds: type[K]
    record: Recorder[K]
    record_many: BulkRecorder[K]
    stamps: Mapping[Any, str] = field(default_factory=dict)
    # state -> event kind when it is not ``<event_prefix>.<state>``
    events: Mapping[Any, K] = field(default_factory=dict)
    # state -> called with (row, now) inside the transaction, after the change
    on_enter: Mapping[Any, Callable[[M, datetime], None]] = field(default_factory=dict)
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

    def _stamp(self, to: str, changes: dict[str, Any], now: datetime) -> None:
        """The timestamp ``to`` stamps (``admitted_at``, …) at ``now``, unless ``changes`` sets it."""
        stamp = self.stamps.get(to)
        if stamp and stamp not in changes:
            changes[stamp] = now

    def move(
        self,
        pk: UUID,
        *,
        to: str,
        from_: Iterable[str] | None = None,
        actor: Actor = Actor.UNNAMED,
        reason: str = "",
        event: K | None = None,
        now: datetime | None = None,
        event_data: Mapping[str, Any] | None = None,
        where: Mapping[str, Any] | None = None,
        **changes: Any,
    ) -> M:
        """Compare-and-set row ``pk`` to ``to``, stamp the state's timestamp, record its event
        (the model's ``event_refs()`` names the org/pool/instance/job) and run ``on_enter``, in
        one transaction. Returns the row as it is after the change; raises
        :class:`InvalidTransition` (changing nothing) when another actor won."""
        now = now or timezone.now()
        self._stamp(to, changes, now)
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

    def move_locked(
        self,
        pk: UUID,
        *,
        refs: Mapping[str, Any],
        to: str,
        from_: Iterable[str],
        actor: Actor = Actor.UNNAMED,
        event_data: Mapping[str, Any] | None = None,
        **changes: Any,
    ) -> None:
        """:meth:`move` for a caller that holds row ``pk`` locked in its transaction and knows
        what its event names (``refs``, as the row's ``event_refs()`` would): no savepoint of its
        own and no read of the row back (three round trips less, on every job's assignment). A
        failure ends the caller's transaction (or savepoint), which it must not continue. Not
        for a state with an ``on_enter`` step (it needs the row)."""
        if to in self.on_enter:
            raise ValueError(f"{self.event_prefix}.{to} runs on_enter: use move()")
        now = timezone.now()
        self._stamp(to, changes, now)
        with transaction.atomic(savepoint=False):
            transition(self.model, pk, graph=self.graph, to=to, from_=from_, **changes)
            self.record(kind=self._kind_of[to], actor=actor, **refs, **{"status": to, **(event_data or {})})

    def move_held(
        self,
        row: M,
        *,
        to: str,
        from_: Iterable[str] | None = None,
        actor: Actor = Actor.UNNAMED,
        reason: str = "",
        event: K | None = None,
        event_data: Mapping[str, Any] | None = None,
        **changes: Any,
    ) -> M:
        """:meth:`move` for a ``row`` the caller loaded locked (``select_for_update``) in its
        transaction: no savepoint of its own and no read back (three round trips less, on every
        job's end). ``row`` gets in memory what was written (the state, its stamps, ``changes``)
        and is returned; its event names what the row names after the change, as with
        :meth:`move`. As with :meth:`move_locked`, a failure ends the caller's transaction, and a
        state with an ``on_enter`` step needs :meth:`move`."""
        if to in self.on_enter:
            raise ValueError(f"{self.event_prefix}.{to} runs on_enter: use move()")
        if any(hasattr(v, "resolve_expression") for v in changes.values()):  # F(), Now(): no value yet
            raise ValueError("an expression's value is the database's: use move()")
        now = timezone.now()
        self._stamp(to, changes, now)
        for stamp in ("status_changed_at", "updated_at"):  # the same instant in the row and in memory
            if _has_field(self.model, stamp):
                changes.setdefault(stamp, now)
        with transaction.atomic(savepoint=False):
            transition(self.model, row.pk, graph=self.graph, to=to, from_=from_, **changes)
            _assign(row, {"status": to, **changes})
            self.record(
                kind=event or self._kind_of[to],
                actor=actor,
                reason=reason,
                **row.event_refs(),  # type: ignore[attr-defined]  # every stateful model has it
                **{"status": to, **(event_data or {})},
            )
        return row

    def try_move(self, pk: UUID, **kwargs: Any) -> M | None:
        """:meth:`move`, or None when the row was not in a state that allows it (a lost race:
        the other actor's outcome stands)."""
        try:
            return self.move(pk, **kwargs)
        except InvalidTransition:
            return None

    def move_many(
        self,
        pks: Sequence[UUID],
        *,
        to: str,
        from_: Iterable[str],
        refs: Callable[[UUID], Mapping[str, Any]],
        actor: Actor = Actor.UNNAMED,
        event: K | None = None,
        now: datetime | None = None,
        **changes: Any,
    ) -> int:
        """The bulk move: every row of ``pks`` from ``from_`` to ``to`` in one UPDATE (the same
        graph check and timestamps as :meth:`move`) and their events in one INSERT (the same
        kind, ``{"status": to}`` as data; ``refs(pk)`` names what each event names, as the
        model's ``event_refs()`` would, without loading the rows).

        For a batch the caller holds locked (admission takes its jobs ``FOR UPDATE``): a row
        that did not move means the lock was not held, so nothing moves at all
        (:class:`InvalidTransition`, which ends the caller's transaction or savepoint: no
        savepoint of its own, two round trips less on every admission). States with an
        ``on_enter`` step cannot be entered in bulk. Returns how many rows moved (all of them)."""
        if to in self.on_enter:
            raise ValueError(f"{self.event_prefix}.{to} runs on_enter: move its rows one at a time")
        if not pks:
            return 0
        now = now or timezone.now()
        self._stamp(to, changes, now)
        kind = event or self._kind_of[to]
        with transaction.atomic(savepoint=False):
            rows = self.model._default_manager.filter(pk__in=pks)
            updated = _compare_and_set(rows, graph=self.graph, to=to, from_=from_, **changes)
            if updated != len(pks):  # never half a batch
                raise InvalidTransition(
                    str(self.model._meta.verbose_name).capitalize(),
                    f"{len(pks) - updated} of the batch",
                    "changed",
                    to,
                )
            self.record_many(
                [NewEvent(kind=kind, actor=actor, refs={**refs(pk), "status": to}) for pk in pks]
            )
        return updated

    def statement_move(
        self,
        *,
        to: str,
        from_: Iterable[str],
        now_sql: str = "now()",
        alias: str = "",
        event: K | None = None,
    ) -> StatementMove[K]:
        """The SQL of a move for a statement of one's own: ``SET`` the state, its
        ``status_changed_at`` and stamp (at ``now_sql``), ``WHERE`` the state is an allowed
        source, and the event kind to insert. Checked against the graph when called (at
        import): a move the graph does not allow fails there, not in production."""
        allowed = sorted(_allowed(self.graph, to, from_))
        if not allowed:
            raise ValueError(f"{self.event_prefix}: no allowed move from {sorted(from_)} to {to}")

        def column(name: str) -> str:
            field = self.model._meta.get_field(name)
            assert isinstance(field, models.Field) and field.column  # a concrete column
            return field.column

        quoted = sql_literals(allowed)
        prefix = f"{alias}." if alias else ""
        sets = [f"{column('status')} = '{to}'"]
        if _has_field(self.model, "status_changed_at"):
            sets.append(f"{column('status_changed_at')} = {now_sql}")
        if _has_field(self.model, "updated_at"):
            sets.append(f"{column('updated_at')} = {now_sql}")
        if stamp := self.stamps.get(to):
            sets.append(f"{column(stamp)} = {now_sql}")
        where = (
            f"{prefix}{column('status')} = {quoted}"
            if len(allowed) == 1
            else f"{prefix}{column('status')} IN ({quoted})"
        )
        return StatementMove(set_sql=", ".join(sets), where_sql=where, kind=event or self._kind_of[to])
