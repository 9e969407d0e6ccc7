"""Every state machine: each allowed move works and is recorded; each forbidden one raises
InvalidTransition and changes nothing (no status change, no event)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
from django.db import transaction
from django.db.models import Value

from apps.core.errors import InvalidTransition
from apps.events.models import Event
from apps.jobs.choices import JOB_TRANSITIONS, JobStatus
from apps.jobs.models import Job, JobConfiguration
from apps.jobs.services import JOB_STATES
from apps.machines.choices import INSTANCE_TRANSITIONS, InstanceStatus
from apps.machines.models import MachineInstance
from apps.machines.services import INSTANCE_STATES
from apps.pools.choices import POOL_TRANSITIONS, PoolStatus
from apps.pools.models import InstancePool
from apps.pools.services import POOL_STATES
from apps.resources.choices import RESOURCE_TRANSITIONS, ResourceStatus
from apps.resources.models import ResourceInstance
from apps.resources.services import RESOURCE_STATES
from testkit.builders import instance_row, job_config, job_row, pool_row, resource_row
from tests.concurrency import at_once
from tests.conftest import World


def make_instance(world: World, status: str) -> MachineInstance:
    return instance_row(world.org, world.machine_type, status=status)


def make_pool(world: World, status: str) -> InstancePool:
    return pool_row(world.org, world.machine_type, name=f"p-{status}", status=status)


def make_job(world: World, status: str) -> Job:
    config = JobConfiguration.objects.filter(org=world.org, name="build").first()
    return job_row(config or job_config(world.org, world.machine_type, "build", "true"), status=status)


def make_resource(world: World, status: str) -> ResourceInstance:
    return resource_row(world.org, status=status)


MACHINES: dict[str, tuple[dict, Callable[[World, str], Any], Callable[..., Any], str]] = {
    "instance": (
        INSTANCE_TRANSITIONS,
        make_instance,
        lambda pk, to: INSTANCE_STATES.move(pk, to=to),
        "instance",
    ),
    "pool": (POOL_TRANSITIONS, make_pool, lambda pk, to: POOL_STATES.move(pk, to=to), "pool"),
    "job": (JOB_TRANSITIONS, make_job, lambda pk, to: JOB_STATES.move(pk, to=to), "job"),
    "resource": (
        RESOURCE_TRANSITIONS,
        make_resource,
        lambda pk, to: RESOURCE_STATES.move(pk, to=to),
        "resource",
    ),
}

CASES = [
    pytest.param(name, src, dst, dst in graph[src], id=f"{name}:{src}->{dst}")
    for name, (graph, *_rest) in MACHINES.items()
    for src in graph
    for dst in graph
    if src != dst
]


@pytest.mark.parametrize(("machine", "src", "dst", "allowed"), CASES)
def test_transition(world: World, machine: str, src: str, dst: str, allowed: bool) -> None:
    graph, make, move, prefix = MACHINES[machine]
    row = make(world, src)
    events_before = Event.objects.count()
    if allowed:
        moved = move(row.pk, dst)
        assert moved.status == dst
        row.refresh_from_db()
        assert row.status == dst
        event = Event.objects.latest("id")
        from apps.jobs.services import JOB_EVENTS

        expected = JOB_EVENTS.get(dst, f"job.{dst}") if machine == "job" else f"{prefix}.{dst}"
        assert event.kind == expected
        assert event.org_id == world.org.pk
    else:
        with pytest.raises(InvalidTransition) as exc:
            move(row.pk, dst)
        assert exc.value.current == src and exc.value.target == dst
        assert exc.value.code == "invalid_state"
        row.refresh_from_db()
        assert row.status == src
        assert Event.objects.count() == events_before


def test_every_state_is_in_each_graph() -> None:
    """A state missing from a graph could never be left; the tables must be complete."""
    for choices, graph in (
        (InstanceStatus, INSTANCE_TRANSITIONS),
        (PoolStatus, POOL_TRANSITIONS),
        (JobStatus, JOB_TRANSITIONS),
        (ResourceStatus, RESOURCE_TRANSITIONS),
    ):
        assert set(graph) == set(choices.values)
        for targets in graph.values():
            assert targets <= set(choices.values)


def test_terminal_instance_records_billing(world: World) -> None:
    from datetime import timedelta

    from django.utils import timezone

    instance = make_instance(world, InstanceStatus.TERMINATING)
    MachineInstance.objects.filter(pk=instance.pk).update(
        provisioning_started_at=timezone.now() - timedelta(minutes=61)
    )
    ended = INSTANCE_STATES.move(instance.pk, to=InstanceStatus.TERMINATED)
    # Hourly billing: 61 minutes are two started hours at 0.01/h.
    assert ended.billed_seconds == 7200
    assert str(ended.cost) == "0.020000"


def test_event_is_part_of_the_change(world: World) -> None:
    """Events are written in the same transaction: a rollback loses both, never one."""
    instance = make_instance(world, InstanceStatus.READY)
    before = Event.objects.count()
    with pytest.raises(RuntimeError), transaction.atomic():
        INSTANCE_STATES.move(instance.pk, to=InstanceStatus.CLAIMED)
        raise RuntimeError("crash after the change")
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.READY
    assert Event.objects.count() == before


@pytest.mark.django_db(transaction=True)
def test_racing_transitions_have_one_winner(tworld: World) -> None:
    """Eight threads on eight connections claim the same ready instance: exactly one wins."""
    instance = make_instance(tworld, InstanceStatus.READY)
    results: list[str] = []
    lock = threading.Lock()

    def claim() -> None:
        try:
            INSTANCE_STATES.move(instance.pk, to=InstanceStatus.CLAIMED, from_=[InstanceStatus.READY])
            outcome = "won"
        except InvalidTransition as exc:
            outcome = f"lost:{exc.current}"
        with lock:
            results.append(outcome)

    at_once(8, claim, timeout=None)
    assert results.count("won") == 1
    assert sorted(results)[:7] == ["lost:claimed"] * 7
    assert Event.objects.filter(kind="instance.claimed", instance_id=instance.pk).count() == 1


def test_a_move_of_a_locked_row_is_a_move_without_a_savepoint_or_a_read_back(world: World) -> None:
    """The assignment's move: the same change, stamp and event as :meth:`move`, in two statements
    (the UPDATE and the event's INSERT); a lost race still raises and ends the caller's
    savepoint; a state with an on_enter step is refused."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    job = make_job(world, JobStatus.QUEUED)
    refs = {"org": world.org.pk, "job": job.pk}
    with CaptureQueriesContext(connection) as queries, transaction.atomic():
        JOB_STATES.move_locked(job.pk, refs=refs, to=JobStatus.ACQUIRING_RESOURCES, from_=[JobStatus.QUEUED])
    assert len(queries.captured_queries) == 4, queries.captured_queries  # with the savepoint around
    job.refresh_from_db()
    assert job.status == JobStatus.ACQUIRING_RESOURCES and job.admitted_at is not None  # the stamp
    event = Event.objects.get(job_id=job.pk)
    assert (event.kind, event.org_id, event.data) == (
        "job.admitted",
        world.org.pk,
        {"status": JobStatus.ACQUIRING_RESOURCES},
    )
    with pytest.raises(InvalidTransition), transaction.atomic():  # not queued any more
        JOB_STATES.move_locked(job.pk, refs=refs, to=JobStatus.ACQUIRING_RESOURCES, from_=[JobStatus.QUEUED])
    assert Event.objects.filter(job_id=job.pk).count() == 1
    with pytest.raises(ValueError, match="on_enter"):
        INSTANCE_STATES.move_locked(
            job.pk, refs=refs, to=InstanceStatus.TERMINATED, from_=[InstanceStatus.READY]
        )


def test_a_move_of_a_held_row_leaves_the_row_in_memory_as_the_database_has_it(world: World) -> None:
    """A job's end and its machine's release: the row the caller holds locked is moved in two
    statements (no savepoint, no read back), and what it holds in memory afterwards is what a
    read back would give, foreign keys given as ids included; the event names the row as it is
    after the move (a released machine has left its pool)."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    pool = make_pool(world, PoolStatus.READY)
    config = job_config(world.org, world.machine_type)
    instance = instance_row(world.org, world.machine_type, status=InstanceStatus.CLAIMED, pool=pool)
    with transaction.atomic():
        held = MachineInstance.objects.select_for_update().get(pk=instance.pk)
        with CaptureQueriesContext(connection) as queries:
            moved = INSTANCE_STATES.move_held(
                held,
                to=InstanceStatus.READY,
                from_=[InstanceStatus.CLAIMED],
                reason="kept",
                pool=None,
                claimed_by="",
                last_config=config.pk,  # an id for a foreign key, as release gives it
            )
    assert len(queries.captured_queries) == 2, [q["sql"][:60] for q in queries.captured_queries]
    fresh = MachineInstance.objects.get(pk=instance.pk)
    for name in ("status", "pool_id", "claimed_by", "last_config_id", "status_changed_at", "ready_at"):
        assert getattr(moved, name) == getattr(fresh, name), name
    assert (fresh.status, fresh.pool_id, fresh.last_config_id) == (InstanceStatus.READY, None, config.pk)
    event = Event.objects.get(instance_id=instance.pk, kind="instance.ready")
    assert (event.pool_id, event.reason, event.data) == (None, "kept", {"status": InstanceStatus.READY})
    job = make_job(world, JobStatus.RUNNING)
    with pytest.raises(ValueError, match="expression"), transaction.atomic():
        JOB_STATES.move_held(job, to=JobStatus.SUCCEEDED, exit_code=Value(0))
    with pytest.raises(ValueError, match="on_enter"), transaction.atomic():
        INSTANCE_STATES.move_held(fresh, to=InstanceStatus.TERMINATED)
    assert Job.objects.get(pk=job.pk).status == JobStatus.RUNNING  # refused before any write


def test_a_bulk_move_moves_every_row_and_records_each_event(world: World) -> None:
    jobs = [make_job(world, JobStatus.QUEUED) for _ in range(3)]
    moved = JOB_STATES.move_many(
        [j.pk for j in jobs],
        to=JobStatus.ACQUIRING_RESOURCES,
        from_=[JobStatus.QUEUED],
        refs=lambda pk: {"org": world.org.pk, "job": pk},
        actor="scheduler",
    )
    assert moved == 3
    for job in jobs:
        job.refresh_from_db()
        assert job.status == JobStatus.ACQUIRING_RESOURCES and job.admitted_at is not None  # the stamp
        event = Event.objects.get(job_id=job.pk)
        assert (event.kind, event.org_id, event.actor) == ("job.admitted", world.org.pk, "scheduler")
        assert event.data == {"status": JobStatus.ACQUIRING_RESOURCES}


def test_a_bulk_move_is_all_or_nothing_and_checks_the_graph(world: World) -> None:
    queued, running = make_job(world, JobStatus.QUEUED), make_job(world, JobStatus.RUNNING)
    pks = [queued.pk, running.pk]

    def refs(pk: Any) -> dict[str, Any]:
        return {"org": world.org.pk, "job": pk}

    # A failed bulk move ends the caller's transaction (here a savepoint of the test's own):
    # the row that did move goes back with it.
    with pytest.raises(InvalidTransition), transaction.atomic():  # one row is not queued: none moves
        JOB_STATES.move_many(
            pks, to=JobStatus.ACQUIRING_RESOURCES, from_=[JobStatus.QUEUED, JobStatus.RUNNING], refs=refs
        )
    with pytest.raises(InvalidTransition), transaction.atomic():  # queued -> running is no move
        JOB_STATES.move_many([queued.pk], to=JobStatus.RUNNING, from_=[JobStatus.QUEUED], refs=refs)
    statuses = dict(Job.objects.filter(pk__in=pks).values_list("pk", "status"))
    assert statuses == {queued.pk: JobStatus.QUEUED, running.pk: JobStatus.RUNNING}
    assert not Event.objects.filter(job_id__in=pks).exists()
    with pytest.raises(ValueError, match="on_enter"):  # an ending instance records its billing row by row
        INSTANCE_STATES.move_many([], to=InstanceStatus.TERMINATED, from_=[InstanceStatus.READY], refs=refs)


def test_a_statement_move_is_the_graph_s_and_its_events_the_registry_s() -> None:
    move = INSTANCE_STATES.statement_move(to=InstanceStatus.CLAIMED, from_=[InstanceStatus.READY], alias="m")
    assert move.where_sql == "m.status = 'ready'"
    assert move.set_sql.startswith("status = 'claimed', status_changed_at = now()")
    assert "claimed_at = now()" in move.set_sql  # the state's stamp
    assert move.kind == "instance.claimed"
    with pytest.raises(ValueError, match="no allowed move"):  # terminated never becomes claimed
        INSTANCE_STATES.statement_move(to=InstanceStatus.CLAIMED, from_=[InstanceStatus.TERMINATED])
