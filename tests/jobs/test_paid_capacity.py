"""Paid capacity first: placement takes what the org already pays for (an idle machine, then a
pool member) and buys only when none can serve, even when another transaction holds a ready
machine's row at that instant. Services are called directly; the fake provider is the cloud."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from decimal import Decimal
from functools import partial
from typing import Any

import pytest
from django.db import connection, transaction
from django.test import override_settings
from django.utils import timezone

from apps.billing.budgets import budget_set
from apps.jobs.choices import JobStatus
from apps.jobs.models import Job
from apps.jobs.reports import job_finished, job_started
from apps.jobs.scheduler import schedule
from apps.jobs.submission import job_submit
from apps.machines import claims
from apps.machines.agents import instance_heartbeat
from apps.machines.choices import InstanceStatus
from apps.machines.lifecycle import instance_provision
from apps.machines.models import MachineInstance, MachineType, OrgMachineType
from apps.machines.retention import idle_machines_retire
from testkit.builders import fake_machine_type, idle_machine, job_config, job_row
from testkit.held import Held
from tests.conftest import World

J = JobStatus
S = InstanceStatus


def hourly_type(world: World, **grant: Any) -> tuple[MachineType, OrgMachineType]:
    return fake_machine_type(
        world.org,
        account="paid",
        name="hourly",
        price_per_hour=Decimal("0.50"),
        billing_increment_seconds=3600,
        grant={"max_concurrent_jobs": 100, "max_instances": 100, "max_pool_size": 10, **grant},
    )


def boot(instance_id: Any) -> MachineInstance:
    """What the provision task and the agent's first heartbeat do: pending -> ready."""
    instance_provision(instance_id=instance_id)
    machine = MachineInstance.objects.get(pk=instance_id)
    assert instance_heartbeat(instance=machine)
    return MachineInstance.objects.get(pk=instance_id)


def claim_idle_for(job: Job, mt: MachineType) -> None:
    """The scheduler's claim of an idle machine of ``mt`` for ``job``, as placement makes it."""
    claims.claim(
        claims.IDLE_SQL,
        by="scheduler",
        for_=f"job:{job.pk}",
        job_id=job.pk,
        org=str(job.org_id),
        mt=str(mt.pk),
        version=mt.version,
        config=str(job.config_id),
        image=None,
    )


def heartbeat_of(instance_id: Any) -> Held:
    """Another transaction holding one machine's row (an agent's heartbeat, the provider-state
    refresh, the transaction that just made it ready) until the block ends."""
    return Held(
        lambda: MachineInstance.objects.filter(pk=instance_id).update(last_heartbeat_at=timezone.now())
    )


@pytest.mark.django_db(transaction=True)
@override_settings(CATACLOUD_SCHEDULE_ON_SUBMIT=False)  # the scheduling passes alone, as a worker runs them
def test_five_ephemeral_jobs_released_at_once_buy_exactly_five_machines(tworld: World) -> None:
    # Given five ephemeral jobs held back by a spent budget
    mt, _ = hourly_type(tworld)
    budget = budget_set(org=tworld.org, amount="0")
    cfg = job_config(tworld.org, mt, "once", reuse="ephemeral")
    jobs = [job_submit(org=tworld.org, config=cfg) for _ in range(5)]
    assert schedule().admitted == 0
    # When the budget is raised, one scheduling pass admits them and buys one machine each
    budget_set(org=tworld.org, amount="100")
    report = schedule()
    assert (report.admitted, report.provisioned) == (5, 5)
    machines = list(MachineInstance.objects.order_by("created_at").values_list("pk", flat=True))
    # And three of them boot; the third is ready but its row is held by another transaction
    # (its agent's heartbeat) at the instant the next scheduling pass runs
    for pk in machines[:3]:
        boot(pk)
    with heartbeat_of(machines[2]):
        report = schedule()
        # Then the pass places two jobs and buys nothing: the held machine is paid and ready
        assert report.assigned == 2
        assert report.provisioned == 0
        assert MachineInstance.objects.count() == 5
    for pk in machines[3:]:
        boot(pk)
    schedule()
    # Then every job has a machine of its own and exactly five machines were bought
    assert Job.objects.filter(pk__in=[j.pk for j in jobs], status=J.ASSIGNED).count() == 5
    assert MachineInstance.objects.count() == 5
    assert len(set(Job.objects.values_list("instance_id", flat=True))) == 5
    assert budget.pk is not None


