"""Placement: paid machines first (an idle machine, then a warm pool member), a purchase only
within max_instances and the policy.
Services are called directly; the fake provider stands in for the cloud."""

from __future__ import annotations

import time
from datetime import timedelta
from decimal import Decimal

import pytest
from django.db import transaction
from django.test import override_settings
from django.utils import timezone

from apps.jobs.admission import admit
from apps.jobs.choices import JobStatus
from apps.jobs.models import Job
from apps.jobs.placement import place
from apps.jobs.scheduler import schedule
from apps.jobs.submission import job_submit
from apps.machines.choices import InstanceStatus
from apps.machines.models import MachineInstance
from apps.pools.services import pool_create
from testkit.builders import idle_machine, job_config, job_row
from testkit.held import Held
from tests.conftest import World
from tests.jobs.common import refresh, setup_type

J = JobStatus
S = InstanceStatus


@pytest.mark.django_db
def test_placement_takes_an_idle_machine_before_a_warm_pool_member(world: World) -> None:
    mt, _ = setup_type(world)
    pool = pool_create(org=world.org, name="warm", machine_type=mt, target_size=1, max_size=2)
    member = idle_machine(world.org, mt, pool=pool)
    spare = idle_machine(world.org, mt)  # paid and idle: it goes first, the pool stays warm
    first, second = (job_submit(org=world.org, config=job_config(world.org, mt, name)) for name in "ab")
    report = schedule()
    assert (report.admitted, report.assigned, report.provisioned) == (2, 2, 0)
    refresh(first, second, member, spare)
    assert (first.status, first.instance_id) == (J.ASSIGNED, spare.pk)
    assert (second.status, second.instance_id) == (J.ASSIGNED, member.pk)  # then the pool
    assert member.status == S.CLAIMED and member.claimed_for == f"job:{second.pk}"


@pytest.mark.django_db
def test_placement_reuses_the_idle_machine_that_ran_the_same_config(world: World) -> None:
    mt, _ = setup_type(world)
    cfg, other = job_config(world.org, mt, "a"), job_config(world.org, mt, "b")
    older = idle_machine(world.org, mt, last_config=other)
    warm_cache = idle_machine(world.org, mt, last_config=cfg)
    MachineInstance.objects.filter(pk=older.pk).update(ready_at=timezone.now() - timedelta(minutes=5))
    job = job_submit(org=world.org, config=cfg)
    schedule()
    refresh(job)
    assert job.instance_id == warm_cache.pk


@pytest.mark.django_db
def test_placement_provisions_within_max_instances_then_waits(world: World) -> None:
    mt, _ = setup_type(world, max_instances=2)
    cfg = job_config(world.org, mt)
    jobs = [job_submit(org=world.org, config=cfg) for _ in range(3)]
    report = schedule()
    assert (report.admitted, report.provisioned, report.waiting) == (3, 2, 3)
    assert MachineInstance.objects.filter(pool__isnull=True, status=S.PENDING).count() == 2
    refresh(*jobs)
    assert {j.pending_reason for j in jobs} == {"2 provisioning"}
    assert schedule().provisioned == 0  # two are coming: no more machines for the same jobs
    MachineInstance.objects.update(status=S.CLAIMED)  # both busy, quota full
    schedule()
    refresh(jobs[2])
    assert jobs[2].pending_reason == "max_instances 2/2"


@pytest.mark.django_db
def test_cost_policy_waits_for_a_paid_machine_then_buys_after_max_wait(world: World) -> None:
    mt, grant = setup_type(world, policy="cost", max_wait_seconds=300)
    cfg = job_config(world.org, mt)
    # History: this configuration usually runs for 2 minutes.
    t0 = timezone.now() - timedelta(hours=1)
    for _ in range(3):
        job_row(
            cfg,
            status=J.SUCCEEDED,
            started_at=t0,
            finished_at=t0 + timedelta(minutes=2),
        )
    busy = idle_machine(world.org, mt)
    running = job_row(
        cfg,
        status=J.RUNNING,
        instance=busy,
        started_at=timezone.now(),
        admitted_at=timezone.now(),
    )
    MachineInstance.objects.filter(pk=busy.pk).update(status=S.CLAIMED, claimed_for=f"job:{running.pk}")
    job = job_submit(org=world.org, config=cfg)
    report = schedule()
    assert report.provisioned == 0  # the busy machine is expected free in ~2 minutes
    refresh(job)
    assert "paid machines" in job.pending_reason
    Job.objects.filter(pk=job.pk).update(admitted_at=timezone.now() - timedelta(seconds=301))
    assert schedule().provisioned == 1  # waited max_wait_seconds: buy one
    # The speed policy would have bought at once.
    grant.policy = "speed"
    grant.save()
    assert running.status == J.RUNNING


