"""Admission within quotas: priority, FIFO, quotas counted under the grant lock, a blocked grant
never blocking another.
Services are called directly; the fake provider stands in for the cloud."""

from __future__ import annotations

import pytest
from django.test import override_settings

from apps.jobs.admission import admit
from apps.jobs.choices import JobStatus
from apps.jobs.models import Job
from apps.jobs.submission import job_submit
from apps.machines.choices import InstanceStatus
from apps.machines.models import MachineType, OrgMachineType
from testkit.builders import job_config
from tests.concurrency import at_once
from tests.conftest import World
from tests.jobs.common import refresh, setup_type

J = JobStatus
S = InstanceStatus


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
    totals: list[int] = []

    def run() -> None:
        n = 0
        for _ in range(5):
            n += admit(limit=7)
        totals.append(n)

    at_once(4, run, timeout=None)
    assert sum(totals) == 7
    assert Job.objects.filter(status=J.WAITING_FOR_MACHINE).count() == 7
    assert Job.objects.filter(status=J.QUEUED, pending_reason="cpu quota 28/28 in use").count() == 33