@pytest.mark.django_db
def test_an_idle_machine_is_used_before_a_pool_member_and_sequential_jobs_buy_nothing_more(
    world: World,
) -> None:
    from apps.pools.services import pool_create, pool_refill

    # Given a warm pool of 2 in front of a reusable configuration
    mt, _ = hourly_type(world, policy="cost")
    pool = pool_create(org=world.org, name="warm", machine_type=mt, target_size=2, max_size=2)
    pool_refill(pool_id=pool.pk)
    for pk in MachineInstance.objects.filter(pool=pool).values_list("pk", flat=True):
        boot(pk)
    cfg = job_config(world.org, mt, "unit", reuse="reuse")
    used = []
    # When twelve jobs run one after another (each submitted when the last finished)
    for _ in range(12):
        job = job_submit(org=world.org, config=cfg)
        schedule()
        job.refresh_from_db()
        assert job.status == J.ASSIGNED
        machine = MachineInstance.objects.get(pk=job.instance_id)
        used.append(machine.pk)
        pool_refill(pool_id=pool.pk)  # the refill a claim asks for, while the job runs
        for pk in MachineInstance.objects.filter(status=S.PENDING).values_list("pk", flat=True):
            boot(pk)
        job_started(instance=machine, job_id=job.pk)
        job_finished(instance=machine, job_id=job.pk, outcome="succeeded", exit_code=0, uploads_pending=0)
    # Then the first job took a pool member (nothing else was paid), every later one the
    # machine it left, and only that member's replacement was bought
    assert len(set(used)) == 1
    assert MachineInstance.objects.count() == 3
    assert MachineInstance.objects.filter(pool=pool, status=S.READY).count() == 2


@pytest.mark.django_db(transaction=True)
def test_retirement_never_takes_a_machine_a_job_claimed_meanwhile(tworld: World) -> None:
    # Given an idle machine at the end of its paid hour, and a job placed on it by a
    # transaction that has not committed yet when the reaper retires idle machines
    mt, _ = hourly_type(tworld)
    machine = idle_machine(tworld.org, mt, provisioning_started_at=timezone.now() - timedelta(minutes=59))
    cfg = job_config(tworld.org, mt, "late")
    job = job_row(cfg, status=J.WAITING_FOR_MACHINE)
    claimed = threading.Event()

    def place_the_job() -> None:
        try:
            with transaction.atomic():
                claim_idle_for(job, mt)
                claimed.set()
                time.sleep(1.0)  # the reaper reads the machine as idle and waits for its row
        finally:
            connection.close()

    placer = threading.Thread(target=place_the_job)
    placer.start()
    assert claimed.wait(10)
    # When the reaper retires idle machines at that moment
    retired = idle_machines_retire(now=timezone.now())
    placer.join(10)
    # Then the machine stays with the job that claimed it
    machine.refresh_from_db()
    assert (retired, machine.status, machine.claimed_for) == (0, S.CLAIMED, f"job:{job.pk}")


@pytest.mark.django_db
def test_with_a_pool_in_front_idle_machines_retire_before_renewing_and_members_stay(world: World) -> None:
    from apps.pools.services import pool_create

    # Given a pool of one (its member is the expected demand) and a used machine kept for reuse
    mt, _ = hourly_type(world)
    pool = pool_create(org=world.org, name="warm", machine_type=mt, target_size=1)
    hour_ago = timezone.now() - timedelta(minutes=59)
    member = idle_machine(world.org, mt, pool=pool, provisioning_started_at=hour_ago)
    used = idle_machine(world.org, mt, provisioning_started_at=hour_ago)
    # When the reaper runs just before their second hour would start
    assert idle_machines_retire(now=timezone.now()) == 1
    # Then the idle machine beyond the pool's target is gone before it renews; the member stays
    member.refresh_from_db()
    used.refresh_from_db()
    assert (used.status, member.status) == (S.TERMINATING, S.READY)


@pytest.mark.django_db(transaction=True)
def test_the_next_job_on_a_reused_machine_is_charged_its_time_not_idle(tworld: World) -> None:
    from apps.machines.costs import machine_costs

    # Given a machine running job A, and a scheduling pass whose transaction began before A
    # ended (it waited for the grant's lock) and then gives the machine to job B
    mt, _ = hourly_type(tworld)
    machine = idle_machine(tworld.org, mt)
    cfg = job_config(tworld.org, mt, "unit", reuse="reuse")
    first = job_submit(org=tworld.org, config=cfg)
    schedule()
    job_started(instance=machine, job_id=first.pk)
    second = job_row(cfg, status=J.WAITING_FOR_MACHINE)
    began, released = threading.Event(), threading.Event()

    def place_second() -> None:
        try:
            with transaction.atomic():
                Job.objects.filter(pk=second.pk).exists()  # the transaction has begun
                began.set()
                assert released.wait(10)
                claim_idle_for(second, mt)
        finally:
            connection.close()

    placer = threading.Thread(target=place_second)
    placer.start()
    assert began.wait(10)
    time.sleep(0.2)
    job_finished(instance=machine, job_id=first.pk, outcome="succeeded", exit_code=0, uploads_pending=0)
    released.set()
    placer.join(10)
    time.sleep(0.5)  # job B holds the machine
    # Then the cost report charges B's time to B, not to idle
    machine.refresh_from_db()
    assert machine.claimed_for == f"job:{second.pk}"
    (cost,) = machine_costs([machine], now=timezone.now())
    held = {p.ref: p.seconds for p in cost.attribution.parts if p.kind == "job"}
    assert held.get(str(second.pk), 0) >= 0.5