@pytest.mark.django_db
def test_place_alone_is_idempotent_for_waiting_jobs(world: World) -> None:
    mt, _ = setup_type(world, max_instances=1)
    job_submit(org=world.org, config=job_config(world.org, mt))
    admit()
    assert place() == (0, 1, 1)
    assert place() == (0, 0, 1)


# ---- the submit's own scheduling (no worker runs in these tests) -------------------------------


@pytest.mark.django_db(transaction=True)
@override_settings(CATACLOUD_SCHEDULE_ON_SUBMIT=False)
def test_a_placement_of_two_types_beside_a_pool_refill_under_one_budget_never_deadlocks(
    tworld: World,
) -> None:
    """Placement gave the waiting jobs of several machine types machines in one transaction,
    locking each type's grant in turn, and the organization's budgets when it bought for the
    first: a pool refill of the second type (its grant, then the budgets) and the placement each
    waited for the other, and PostgreSQL ended one ("deadlock detected", seen in the sixty-job
    e2e). Every grant is locked first now, in one order, then the budgets."""
    import threading

    from django.db import connection

    from apps.billing.budgets import budget_set
    from apps.machines.budgets import budget_check
    from apps.machines.services import grant_lock
    from testkit.builders import fake_machine_type, granted_type

    org = tworld.org
    grant = {"max_concurrent_jobs": 10, "max_instances": 10, "max_pool_size": 10}
    first, _ = fake_machine_type(
        org, account="jobs", name="first", price_per_hour=Decimal("0.50"), grant=grant
    )
    second, _ = granted_type(
        org, first.provider_account, "second", price_per_hour=Decimal("0.50"), grant=grant
    )
    kinds = [first, second]
    budget_set(org=org, amount="100.00", period="month", actor="test")
    for mt in kinds:  # the first type's job is admitted first, so placement takes its grant first
        job_submit(org=org, config=job_config(org, mt, f"on-{mt.name}"))
        assert admit(limit=10) == 1
    errors: list[BaseException] = []
    holding = threading.Event()

    def refill_of_the_second() -> None:
        """What a pool refill of the second type does: its grant, then the budgets."""
        try:
            with transaction.atomic():
                grant_lock(org_id=org.pk, machine_type_id=kinds[1].pk)
                holding.set()
                with connection.cursor() as cursor:  # until the placement waits for a lock
                    for _ in range(100):
                        cursor.execute("SELECT count(*) FROM pg_locks WHERE NOT granted")
                        if cursor.fetchone()[0]:
                            break
                        time.sleep(0.05)
                budget_check(org_id=org.pk, machine_type=kinds[1], now=timezone.now())
        except BaseException as exc:
            errors.append(exc)
        finally:
            connection.close()

    refill = threading.Thread(target=refill_of_the_second)
    refill.start()
    assert holding.wait(10)
    try:
        place()
    except BaseException as exc:
        errors.append(exc)
    refill.join(30)
    assert errors == []
    assert Job.objects.filter(status=J.WAITING_FOR_MACHINE).count() == 2  # machines bought for both
    assert MachineInstance.objects.filter(org=org).count() == 2


