"""Pools: claim, refill, drift, schedules, drain, the reaper and its queries."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from apps.control.reaper import LISTENING, query_count, reaper_tick
from apps.core.errors import InvalidTransition, PoolEmpty
from apps.core.models import Heartbeat
from apps.events.models import Event
from apps.machines import lifecycle
from apps.machines.choices import InstanceStatus
from apps.machines.models import MachineInstance, MachineType, OrgMachineType, ProviderAccount
from apps.pools.convergence import apply_schedules
from apps.pools.models import InstancePool, PoolSchedule
from apps.pools.services import pool_claim, pool_create, pool_drain, pool_refill, pool_update
from catacloud.providers.fake import FakeProvider
from testkit.builders import fake_machine_type, ready_members
from testkit.processes import database_url, wait_for
from tests.concurrency import in_threads
from tests.conftest import World

S = InstanceStatus
GRANT = {"max_pool_size": 200, "max_instances": 200}


@pytest.fixture
def fake_type(world: World) -> MachineType:
    return fake_machine_type(world.org, account="pools", grant=GRANT)[0]


def provision_all() -> None:
    for pk in MachineInstance.objects.filter(status=S.PENDING).values_list("pk", flat=True):
        lifecycle.instance_provision(instance_id=pk)


@pytest.mark.django_db
def test_refill_requests_the_deficit_and_status_follows_readiness(
    world: World, fake_type: MachineType
) -> None:
    pool = pool_create(org=world.org, name="ci", machine_type=fake_type, target_size=3, max_size=5)
    assert pool_refill(pool_id=pool.pk) == 3
    assert pool_refill(pool_id=pool.pk) == 0  # already requested: nothing more
    provision_all()
    assert MachineInstance.objects.filter(pool=pool, status=S.WARMING).count() == 3
    assert len(FakeProvider.machines_of("pools")) == 3
    from apps.machines.agents import instance_heartbeat

    for inst in MachineInstance.objects.filter(pool=pool):
        instance_heartbeat(instance=inst)
    pool_refill(pool_id=pool.pk)
    pool.refresh_from_db()
    assert pool.status == "ready"
    kinds = list(Event.objects.filter(pool_id=pool.pk).order_by("id").values_list("kind", flat=True))
    assert kinds[0] == "pool.created"
    assert Counter(kinds)["pool.member_provisioned"] == 3 and Counter(kinds)["pool.member_warmed"] == 3
    assert kinds[-1] == "pool.ready"


@pytest.mark.django_db
def test_claim_hands_out_the_oldest_ready_member_and_answers_empty_at_once(
    world: World, fake_type: MachineType
) -> None:
    pool = pool_create(org=world.org, name="ci", machine_type=fake_type, target_size=2, max_size=4)
    first, second = ready_members(pool, 2)
    claim = pool_claim(pool_id=pool.pk, acquired_by="ci-runner-7", acquired_for="build 42")
    assert claim.instance.pk == first.pk and claim.instance.status == S.CLAIMED
    first.refresh_from_db()
    assert (first.status, first.claimed_by, first.claimed_for, first.claim_id) == (
        S.CLAIMED,
        "ci-runner-7",
        "build 42",
        claim.claim_id,
    )
    event = Event.objects.get(kind="pool.member_claimed")
    assert event.instance_id == first.pk and event.data["acquired_for"] == "build 42"
    assert pool_claim(pool_id=pool.pk).instance.pk == second.pk
    with pytest.raises(PoolEmpty):
        pool_claim(pool_id=pool.pk)


@pytest.mark.django_db
def test_a_draining_pool_refuses_claims_and_drain_terminates_members(
    world: World, fake_type: MachineType
) -> None:
    pool = pool_create(org=world.org, name="ci", machine_type=fake_type, target_size=3, max_size=3)
    ready_members(pool, 3)
    pool_claim(pool_id=pool.pk)
    terminated = pool_drain(pool=pool, terminate_members=True, actor="test")
    assert terminated == 3
    pool.refresh_from_db()
    assert pool.status == "drained"
    assert MachineInstance.objects.filter(pool=pool, status=S.TERMINATING).count() == 3
    with pytest.raises(InvalidTransition):
        pool_claim(pool_id=pool.pk)


@pytest.mark.django_db
def test_drain_without_terminating_releases_members_as_idle_machines(
    world: World, fake_type: MachineType
) -> None:
    pool = pool_create(org=world.org, name="ci", machine_type=fake_type, target_size=2, max_size=2)
    ready_members(pool, 2)
    assert pool_drain(pool=pool, terminate_members=False) == 0
    assert MachineInstance.objects.filter(pool__isnull=True, status=S.READY).count() == 2


@pytest.mark.django_db
def test_refill_stops_at_max_size_and_at_the_orgs_max_instances(world: World, fake_type: MachineType) -> None:
    pool = pool_create(org=world.org, name="ci", machine_type=fake_type, target_size=3, max_size=4)
    ready_members(pool, 3)
    for _ in range(3):
        pool_claim(pool_id=pool.pk)
    assert pool_refill(pool_id=pool.pk) == 1  # 3 claimed + 1 new = max_size 4
    pool.refresh_from_db()
    assert pool.limit_reason.startswith("pool_at_max_size")
    assert Event.objects.filter(kind="pool.pool_at_max_size", pool_id=pool.pk).count() == 1
    pool_refill(pool_id=pool.pk)  # the same limit again: no second event
    assert Event.objects.filter(kind="pool.pool_at_max_size", pool_id=pool.pk).count() == 1

    grant = world.org.machine_type_grants.get(machine_type=fake_type)
    grant.max_instances = 4
    grant.save()
    other = pool_create(org=world.org, name="other", machine_type=fake_type, target_size=2, max_size=2)
    assert pool_refill(pool_id=other.pk) == 0
    other.refresh_from_db()
    assert other.limit_reason == "quota_exceeded: max_instances 4/4"


@pytest.mark.django_db
def test_drift_replaces_outdated_members_once_replacements_are_ready(
    world: World, fake_type: MachineType
) -> None:
    pool = pool_create(org=world.org, name="ci", machine_type=fake_type, target_size=2, max_size=4)
    old = ready_members(pool, 2)
    fake_type.version += 1  # the operator changed the image
    fake_type.save()
    assert pool_refill(pool_id=pool.pk) == 2  # surge: new members first, old ones still serve
    assert set(
        MachineInstance.objects.filter(pk__in=[o.pk for o in old]).values_list("status", flat=True)
    ) == {S.READY}
    assert MachineInstance.objects.filter(pool=pool, outdated=True).count() == 2
    MachineInstance.objects.filter(pool=pool, status=S.PENDING).update(
        status=S.READY, ready_at=timezone.now()
    )
    pool_refill(pool_id=pool.pk)
    assert set(
        MachineInstance.objects.filter(pk__in=[o.pk for o in old]).values_list("status", flat=True)
    ) == {S.TERMINATING}
    fresh = MachineInstance.objects.filter(pool=pool, status=S.READY)
    assert {m.machine_type_version for m in fresh} == {fake_type.version}


@pytest.mark.django_db
def test_lowering_target_terminates_the_surplus(world: World, fake_type: MachineType) -> None:
    pool = pool_create(org=world.org, name="ci", machine_type=fake_type, target_size=4, max_size=4)
    ready_members(pool, 4)
    pool_update(pool=pool, target_size=1)
    pool_refill(pool_id=pool.pk)
    assert MachineInstance.objects.filter(pool=pool, status=S.READY).count() == 1
    assert MachineInstance.objects.filter(pool=pool, status=S.TERMINATING).count() == 3


@pytest.mark.django_db
def test_schedules_raise_the_target_before_a_burst_and_lower_it_after(
    world: World, fake_type: MachineType
) -> None:
    pool = pool_create(org=world.org, name="ci", machine_type=fake_type, target_size=1, max_size=8)
    PoolSchedule.objects.create(
        pool=pool, name="morning", cron="0 8 * * *", timezone="Europe/Berlin", target_size=6
    )
    PoolSchedule.objects.create(
        pool=pool, name="evening", cron="0 18 * * *", timezone="Europe/Berlin", target_size=2
    )
    morning = datetime(2026, 11, 23, 7, 30, tzinfo=UTC)  # 08:30 in Berlin
    assert apply_schedules(now=morning) == 1
    pool.refresh_from_db()
    assert pool.target_size == 6
    pool_update(pool=pool, target_size=5)  # a manual change stands until the next firing
    assert apply_schedules(now=morning + timedelta(hours=1)) == 0
    pool.refresh_from_db()
    assert pool.target_size == 5
    assert apply_schedules(now=datetime(2026, 11, 23, 17, 5, tzinfo=UTC)) == 1  # 18:05 Berlin
    pool.refresh_from_db()
    assert pool.target_size == 2


@pytest.mark.django_db
def test_reaper_terminates_stuck_members_and_marks_silent_agents_lost(
    world: World, fake_type: MachineType
) -> None:
    pool = pool_create(
        org=world.org, name="ci", machine_type=fake_type, target_size=2, max_size=4, warmup_grace_seconds=60
    )
    stuck, silent = ready_members(pool, 2)
    long_ago = timezone.now() - timedelta(minutes=10)
    MachineInstance.objects.filter(pk=stuck.pk).update(status=S.WARMING, provisioning_started_at=long_ago)
    MachineInstance.objects.filter(pk=silent.pk).update(last_heartbeat_at=long_ago)
    listened_since(long_ago)
    report = reaper_tick(reconcile=False)
    assert (report.stuck, report.lost) == (1, 1)
    stuck.refresh_from_db()
    silent.refresh_from_db()
    assert (stuck.status, silent.status) == (S.TERMINATING, S.LOST)
    assert Event.objects.filter(kind="pool.member_stuck", instance_id=stuck.pk).exists()
    assert Event.objects.filter(kind="pool.member_lost", instance_id=silent.pk).exists()
    assert MachineInstance.objects.filter(pool=pool, status=S.PENDING).count() == 2  # replacements


@pytest.mark.django_db
def test_reaper_queries_do_not_grow_with_the_number_of_pools(world: World, fake_type: MachineType) -> None:
    def make(n: int, prefix: str) -> None:
        for i in range(n):
            pool = pool_create(
                org=world.org, name=f"{prefix}{i}", machine_type=fake_type, target_size=2, max_size=2
            )
            ready_members(pool, 2)
            InstancePool.objects.filter(pk=pool.pk).update(status="ready")

    make(5, "a")
    reaper_tick(reconcile=False)  # the first tick creates the reaper's heartbeat row
    _, few = query_count(lambda: reaper_tick(reconcile=False))
    make(25, "b")
    _, many = query_count(lambda: reaper_tick(reconcile=False))
    assert few == many


@pytest.mark.django_db
def test_only_one_reaper_runs_at_a_time(world: World) -> None:
    from apps.core.locks import REAPER

    with psycopg.connect(database_url(), autocommit=True) as other:
        other.execute("SELECT pg_advisory_lock(%s)", [REAPER])
        assert reaper_tick(reconcile=False).ran is False
        other.execute("SELECT pg_advisory_unlock(%s)", [REAPER])
    assert reaper_tick(reconcile=False).ran is True


# ---- concurrency: real threads, one connection each -------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_64_threads_race_for_100_members_and_nobody_gets_one_twice(tworld: World) -> None:
    mt, _ = fake_machine_type(tworld.org, account="race", grant=GRANT)
    pool = pool_create(org=tworld.org, name="race", machine_type=mt, target_size=100, max_size=100)
    ready_members(pool, 100)
    attempts_per_thread, threads_n = 16, 64  # 1,024 attempts
    wins: list[Any] = []
    empties: list[int] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    barrier = threading.Barrier(threads_n)

    def claimer() -> None:
        try:
            with connection.cursor() as cursor:
                # A claim that waited on a row lock would fail here instead of hiding it.
                cursor.execute("SET lock_timeout = '2s'")
            barrier.wait()
            for _ in range(attempts_per_thread):
                try:
                    claim = pool_claim(pool_id=pool.pk, acquired_by="race")
                    with lock:
                        wins.append(claim.instance.pk)
                except PoolEmpty:
                    with lock:
                        empties.append(1)
        except BaseException as exc:
            errors.append(exc)

    in_threads(*[claimer] * threads_n, timeout=None)
    assert not errors, errors[:3]
    assert len(wins) == 100
    assert len(set(wins)) == 100  # no instance claimed twice
    assert len(empties) == threads_n * attempts_per_thread - 100
    assert MachineInstance.objects.filter(pool=pool, status=S.CLAIMED).count() == 100
    assert Event.objects.filter(kind="pool.member_claimed", pool_id=pool.pk).count() == 100


@pytest.mark.django_db(transaction=True)
def test_a_member_locked_by_another_transaction_is_skipped_not_waited_for(tworld: World) -> None:
    FakeProvider.reset()
    account = ProviderAccount.objects.create(name="fake", kind="fake", config={"account": "lock"})
    mt = MachineType.objects.create(
        name="f1", provider_account=account, server_type="f", cpus=2, memory_mb=2048
    )
    tworld.org.machine_type_grants.create(machine_type=mt, max_pool_size=10, max_instances=10)
    pool = pool_create(org=tworld.org, name="p", machine_type=mt, target_size=1, max_size=1)
    (member,) = ready_members(pool, 1)
    with psycopg.connect(database_url()) as other:
        other.execute("SELECT id FROM machines_machineinstance WHERE id = %s FOR UPDATE", [member.pk])
        with connection.cursor() as cursor:
            cursor.execute("SET lock_timeout = '1s'")
        with pytest.raises(PoolEmpty):  # not LockNotAvailable: the locked row was skipped
            pool_claim(pool_id=pool.pk)
        other.rollback()
    assert pool_claim(pool_id=pool.pk).instance.pk == member.pk


@pytest.mark.django_db
def test_a_tick_failing_after_the_lost_rule_does_not_switch_the_rule_off(
    world: World, fake_type: MachineType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A later step of the tick raising on every tick (a bug, a cloud down) must not read as
    the control plane not listening: silent agents are still lost."""
    from apps.control import reaper

    pool = pool_create(org=world.org, name="ci", machine_type=fake_type, target_size=1, max_size=1)
    (member,) = ready_members(pool, 1)
    start = timezone.now()
    listened_since(start - timedelta(hours=1))
    MachineInstance.objects.filter(pk=member.pk).update(last_heartbeat_at=start + timedelta(seconds=10))

    def broken(**kwargs: object) -> None:
        raise RuntimeError("a later step fails")

    monkeypatch.setattr(reaper, "pools_converge", broken)
    interval = timedelta(seconds=settings.CATACLOUD_REAPER_INTERVAL)
    for n in range(4):
        with pytest.raises(RuntimeError):
            reaper_tick(reconcile=False, now=start + n * interval)
    member.refresh_from_db()
    assert member.status == S.LOST  # silent 3 intervals (> CATACLOUD_AGENT_LOST_AFTER) while we listened