@pytest.mark.django_db(transaction=True)
@override_settings(CATACLOUD_SCHEDULE_ON_SUBMIT=False)
def test_a_pool_refilled_while_a_job_releases_its_machine_takes_that_machine_instead_of_buying(
    tworld: World,
) -> None:
    from apps.events.models import Event
    from apps.pools.models import InstancePool
    from apps.pools.services import pool_create, pool_refill
    from testkit.purchases import needless_purchases, story

    # Given a pool one member short (target 2, one ready member) and a machine outside it
    # running a reusable job
    mt, _ = hourly_type(tworld)
    pool = pool_create(org=tworld.org, name="warm", machine_type=mt, target_size=1, max_size=2)
    pool_refill(pool_id=pool.pk)
    (member,) = MachineInstance.objects.filter(pool=pool).values_list("pk", flat=True)
    boot(member)
    outside = idle_machine(tworld.org, mt)
    cfg = job_config(tworld.org, mt, "unit", reuse="reuse")
    job = job_submit(org=tworld.org, config=cfg)
    schedule()
    job.refresh_from_db()
    assert job.instance_id == outside.pk  # an idle machine outside the pool goes first
    job_started(instance=outside, job_id=job.pk)
    InstancePool.objects.filter(pk=pool.pk).update(target_size=2)
    # And the job's end (its machine kept for reuse) being committed by another transaction
    end = partial(
        job_finished, instance=outside, job_id=job.pk, outcome="succeeded", exit_code=0, uploads_pending=0
    )
    with Held(end) as report:
        # When the pool refills at that instant (the job's end commits half a second later)
        threading.Timer(0.5, report.release.set).start()
        bought = pool_refill(pool_id=pool.pk)
    # Then the refill takes the released machine in instead of buying one more
    events = list(Event.objects.filter(org=tworld.org).order_by("id"))
    found = needless_purchases(events)
    assert found == [], story(events, found)
    assert bought == 0
    assert MachineInstance.objects.count() == 2
    assert set(MachineInstance.objects.filter(pool=pool, status=S.READY).values_list("pk", flat=True)) == {
        member,
        outside.pk,
    }


@pytest.mark.django_db(transaction=True)
@override_settings(CATACLOUD_SCHEDULE_ON_SUBMIT=False)
def test_a_job_placed_while_another_job_releases_its_machine_gets_that_machine_instead_of_a_new_one(
    tworld: World,
) -> None:
    from apps.events.models import Event
    from testkit.purchases import needless_purchases, story

    # Given the speed policy (a waiting job is bought a machine at once), one machine running a
    # reusable job, and a second job of the same configuration
    mt, _ = hourly_type(tworld, policy="speed")
    machine = idle_machine(tworld.org, mt)
    cfg = job_config(tworld.org, mt, "unit", reuse="reuse")
    first = job_submit(org=tworld.org, config=cfg)
    schedule()
    job_started(instance=machine, job_id=first.pk)
    second = job_submit(org=tworld.org, config=cfg)
    # When the scheduling pass runs while the first job's end (its machine kept) is being committed
    end = partial(
        job_finished, instance=machine, job_id=first.pk, outcome="succeeded", exit_code=0, uploads_pending=0
    )
    with Held(end) as report:
        threading.Timer(0.5, report.release.set).start()
        assert schedule().provisioned == 0
    schedule()  # the pass the release asks for after its commit
    # Then the second job runs on the machine the first left, and nothing was bought
    second.refresh_from_db()
    assert (second.status, second.instance_id) == (J.ASSIGNED, machine.pk)
    assert MachineInstance.objects.count() == 1
    events = list(Event.objects.filter(org=tworld.org).order_by("id"))
    found = needless_purchases(events)
    assert found == [], story(events, found)
