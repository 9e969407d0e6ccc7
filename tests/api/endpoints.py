"""The table of every tenant endpoint and action, with the role it needs.

Each later capability adds its rows here, so the isolation suite covers it automatically.
``path`` is formatted with the ids of objects that :func:`make_objects` creates in the
world's org ``acme``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from apps.events.services import event_record
from apps.jobs.models import JobConfiguration
from apps.machines.models import MachineInstance, MachineType, OrgMachineType
from tests.conftest import World


@dataclass(frozen=True)
class Endpoint:
    name: str
    method: str
    path: str
    role: str  # minimum role: viewer | member | admin
    body: Callable[[dict[str, str]], dict[str, Any]] = field(default=lambda ids: {})
    ok: tuple[int, ...] = (200,)

    @property
    def is_list(self) -> bool:
        return self.method == "get" and "{" not in self.path

    @property
    def writes(self) -> bool:
        return self.method != "get"


def make_objects(world: World) -> dict[str, str]:
    """One object of each kind in ``acme``; the machine type is granted to ``acme`` only."""
    private = MachineType.objects.create(
        name="acme-only", provider_account=world.account, server_type="local", cpus=4, memory_mb=8192
    )
    OrgMachineType.objects.create(org=world.org, machine_type=private)
    instance = MachineInstance.objects.create(
        org=world.org, machine_type=world.machine_type, provider_account=world.account, status="ready"
    )
    config = JobConfiguration.objects.create(
        org=world.org, name="build", machine_type=world.machine_type, command="make"
    )
    event = event_record(kind="test.made", org=world.org, actor="test")
    return {
        "instance": str(instance.pk),
        "config": str(config.pk),
        "event": str(event.pk),
        "machine_type": str(private.pk),
    }


ENDPOINTS: list[Endpoint] = [
    Endpoint("machine types", "get", "/api/v1/machine-types/", "viewer"),
    Endpoint("machine type", "get", "/api/v1/machine-types/{machine_type}/", "viewer"),
    Endpoint("instances", "get", "/api/v1/instances/", "viewer"),
    Endpoint("instance", "get", "/api/v1/instances/{instance}/", "viewer"),
    Endpoint("job configs", "get", "/api/v1/job-configs/", "viewer"),
    Endpoint("job config", "get", "/api/v1/job-configs/{config}/", "viewer"),
    Endpoint(
        "create job config",
        "post",
        "/api/v1/job-configs/",
        "admin",
        body=lambda ids: {"name": "new", "machine_type": ids["machine_type"], "command": "true"},
        ok=(201,),
    ),
    Endpoint(
        "change job config",
        "patch",
        "/api/v1/job-configs/{config}/",
        "admin",
        body=lambda ids: {"priority": 5},
    ),
    Endpoint(
        "replace job config",
        "put",
        "/api/v1/job-configs/{config}/",
        "admin",
        body=lambda ids: {"name": "build", "machine_type": ids["machine_type"], "command": "make all"},
    ),
    Endpoint("delete job config", "delete", "/api/v1/job-configs/{config}/", "admin", ok=(204,)),
    Endpoint("events", "get", "/api/v1/events/", "viewer"),
    Endpoint("event", "get", "/api/v1/events/{event}/", "viewer"),
]