def listened_since(since: datetime) -> None:
    """The reaper ticked an interval ago and had listened to the agents since ``since``."""
    Heartbeat.objects.update_or_create(
        name=LISTENING,
        defaults={
            "seen_at": timezone.now() - timedelta(seconds=settings.CATACLOUD_REAPER_INTERVAL),
            "detail": {"since": since.isoformat()},
        },
    )


@pytest.mark.django_db
def test_agents_silent_only_while_the_control_plane_was_gone_are_not_lost(
    world: World, fake_type: MachineType
) -> None:
    """PostgreSQL restarted (or every worker and beat were down) for longer than the lost rule:
    no heartbeat could be recorded, so the first tick after must not call the fleet lost."""
    pool = pool_create(org=world.org, name="ci", machine_type=fake_type, target_size=2, max_size=2)
    members = ready_members(pool, 2)
    lost_after = timedelta(seconds=settings.CATACLOUD_AGENT_LOST_AFTER)
    outage_began = timezone.now() - 3 * lost_after
    MachineInstance.objects.filter(pool=pool).update(last_heartbeat_at=outage_began)
    Heartbeat.objects.update_or_create(  # the last tick before the outage
        name=LISTENING, defaults={"seen_at": outage_began, "detail": {"since": "2026-01-01T00:00:00+00:00"}}
    )
    assert reaper_tick(reconcile=False).lost == 0
    assert set(MachineInstance.objects.filter(pool=pool).values_list("status", flat=True)) == {S.READY}
    # one agent heartbeats again, the other stays silent: once we have listened lost_after,
    # the silent one is lost and only it
    now = timezone.now()
    MachineInstance.objects.filter(pk=members[0].pk).update(last_heartbeat_at=now + lost_after)
    later = reaper_tick(reconcile=False, now=now + lost_after + timedelta(seconds=1))
    assert later.lost == 1
    assert MachineInstance.objects.get(pk=members[1].pk).status == S.LOST
    assert MachineInstance.objects.get(pk=members[0].pk).status == S.READY