@pytest.mark.django_db(transaction=True)
def test_a_job_a_warm_machine_can_take_is_on_it_in_the_submits_own_commit(
    tworld: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One commit from submit to machine: the job is queued, admitted and assigned in the
    submit's transaction, the commit wakes the machine's agent, and no scheduling pass is sent
    to a worker for it (a worker's pass would find nothing to do)."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    mt, _ = setup_type(tworld)
    machine = idle_machine(tworld.org, mt)
    cfg = job_config(tworld.org, mt)
    sent: list[tuple] = []
    woken: list[tuple] = []
    monkeypatch.setattr("apps.core.broker.enqueue", lambda *a, **k: sent.append(a))
    monkeypatch.setattr(
        "apps.jobs.placement.wake_agent",
        lambda instance_id, **k: woken.append((instance_id, Job.objects.get(instance_id=instance_id).status)),
    )
    with CaptureQueriesContext(connection) as queries:
        job = job_submit(org=tworld.org, config=cfg)
    job.refresh_from_db()
    assert (job.status, job.instance_id) == (J.ASSIGNED, machine.pk)
    assert job.queued_at <= job.admitted_at <= job.assigned_at
    assert [q["sql"] for q in queries.captured_queries].count("COMMIT") == 1
    assert woken == [(machine.pk, J.ASSIGNED)]  # after the commit: the agent finds it assigned
    assert sent == []


@pytest.mark.django_db(transaction=True)
def test_an_api_submit_finds_its_configuration_and_what_it_checks_in_one_statement(
    tworld: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before its transaction a submit reads the caller's token and one row: the configuration,
    with its machine type, whether the organization holds that type's grant and whether the
    configuration needs resources (each a statement of its own before, on every job's way)."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    mt, _ = setup_type(tworld)
    machine = idle_machine(tworld.org, mt)
    cfg = job_config(tworld.org, mt)
    monkeypatch.setattr("apps.core.broker.enqueue", lambda *a, **k: None)
    monkeypatch.setattr("apps.jobs.placement.wake_agent", lambda *a, **k: None)
    client = tworld.client("member")
    assert client.get("/api/v1/jobs/").status_code == 200  # the token's last use is written now
    with CaptureQueriesContext(connection) as queries:
        answer = client.post("/api/v1/jobs/", {"config": cfg.name}, format="json")
    assert answer.status_code == 201, answer.content
    assert Job.objects.get(pk=answer.json()["id"]).instance_id == machine.pk
    machine.refresh_from_db()
    assert machine.last_config_id == cfg.pk  # remembered by its claim: the next such job prefers it
    statements = [q["sql"] for q in queries.captured_queries]
    before = statements[: statements.index("BEGIN")]
    assert len(before) == 2, before  # the token, the configuration
    assert not [sql for sql in before if "machines_orgmachinetype" in sql and "EXISTS" not in sql]


@pytest.mark.django_db(transaction=True)
def test_a_submit_whose_grant_another_transaction_holds_is_queued_and_left_to_a_pass(
    tworld: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scheduling pass holding the grant: the submit does not wait for it; its job is
    committed queued and a scheduling pass is sent, which assigns it."""
    from apps.machines.services import grant_lock

    mt, _ = setup_type(tworld)
    machine = idle_machine(tworld.org, mt)
    cfg = job_config(tworld.org, mt)
    sent: list[tuple] = []
    monkeypatch.setattr("apps.core.broker.enqueue", lambda *a, **k: sent.append(a))
    with Held(lambda: grant_lock(org_id=tworld.org.pk, machine_type_id=mt.pk)):
        began = time.monotonic()
        job = job_submit(org=tworld.org, config=cfg)
        waited = time.monotonic() - began
    job.refresh_from_db()
    assert job.status == J.QUEUED
    assert waited < 5  # not held up by the grant's holder (it held it for up to 30 s)
    assert sent == [("apps.jobs.tasks.schedule_task",)]
    schedule()  # what the worker does with it
    job.refresh_from_db()
    assert (job.status, job.instance_id) == (J.ASSIGNED, machine.pk)


@pytest.mark.django_db(transaction=True)
def test_a_submit_inside_a_callers_transaction_holds_no_grant_and_is_placed_after_its_commit(
    tworld: World,
) -> None:
    """A CI convergence submits runner jobs inside its own transaction: the grant stays free for
    everyone else while the caller goes on, and the job is on its machine once the caller commits."""
    from concurrent.futures import ThreadPoolExecutor

    from django.db import connection

    from apps.machines.services import grant_lock

    mt, _ = setup_type(tworld)
    machine = idle_machine(tworld.org, mt)
    cfg = job_config(tworld.org, mt)

    def grant_is_free() -> bool:
        try:
            with transaction.atomic():
                return grant_lock(org_id=tworld.org.pk, machine_type_id=mt.pk, nowait=True) is not None
        finally:
            connection.close()

    with transaction.atomic():
        job = job_submit(org=tworld.org, config=cfg)
        with ThreadPoolExecutor(1) as other:
            assert other.submit(grant_is_free).result(timeout=30)
        assert Job.objects.get(pk=job.pk).status == J.QUEUED
    job.refresh_from_db()
    assert (job.status, job.instance_id) == (J.ASSIGNED, machine.pk)
