"""Admission within quotas, placement in order, billing-aware retention, failure handling.
Services are called directly; the fake provider stands in for the cloud."""

from __future__ import annotations

import threading
from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.db import connection, transaction
from django.test import override_settings
from django.utils import timezone

from apps.core.errors import Conflict
from apps.events.models import Event
from apps.jobs.admission import admit
from apps.jobs.choices import JobStatus
from apps.jobs.convergence import jobs_time_out
from apps.jobs.models import Job
from apps.jobs.placement import place
from apps.jobs.reports import job_finished, job_started, jobs_requeue_for_instance
from apps.jobs.scheduler import schedule
from apps.jobs.submission import job_cancel, job_submit
from apps.machines.choices import InstanceStatus
from apps.machines.lifecycle import instance_mark_lost
from apps.machines.models import MachineInstance, MachineType, OrgMachineType
from apps.machines.retention import idle_machines_retire
from apps.machines.services import grant_lock
from apps.pools.services import pool_create
from testkit.builders import enrolled_agent, fake_machine_type, idle_machine, job_config, job_row
from tests.conftest import World

J = JobStatus
S = InstanceStatus


def setup_type(world: World, *, cpus: int = 32, **grant: Any) -> tuple[MachineType, OrgMachineType]:
    """The jobs tests' machine type on the fake cloud: big, 0.50 per started hour."""
    return fake_machine_type(
        world.org,
        account="jobs",
        name="big",
        cpus=cpus,
        memory_mb=65536,
        price_per_hour=Decimal("0.50"),
        billing_increment_seconds=3600,
        grant={"max_concurrent_jobs": 100, "max_instances": 100, "max_pool_size": 10, **grant},
    )


def refresh(*objs: Any) -> None:
    for obj in objs:
        obj.refresh_from_db()


@pytest.mark.django_db
def test_kueue_example_cpu_quota_admits_two_of_three(world: World) -> None:
    mt, _ = setup_type(world, cpus=32, cpu_quota=64)
    cfg = job_config(world.org, mt)
    jobs = [job_submit(org=world.org, config=cfg) for _ in range(3)]
    assert admit() == 2
    refresh(*jobs)
    assert [j.status for j in jobs] == [J.WAITING_FOR_MACHINE, J.WAITING_FOR_MACHINE, J.QUEUED]
    assert jobs[2].pending_reason == "cpu quota 64/64 in use"
    Job.objects.filter(pk=jobs[0].pk).update(status=J.SUCCEEDED)  # one finishes
    assert admit() == 1
    refresh(jobs[2])
    assert jobs[2].status == J.WAITING_FOR_MACHINE


@pytest.mark.django_db
def test_priority_then_fifo_and_a_blocked_type_does_not_block_others(world: World) -> None:
    mt, _ = setup_type(world, max_concurrent_jobs=1)
    small = MachineType.objects.create(
        name="small2", provider_account=mt.provider_account, server_type="s", cpus=1, memory_mb=1024
    )
    OrgMachineType.objects.create(org=world.org, machine_type=small)
    low, high = job_config(world.org, mt, "low", priority=0), job_config(world.org, mt, "high", priority=10)
    first_low = job_submit(org=world.org, config=low)
    first_high = job_submit(org=world.org, config=high)
    second_high = job_submit(org=world.org, config=high)
    other = job_submit(org=world.org, config=job_config(world.org, small, "other"))
    assert admit() == 2
    refresh(first_low, first_high, second_high, other)
    assert first_high.status == J.WAITING_FOR_MACHINE  # priority first
    assert (first_low.status, second_high.status) == (J.QUEUED, J.QUEUED)
    assert second_high.pending_reason == "max_concurrent_jobs 1/1"
    assert other.status == J.WAITING_FOR_MACHINE  # BestEffortFIFO: the blocked type blocks nobody else