@pytest.mark.django_db
def test_a_member_deleted_behind_the_pools_back_is_replaced(world: World, fake_type: MachineType) -> None:
    from apps.machines.reconcile import reconcile_account

    pool = pool_create(org=world.org, name="ci", machine_type=fake_type, target_size=2, max_size=3)
    pool_refill(pool_id=pool.pk)
    provision_all()
    gone = MachineInstance.objects.filter(pool=pool).first()
    FakeProvider.vanish(gone.provider_id, account="pools")  # someone deletes it in the cloud console
    report = reconcile_account(account=fake_type.provider_account, grace_seconds=0)
    assert report.lost == [str(gone.pk)]
    gone.refresh_from_db()
    assert gone.status == S.LOST
    assert pool_refill(pool_id=pool.pk) == 1  # the pool heals itself
    assert Event.objects.filter(kind="pool.member_lost", instance_id=gone.pk).exists()


class SentTasks:
    """Stands in for the Celery app where services send tasks by name: hands each refill's
    pool id to ``send`` (which may raise like a broker that is down)."""

    def __init__(self, name: str, send: Callable[[str], object]) -> None:
        self.name, self.send = name, send

    def send_task(self, name: str, args: tuple[str, ...], **_: Any) -> None:
        assert name == self.name
        self.send(args[0])


