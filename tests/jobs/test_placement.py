"""Placement: paid machines first (an idle machine, then a warm pool member), a purchase only
within max_instances and the policy.
Services are called directly; the fake provider stands in for the cloud."""

from __future__ import annotations

from datetime import timedelta

import pytest
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