@pytest.mark.django_db(transaction=True)
@override_settings(CATACLOUD_SCHEDULE_ON_SUBMIT=False)  # the scheduling passes alone, here
def test_four_concurrent_schedulers_never_over_admit(tworld: World) -> None:
    mt, _ = setup_type(tworld, cpus=4, cpu_quota=28, max_concurrent_jobs=50)  # room for 7
    cfg = job_config(tworld.org, mt)
    for _ in range(40):
        job_submit(org=tworld.org, config=cfg)
    barrier = threading.Barrier(4)
    totals: list[int] = []

    def run() -> None:
        try:
            barrier.wait()
            n = 0
            for _ in range(5):
                n += admit(limit=7)
            totals.append(n)
        finally:
            connection.close()

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(totals) == 7
    assert Job.objects.filter(status=J.WAITING_FOR_MACHINE).count() == 7
    assert Job.objects.filter(status=J.QUEUED, pending_reason="cpu quota 28/28 in use").count() == 33


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
def test_finished_reuse_job_keeps_the_machine_and_ephemeral_destroys_it(world: World) -> None:
    mt, _ = setup_type(world)
    for reuse, expected in (("reuse", S.READY), ("ephemeral", S.TERMINATING)):
        machine = idle_machine(world.org, mt)
        job = job_submit(org=world.org, config=job_config(world.org, mt, reuse, reuse=reuse))
        schedule()
        refresh(job)
        assert job.instance_id == machine.pk
        job_started(instance=machine, job_id=job.pk)
        job_finished(instance=machine, job_id=job.pk, outcome="succeeded", exit_code=0)
        refresh(job, machine)
        assert job.status == J.SUCCEEDED and job.exit_code == 0
        assert machine.status == expected
        if expected == S.READY:
            assert machine.pool_id is None and machine.last_config_id == job.config_id
            MachineInstance.objects.filter(pk=machine.pk).update(status=S.TERMINATED)


@pytest.mark.django_db
def test_billing_aware_retention(world: World) -> None:
    mt, _ = setup_type(world)  # hourly billing
    machine = idle_machine(world.org, mt)
    started = machine.provisioning_started_at
    assert idle_machines_retire(now=started + timedelta(minutes=30)) == 0  # within its paid hour: kept
    job = job_submit(org=world.org, config=job_config(world.org, mt))
    schedule()
    refresh(job)
    assert job.instance_id == machine.pk  # reused within the paid hour
    job_started(instance=machine, job_id=job.pk)
    job_finished(instance=machine, job_id=job.pk, outcome="succeeded", exit_code=0)
    assert idle_machines_retire(now=started + timedelta(minutes=50)) == 0
    assert (
        idle_machines_retire(now=started + timedelta(minutes=58, seconds=30)) == 1
    )  # before hour two starts
    refresh(machine)
    assert machine.status == S.TERMINATING
    assert "end of its paid period" in Event.objects.filter(instance_id=machine.pk).latest("id").reason


@pytest.mark.django_db
def test_lost_machine_requeues_with_attempt_plus_one_then_fails(world: World) -> None:
    mt, _ = setup_type(world)
    job = job_submit(org=world.org, config=job_config(world.org, mt, max_attempts=2))
    for attempt, expected in ((1, J.QUEUED), (2, J.FAILED)):
        machine = idle_machine(world.org, mt)
        schedule()
        refresh(job)
        assert job.attempt == attempt and job.instance_id == machine.pk
        job_started(instance=machine, job_id=job.pk)
        instance_mark_lost(instance_id=machine.pk, actor="test", reason="agent silent")
        refresh(job)
        assert job.status == expected
    assert job.attempt == 2
    assert "attempt 2 of 2" in job.failure_reason
    assert Event.objects.filter(kind="job.requeued", job_id=job.pk).count() == 1


@pytest.mark.django_db
def test_a_lost_agent_that_comes_back_cannot_run_or_finish_the_job(world: World) -> None:
    mt, _ = setup_type(world)
    job = job_submit(org=world.org, config=job_config(world.org, mt))
    first = idle_machine(world.org, mt)
    schedule()
    job_started(instance=first, job_id=job.pk)
    jobs_requeue_for_instance(instance_id=first.pk, cause="machine_lost", detail="agent silent")
    second = idle_machine(world.org, mt)
    schedule()
    refresh(job)
    assert job.instance_id == second.pk
    with pytest.raises(Conflict):
        job_started(instance=first, job_id=job.pk)
    with pytest.raises(Conflict):
        job_finished(instance=first, job_id=job.pk, outcome="succeeded", exit_code=0)
    job_started(instance=second, job_id=job.pk)
    refresh(job)
    assert job.status == J.RUNNING and job.instance_id == second.pk