@pytest.mark.django_db(transaction=True)
def test_claims_signal_the_refill_in_their_own_statement_and_a_listener_enqueues_it(
    tworld: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not at the next reaper tick, and no broker call on the claim path: a pool created or
    claimed from is marked (with a NOTIFY) in the same round trip; the listener enqueues one
    refill per mark, and a burst of claims before the refill starts costs one mark."""
    from apps.core import broker
    from apps.pools.refill import REFILL_TASK, listen

    FakeProvider.reset()
    account = ProviderAccount.objects.create(name="fake", kind="fake", config={"account": "refill"})
    fake_type = MachineType.objects.create(
        name="f1", provider_account=account, server_type="f", cpus=1, memory_mb=1024
    )
    OrgMachineType.objects.create(org=tworld.org, machine_type=fake_type, max_pool_size=10, max_instances=10)
    enqueued: list[str] = []
    monkeypatch.setattr(broker, "current_app", SentTasks(REFILL_TASK, enqueued.append))

    def start_listener() -> tuple[threading.Event, threading.Thread]:
        stop = threading.Event()
        thread = threading.Thread(target=listen, args=(stop,), kwargs={"sweep_seconds": 0.3}, daemon=True)
        thread.start()
        time.sleep(0.5)  # connected, LISTEN in place
        return stop, thread

    stop, listener = start_listener()
    try:
        pool = pool_create(org=tworld.org, name="now", machine_type=fake_type, target_size=2, max_size=3)
        wait_for(lambda: enqueued == [str(pool.pk)], 10, "the creation's refill enqueued")
    finally:
        stop.set()
        listener.join(timeout=5)
    members = ready_members(pool, 3)
    for _ in range(2):  # a burst of claims while nobody takes the mark: one mark
        pool_claim(pool_id=pool.pk)
    assert InstancePool.objects.get(pk=pool.pk).refill_requested_at is not None
    assert Event.objects.filter(kind="pool.member_claimed", pool_id=pool.pk).count() == 2
    stop, listener = start_listener()  # a listener that starts later sweeps marks nobody heard
    try:
        wait_for(lambda: len(enqueued) == 2, 10, "the burst's single refill enqueued")
        time.sleep(0.7)
        assert enqueued == [str(pool.pk)] * 2  # taken once
        pool_refill(pool_id=pool.pk)  # a refill clears the mark before it reads the pool
        assert InstancePool.objects.get(pk=pool.pk).refill_requested_at is None
        pool_claim(pool_id=members[0].pool_id)  # marks again and notifies
        wait_for(lambda: len(enqueued) == 3, 10, "a claim after the refill started enqueues a new one")
    finally:
        stop.set()
        listener.join(timeout=5)


@pytest.mark.django_db
def test_a_claim_records_its_event_as_the_event_model_reads_it(world: World, fake_type: MachineType) -> None:
    pool = pool_create(org=world.org, name="ci", machine_type=fake_type, target_size=1, max_size=2)
    (member,) = ready_members(pool, 1)
    claim = pool_claim(pool_id=pool.pk, acquired_by="ci", acquired_for="build 7", actor="user:ci")
    event = Event.objects.get(kind="pool.member_claimed", instance_id=member.pk)
    assert (event.org_id, event.pool_id, event.actor) == (world.org.pk, pool.pk, "user:ci")
    assert event.data == {"claim_id": str(claim.claim_id), "acquired_by": "ci", "acquired_for": "build 7"}


@pytest.mark.django_db(transaction=True)
def test_a_claim_answers_the_times_the_database_holds(tworld: World) -> None:
    """The claim's own cursor loads times with psycopg's loader, not Django's: the instance it
    answers must carry the same aware datetimes the ORM reads (in and out of a transaction)."""
    mt = fake_machine_type(tworld.org, account="times", grant=GRANT)[0]
    pool = pool_create(org=tworld.org, name="times", machine_type=mt, target_size=0, max_size=2)
    ready_members(pool, 2)
    with transaction.atomic():
        in_placement = pool_claim(pool_id=pool.pk).instance
    acquired = pool_claim(pool_id=pool.pk).instance
    for answered in (in_placement, acquired):
        stored = MachineInstance.objects.get(pk=answered.pk)
        for name in ("created_at", "ready_at", "claimed_at", "status_changed_at"):
            value = getattr(answered, name)
            assert value == getattr(stored, name), name
            assert value.utcoffset() == timedelta(0), name


@pytest.mark.django_db(transaction=True)
def test_a_refill_the_broker_refused_is_sent_once_it_answers_again(
    tworld: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis down while a pool is emptied: the listener took the claims' mark, the enqueue
    failed, and the mark was gone: with the listener alive the pool stayed short (issue 26).
    Now the mark is put back and a later sweep sends the refill once Redis answers."""
    from kombu.exceptions import OperationalError

    from apps.core import broker
    from apps.pools.refill import REFILL_TASK, listen

    FakeProvider.reset()
    account = ProviderAccount.objects.create(name="fake", kind="fake", config={"account": "outage"})
    mt = MachineType.objects.create(
        name="f1", provider_account=account, server_type="f", cpus=1, memory_mb=1024
    )
    OrgMachineType.objects.create(org=tworld.org, machine_type=mt, max_pool_size=10, max_instances=10)
    pool = pool_create(org=tworld.org, name="outage", machine_type=mt, target_size=2, max_size=4)
    InstancePool.objects.filter(pk=pool.pk).update(refill_requested_at=None)
    members = ready_members(pool, 2)
    redis_up = threading.Event()
    enqueued: list[str] = []

    def send(pool_id: str) -> None:
        if not redis_up.is_set():
            raise OperationalError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")
        enqueued.append(pool_id)

    monkeypatch.setattr(broker, "current_app", SentTasks(REFILL_TASK, send))
    monkeypatch.setattr(broker, "BROKER_BACKOFF_SECONDS", 0.5)
    monkeypatch.setattr(broker, "_down_until", 0.0)
    stop = threading.Event()
    listener = threading.Thread(target=listen, args=(stop,), kwargs={"sweep_seconds": 0.3}, daemon=True)
    listener.start()
    try:
        time.sleep(0.5)  # listening
        for _ in members:  # the pool is emptied while Redis is down
            pool_claim(pool_id=pool.pk)
        time.sleep(1.5)  # the listener heard the claims and failed to send the refill
        assert enqueued == []
        redis_up.set()  # Redis is back; no claim, no reaper tick
        wait_for(lambda: enqueued == [str(pool.pk)], 10, "the refill sent once Redis answers")
        assert InstancePool.objects.get(pk=pool.pk).refill_requested_at is None  # taken once
    finally:
        stop.set()
        listener.join(timeout=5)


@pytest.mark.django_db
def test_the_reaper_refills_a_short_pool_whatever_its_refill_mark_says(
    world: World, fake_type: MachineType
) -> None:
    """Level-triggered: a pool below target is refilled at the reaper's next tick whether a
    refill is marked as pending (a listener holds it) or not (the mark was lost)."""
    short = pool_create(org=world.org, name="marked", machine_type=fake_type, target_size=2, max_size=3)
    lost = pool_create(org=world.org, name="unmarked", machine_type=fake_type, target_size=2, max_size=3)
    MachineInstance.objects.filter(pool__in=[short, lost]).delete()  # the members are gone
    InstancePool.objects.filter(pk=short.pk).update(refill_requested_at=timezone.now())
    InstancePool.objects.filter(pk=lost.pk).update(refill_requested_at=None)
    report = reaper_tick(reconcile=False)
    assert report.requested == 4
    for pool in (short, lost):
        assert MachineInstance.objects.filter(pool=pool, status=S.PENDING).count() == 2


@pytest.mark.django_db(transaction=True)
def test_a_refill_in_flight_when_the_pool_is_drained_leaves_it_no_member(
    tworld: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A resize asks for two more members; the pool is drained while that refill runs. Every
    member the refill asked for is drained with the others (none is left running, nobody's,
    after the pool is deleted), and no member is requested after ``pool.drained``."""
    from apps.pools import services
    from apps.pools.services import pool_delete

    mt, _ = fake_machine_type(tworld.org, account="drain-race", grant=GRANT)
    pool = pool_create(org=tworld.org, name="race", machine_type=mt, target_size=1, max_size=3)
    ready_members(pool, 1)
    pool_update(pool=pool, target_size=3, actor="test")  # the resize: a refill for two more
    refill_read_pool, drain_done = threading.Event(), threading.Event()
    plan = services.refill_plan

    def refill_plan_then_wait(**kwargs: Any) -> Any:
        refill_read_pool.set()  # the refill found the pool active ...
        drain_done.wait(2.0)  # ... and the drain runs now (it may not get past the refill)
        return plan(**kwargs)

    monkeypatch.setattr(services, "refill_plan", refill_plan_then_wait)
    errors: list[BaseException] = []
    requested: list[int] = []

    def refill() -> None:
        try:
            requested.append(pool_refill(pool_id=pool.pk))
        except BaseException as exc:
            errors.append(exc)

    def drain() -> None:
        try:
            refill_read_pool.wait(5.0)
            pool_drain(pool=pool, terminate_members=True, actor="test")
            drain_done.set()
        except BaseException as exc:
            errors.append(exc)

    in_threads(refill, drain)
    assert not errors, errors
    pool_delete(pool=pool, actor="test")
    requested_ids = set(
        Event.objects.filter(kind="pool.member_requested", pool_id=pool.pk).values_list(
            "instance_id", flat=True
        )
    )
    assert len(requested_ids) == requested[0] == 2  # the refill did ask for two
    live = MachineInstance.objects.filter(pk__in=requested_ids).exclude(
        status__in=[S.TERMINATING, S.TERMINATED]
    )
    assert list(live.values_list("status", "pool_id")) == []  # none left running outside the pool
    drained = Event.objects.get(kind="pool.drained", pool_id=pool.pk)
    assert not Event.objects.filter(kind="pool.member_requested", pool_id=pool.pk, id__gt=drained.id).exists()
