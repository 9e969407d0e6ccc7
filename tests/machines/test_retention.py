"""Billing-aware retention: an idle machine lives until just before its paid period ends.
Services are called directly; the fake provider stands in for the cloud."""

from __future__ import annotations

from datetime import timedelta

import pytest

from apps.events.models import Event
from apps.jobs.choices import JobStatus
from apps.jobs.reports import job_finished, job_started
from apps.jobs.scheduler import schedule
from apps.jobs.submission import job_submit
from apps.machines.choices import InstanceStatus
from apps.machines.retention import idle_machines_retire
from testkit.builders import idle_machine, job_config
from tests.conftest import World
from tests.jobs.common import refresh, setup_type

J = JobStatus
S = InstanceStatus


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
