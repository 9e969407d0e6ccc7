"""Shared by the jobs tests (and the machines tests that schedule jobs)."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from apps.machines.models import MachineType, OrgMachineType
from testkit.builders import fake_machine_type
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
