"""Shared by the jobs tests (and the machines tests that schedule jobs)."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from apps.jobs.models import Job
from apps.jobs.reports import job_started
from apps.jobs.scheduler import schedule
from apps.jobs.submission import job_submit
from apps.machines.models import MachineInstance, MachineType, OrgMachineType
from testkit.builders import fake_machine_type, idle_machine, job_config
from tests.conftest import World


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


def job_on_machine(world: World, *, started: bool = False, **config: Any) -> tuple[Job, MachineInstance]:
    """A job of a new configuration (``config``: its fields) that one scheduling pass placed on the
    one idle machine of a freshly granted type; ``started``: its agent has reported the start."""
    mt, _ = setup_type(world)
    machine = idle_machine(world.org, mt)
    job = job_submit(org=world.org, config=job_config(world.org, mt, **config))
    schedule()
    if started:
        job_started(instance=machine, job_id=job.pk)
    return job, machine
