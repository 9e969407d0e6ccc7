"""Money budgets: no machine is bought past an org's budget; machines already paid keep
running jobs; raising the budget lets the next job run. Services are called directly; the
fake provider stands in for the cloud."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from apps.billing.budgets import budget_set
from apps.events.models import Event
from apps.jobs.choices import JobStatus
from apps.jobs.models import Job
from apps.jobs.reports import job_finished, job_started
from apps.jobs.scheduler import schedule
from apps.jobs.submission import job_submit
from apps.machines.budgets import budget_check, budget_spend
from apps.machines.choices import InstanceStatus
from apps.machines.models import MachineInstance
from apps.pools.models import InstancePool
from apps.pools.services import pool_create, pool_refill
from testkit.builders import instance_row, job_config
from tests.concurrency import in_threads
from tests.conftest import World
from tests.jobs.common import refresh, setup_type

J = JobStatus
S = InstanceStatus


def boot(instance_ids) -> None:
    """The fake cloud boots every requested machine (billing starts) and its agent is ready."""
    now = timezone.now()
    MachineInstance.objects.filter(pk__in=instance_ids, status=S.PENDING).update(
        status=S.READY, provisioning_started_at=now, ready_at=now, last_heartbeat_at=now, provider_id="f"
    )


def run(job: Job) -> MachineInstance:
    refresh(job)
    assert job.status == J.WAITING_FOR_MACHINE or job.status == J.ASSIGNED
    if job.status == J.WAITING_FOR_MACHINE:
        boot(MachineInstance.objects.filter(status=S.PENDING).values_list("pk", flat=True))
        schedule()
        refresh(job)
    assert job.status == J.ASSIGNED, job.pending_reason
    machine = MachineInstance.objects.get(pk=job.instance_id)
    job_started(instance=machine, job_id=job.pk)
    return machine


@pytest.mark.django_db
def test_budget_stops_buying_paid_machines_still_run_and_raising_it_lets_the_job_run(world: World) -> None:
    # Given an org with a 1.00 USD monthly budget on machines billed 0.50 per started hour
    mt, _ = setup_type(world)
    cfg = job_config(world.org, mt)
    budget = budget_set(org=world.org, amount="1.00", period="month")
    # When two jobs run at once, each on a new machine (0.50 committed each)
    first = job_submit(org=world.org, config=cfg)
    schedule()
    a = run(first)
    second = job_submit(org=world.org, config=cfg)
    schedule()
    b = run(second)
    assert a.pk != b.pk
    assert budget_spend(budget, now=timezone.now()) == Decimal("1.00")
    # Then a third job would pass the budget: it stays queued with the budget's sentence
    third = job_submit(org=world.org, config=cfg)
    schedule()
    refresh(third)
    assert third.status == J.QUEUED
    assert third.pending_reason == "budget 1.00/1.00 USD this month"
    assert MachineInstance.objects.count() == 2  # nothing bought
    exhausted = Event.objects.filter(kind="budget.exhausted", org_id=world.org.pk)
    assert exhausted.count() == 1 and exhausted.get().data["percent"] == 100
    assert Event.objects.filter(kind="budget.warning").count() == 0  # 80 % was passed in one step
    schedule()
    assert exhausted.count() == 1  # announced once per period
    # And a machine already paid for still takes it: the first job ends, its machine is reused
    job_finished(instance=a, job_id=first.pk, outcome="succeeded", exit_code=0)
    schedule()
    refresh(third)
    assert (third.status, third.instance_id) == (J.ASSIGNED, a.pk)
    # A fourth job finds no paid machine free: it waits on the budget
    fourth = job_submit(org=world.org, config=cfg)
    schedule()
    refresh(fourth)
    assert (fourth.status, fourth.pending_reason) == (J.QUEUED, "budget 1.00/1.00 USD this month")
    # When the budget is raised, the next tick buys its machine
    budget_set(org=world.org, amount="1.50", period="month")
    schedule()
    refresh(fourth)
    assert fourth.status == J.WAITING_FOR_MACHINE
    run(fourth)
    # Final spend never passed the budget in force
    assert budget_spend(budget, now=timezone.now()) == Decimal("1.50")


@pytest.mark.django_db
def test_placement_buys_only_what_the_budget_allows_and_says_why(world: World) -> None:
    mt, _ = setup_type(world)
    cfg = job_config(world.org, mt)
    budget_set(org=world.org, amount="1.20", machine_type=mt, period="day")
    jobs = [job_submit(org=world.org, config=cfg) for _ in range(4)]
    report = schedule()
    # 1.20 buys two first hours (0.50 each); admission lets in only what can get a machine
    assert (report.admitted, report.provisioned) == (2, 2)
    refresh(*jobs)
    queued = [j for j in jobs if j.status == J.QUEUED]
    assert len(queued) == 2
    assert {j.pending_reason for j in queued} == {"budget 1.00/1.20 USD today for big"}
    assert Event.objects.filter(kind="budget.warning").count() == 1  # 1.00 >= 80 % of 1.20
    assert budget_check(org_id=world.org.pk, machine_type=mt, now=timezone.now()).allowed == 0


@pytest.mark.django_db
def test_pool_refill_stops_at_the_budget_and_shows_it_in_limit_reason(world: World) -> None:
    mt, _ = setup_type(world)
    budget_set(org=world.org, amount="1.00")
    pool = pool_create(org=world.org, name="warm", machine_type=mt, target_size=3, max_size=3)
    assert pool_refill(pool_id=pool.pk) == 2
    pool.refresh_from_db()
    assert pool.limit_reason == "budget_exceeded: budget 1.00/1.00 USD this month"
    assert Event.objects.filter(kind="pool.budget_exceeded", pool_id=pool.pk).count() == 1
    assert pool_refill(pool_id=pool.pk) == 0
    budget_set(org=world.org, amount="2.00")
    assert pool_refill(pool_id=pool.pk) == 1
    assert InstancePool.objects.get(pk=pool.pk).limit_reason == ""


@pytest.mark.django_db
def test_spend_counts_ended_machines_of_this_period_and_live_ones_to_their_paid_period(world: World) -> None:
    mt, _ = setup_type(world)  # 0.50 per started hour
    budget = budget_set(org=world.org, amount="100")
    now = timezone.now()
    instance_row(
        world.org, mt, status=S.TERMINATED, provisioning_started_at=now, ended_at=now, cost=Decimal("1.5")
    )
    # ended last month: not this month's spend
    instance_row(
        world.org,
        mt,
        status=S.TERMINATED,
        provisioning_started_at=now - timedelta(days=40),
        ended_at=now - timedelta(days=40),
        cost=Decimal("7"),
    )
    # live for 61 minutes: two started hours committed
    instance_row(world.org, mt, status=S.CLAIMED, provisioning_started_at=now - timedelta(minutes=61))
    instance_row(world.org, mt, status=S.PENDING)  # requested: its first hour
    assert budget_spend(budget, now=now) == Decimal("1.5") + Decimal("1.00") + Decimal("0.50")


@pytest.mark.django_db
def test_bad_budget_amounts_are_refused(world: World) -> None:
    from apps.core.errors import ValidationFailed

    for amount in ("-1", "lots", "NaN"):
        with pytest.raises(ValidationFailed):
            budget_set(org=world.org, amount=amount)
    with pytest.raises(ValidationFailed):
        budget_set(org=world.org, amount="5", period="week")


@pytest.mark.django_db(transaction=True)
def test_refills_of_two_machine_types_at_once_never_both_spend_an_org_budgets_last_cents(
    tworld: World,
) -> None:
    # Given an org-wide budget of 1.00 and two machine types at 0.50 per started hour, each with
    # a pool that wants 3 members: different grant locks, one budget (its row lock is what
    # serialises them: without it both refills buy two)
    import threading
    import time

    from django.db import transaction

    from apps.machines.models import MachineType, OrgMachineType

    mt, _ = setup_type(tworld)
    other = MachineType.objects.create(
        name="big2",
        provider_account=mt.provider_account,
        server_type="f2",
        cpus=4,
        memory_mb=1024,
        price_per_hour=Decimal("0.50"),
    )
    OrgMachineType.objects.create(org=tworld.org, machine_type=other, max_pool_size=10, max_instances=10)
    budget_set(org=tworld.org, amount="1.00")
    pools = [  # created as rows: no refill runs before the race
        InstancePool.objects.create(org=tworld.org, name=f"p{i}", machine_type=m, target_size=3, max_size=3)
        for i, m in enumerate((mt, other))
    ]
    bought = threading.Event()

    def first() -> None:  # buys two members and holds its transaction open a moment
        try:
            with transaction.atomic():
                pool_refill(pool_id=pools[0].pk)
                bought.set()
                time.sleep(0.5)
        finally:
            bought.set()

    def second() -> None:  # refills the other machine type's pool meanwhile
        bought.wait()
        pool_refill(pool_id=pools[1].pk)

    # When the second refill runs while the first has bought but not committed
    in_threads(first, second, timeout=None)
    # Then exactly two machines were bought in all: the budget's 1.00, never more
    assert MachineInstance.objects.filter(org=tworld.org).count() == 2
    reasons = set(
        InstancePool.objects.filter(pk__in=[p.pk for p in pools]).values_list("limit_reason", flat=True)
    )
    assert reasons == {"budget_exceeded: budget 1.00/1.00 USD this month"}