@pytest.mark.django_db
def test_cancel_in_each_state(world: World) -> None:
    mt, _ = setup_type(world, max_instances=0)
    cfg = job_config(world.org, mt)
    queued = job_submit(org=world.org, config=cfg)
    assert job_cancel(job=queued).status == J.CANCELLED
    waiting = job_submit(org=world.org, config=cfg)
    schedule()
    refresh(waiting)
    assert waiting.status == J.WAITING_FOR_MACHINE
    assert job_cancel(job=waiting).status == J.CANCELLED
    OrgMachineType.objects.filter(machine_type=mt).update(max_instances=5)
    agent, machine = enrolled_agent(world.org, mt)
    beat = agent.post("/api/agent/v1/heartbeat", {}, format="json")  # the handshake: ready
    assert beat.json() == {"cancel": [], "terminate": False}
    running = job_submit(org=world.org, config=cfg)
    schedule()
    job_started(instance=machine, job_id=running.pk)
    cancelled = job_cancel(job=running)
    assert (cancelled.status, cancelled.cancel_requested) == (J.RUNNING, True)
    # the agent's next heartbeat names the job to kill
    beat = agent.post("/api/agent/v1/heartbeat", {}, format="json")
    assert beat.json() == {"cancel": [str(running.pk)], "terminate": False}
    # The agent killed it and reports; whatever it says, a requested cancel wins.
    job_finished(instance=machine, job_id=running.pk, outcome="failed", exit_code=-15)
    refresh(running)
    assert running.status == J.CANCELLED


@pytest.mark.django_db
def test_the_reaper_times_out_jobs_whose_agent_never_reported(world: World) -> None:
    mt, _ = setup_type(world)
    machine = idle_machine(world.org, mt)
    job = job_submit(org=world.org, config=job_config(world.org, mt, timeout_seconds=60))
    schedule()
    job_started(instance=machine, job_id=job.pk)
    jobs_time_out(now=timezone.now() + timedelta(minutes=10))
    refresh(job, machine)
    assert job.status == J.TIMED_OUT
    assert machine.status == S.TERMINATING


@pytest.mark.django_db
def test_place_alone_is_idempotent_for_waiting_jobs(world: World) -> None:
    mt, _ = setup_type(world, max_instances=1)
    job_submit(org=world.org, config=job_config(world.org, mt))
    admit()
    assert place() == (0, 1, 1)
    assert place() == (0, 0, 1)


# ---- the submit's own scheduling (no worker runs in these tests) -------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_job_that_fits_is_on_a_warm_machine_when_its_submit_returns(tworld: World) -> None:
    mt, _ = setup_type(tworld)
    pool = pool_create(org=tworld.org, name="warm", machine_type=mt, target_size=1, max_size=2)
    member = idle_machine(tworld.org, mt, pool=pool)
    job = job_submit(org=tworld.org, config=job_config(tworld.org, mt))
    refresh(job)
    assert (job.status, job.instance_id) == (J.ASSIGNED, member.pk)
    assert job.admitted_at is not None and job.assigned_at is not None


@pytest.mark.django_db(transaction=True)
def test_a_submit_never_waits_for_a_grant_another_transaction_holds(tworld: World) -> None:
    mt, grant = setup_type(tworld)
    pool = pool_create(org=tworld.org, name="warm", machine_type=mt, target_size=1, max_size=2)
    idle_machine(tworld.org, mt, pool=pool)
    cfg = job_config(tworld.org, mt)
    held, release = threading.Event(), threading.Event()

    def hold() -> None:  # a scheduling pass (or a refill) holding the grant
        try:
            with transaction.atomic():
                grant_lock(org_id=grant.org_id, machine_type_id=grant.machine_type_id)
                held.set()
                release.wait(30)
        finally:
            connection.close()

    submitted: list[Job] = []

    def submit() -> None:
        try:
            submitted.append(job_submit(org=tworld.org, config=cfg))
        finally:
            connection.close()

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(10)
    submitter = threading.Thread(target=submit)
    submitter.start()
    submitter.join(10)
    try:
        assert not submitter.is_alive(), "the submit waited for the grant's lock"
        job = Job.objects.get(pk=submitted[0].pk)
        assert job.status == J.QUEUED  # left to the scheduling pass it enqueued
    finally:
        release.set()
        holder.join(10)
    assert schedule().assigned == 1  # the pass places it once the grant is free
    assert Job.objects.get(pk=submitted[0].pk).status == J.ASSIGNED


@pytest.mark.django_db(transaction=True)
def test_concurrent_submits_never_pass_the_quota(tworld: World) -> None:
    mt, _ = setup_type(tworld, max_concurrent_jobs=3)
    cfg = job_config(tworld.org, mt)
    barrier = threading.Barrier(8)

    def submit() -> None:
        try:
            barrier.wait()
            job_submit(org=tworld.org, config=cfg)
        finally:
            connection.close()

    threads = [threading.Thread(target=submit) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    admitted = Job.objects.exclude(status=J.QUEUED).count()
    assert admitted <= 3
    schedule()
    assert Job.objects.exclude(status=J.QUEUED).count() == 3
    assert Job.objects.filter(status=J.QUEUED, pending_reason="max_concurrent_jobs 3/3").count() == 5
