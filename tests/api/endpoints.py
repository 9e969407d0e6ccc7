"""The table of every tenant endpoint and action, with the role it needs.

Each later capability adds its rows here, so the isolation suite covers it automatically.
``path`` is formatted with the ids of objects that :func:`make_objects` creates in the
world's org ``acme``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from django.utils import timezone

from apps.events.services import event_record
from apps.jobs.models import Job, JobConfiguration
from apps.machines.hosts import enrolment_token_create, host_enroll
from apps.machines.models import Budget, Host, MachineType, OrgMachineType, ProviderAccount
from apps.resources.models import ResourceInstance, ResourceType
from catacloud.protocol import HostCapacity
from testkit.builders import granted_type, instance_row, pool_row, provider_account
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
    instance = instance_row(world.org, world.machine_type, status="ready")
    config = JobConfiguration.objects.create(
        org=world.org, name="build", machine_type=world.machine_type, command="make"
    )
    event = event_record(kind="org.member_set", org=world.org, actor="test")
    pool = pool_row(world.org, world.machine_type, "warm", max_size=2, status="ready")
    instance_row(world.org, world.machine_type, status="ready", pool=pool, ready_at=timezone.now())
    drained = pool_row(world.org, world.machine_type, "old", target_size=0, max_size=0, status="drained")
    nightly = JobConfiguration.objects.create(
        org=world.org, name="nightly", machine_type=world.machine_type, command="make"
    )
    job = Job.objects.create(org=world.org, config=nightly, machine_type=world.machine_type, command="make")
    rtype = ResourceType.objects.create(id="scratch", well="api_token")
    resource = ResourceInstance.objects.create(resource_type=rtype, org=world.org, job=job, status="held")
    budget = Budget.objects.create(org=world.org, amount=1000)
    token, host, shared = make_hosts(world)
    own_account, spare_account, own_type = make_own_cloud(world)
    return {
        "own_account": str(own_account.pk),
        "spare_account": str(spare_account.pk),
        "own_type": str(own_type.pk),
        "host": str(host.pk),
        "shared_host": str(shared.pk),
        "enrolment_token": str(token.pk),
        "budget": str(budget.pk),
        "resource": str(resource.pk),
        "instance": str(instance.pk),
        "config": str(config.pk),
        "event": str(event.pk),
        "machine_type": str(private.pk),
        "pool": str(pool.pk),
        "drained_pool": str(drained.pk),
        "job": str(job.pk),
    }


def make_own_cloud(world: World) -> tuple[ProviderAccount, ProviderAccount, MachineType]:
    """``acme``'s own Hetzner accounts (one unused) and a machine type on the first."""
    own = provider_account(
        "hetzner", "acme-cloud", {"location": "fsn1"}, {"token": "acme-token"}, org=world.org
    )
    spare = provider_account("hetzner", "acme-spare", {}, {"token": "acme-token"}, org=world.org)
    own_type = MachineType.objects.create(
        name="acme-own", provider_account=own, org=world.org, server_type="cx23", cpus=2, memory_mb=4096
    )
    OrgMachineType.objects.create(org=world.org, machine_type=own_type)
    return own, spare, own_type


def make_hosts(world: World, name: str = "rack-1") -> tuple[Any, Host, Host]:
    """A provider account of enrolled hosts (``hosts``) with a machine type granted to ``acme``
    only; an enrolment token of ``acme``; a host of ``acme`` and a shared one (the operator's),
    enrolled with their tokens as ``catacloud host`` does."""
    from apps.machines.models import ProviderAccount

    account = ProviderAccount.objects.filter(name="hosts").first()
    if account is None:
        account = provider_account("hosts", "hosts", {})
        granted_type(world.org, account, "acme-hosts", cpus=1, memory_mb=1024)
    token, secret = enrolment_token_create(provider_account=account, org=world.org, labels={"site": "fsn1"})
    _, shared_secret = enrolment_token_create(provider_account=account, labels={"gpu": "a4000"})
    capacity = HostCapacity(cpus=8, memory_mb=16384, disk_gb=100, arch="x86_64")
    host, _ = host_enroll(enrolment_token=secret, hostname=name, capacity=capacity)
    shared, _ = host_enroll(enrolment_token=shared_secret, hostname=f"{name}-shared", capacity=capacity)
    return token, host, shared


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
    Endpoint("terminate instance", "post", "/api/v1/instances/{instance}/terminate/", "admin", ok=(202,)),
    Endpoint("pools", "get", "/api/v1/pools/", "viewer"),
    Endpoint("pool", "get", "/api/v1/pools/{pool}/", "viewer"),
    Endpoint(
        "create pool",
        "post",
        "/api/v1/pools/",
        "admin",
        ok=(201,),
        body=lambda ids: {
            "name": "new",
            "machine_type": ids["machine_type"],
            "target_size": 1,
            "max_size": 2,
        },
    ),
    Endpoint("resize pool", "patch", "/api/v1/pools/{pool}/", "admin", body=lambda ids: {"target_size": 2}),
    Endpoint(
        "acquire",
        "post",
        "/api/v1/pools/{pool}/acquire/",
        "member",
        ok=(201,),
        body=lambda ids: {"acquired_by": "ci", "acquired_for": "build 1"},
    ),
    Endpoint(
        "drain pool",
        "post",
        "/api/v1/pools/{pool}/drain/",
        "admin",
        body=lambda ids: {"terminate_members": True},
    ),
    Endpoint("delete pool", "delete", "/api/v1/pools/{drained_pool}/", "admin", ok=(204,)),
    Endpoint("jobs", "get", "/api/v1/jobs/", "viewer"),
    Endpoint("job", "get", "/api/v1/jobs/{job}/", "viewer"),
    Endpoint(
        "submit job", "post", "/api/v1/jobs/", "member", ok=(201,), body=lambda ids: {"config": ids["config"]}
    ),
    Endpoint("cancel job", "post", "/api/v1/jobs/{job}/cancel/", "member", ok=(202,)),
    Endpoint("job logs", "get", "/api/v1/jobs/{job}/logs/", "viewer"),
    Endpoint("job artifacts", "get", "/api/v1/jobs/{job}/artifacts/", "viewer"),
    Endpoint("resources", "get", "/api/v1/resources/", "viewer"),
    Endpoint("resource", "get", "/api/v1/resources/{resource}/", "viewer"),
    Endpoint("budgets", "get", "/api/v1/budgets/", "viewer"),
    Endpoint("budget", "get", "/api/v1/budgets/{budget}/", "viewer"),
    Endpoint(
        "set budget",
        "post",
        "/api/v1/budgets/",
        "admin",
        ok=(201,),
        body=lambda ids: {"amount": "50", "period": "day", "machine_type": "acme-only"},
    ),
    Endpoint("provider accounts", "get", "/api/v1/provider-accounts/", "viewer"),
    Endpoint("provider account", "get", "/api/v1/provider-accounts/{own_account}/", "viewer"),
    Endpoint(
        "rename provider account",
        "patch",
        "/api/v1/provider-accounts/{own_account}/",
        "admin",
        body=lambda ids: {"name": "acme-cloud-2"},
    ),
    Endpoint(
        "delete provider account", "delete", "/api/v1/provider-accounts/{spare_account}/", "admin", ok=(204,)
    ),
    Endpoint(
        "create own machine type",
        "post",
        "/api/v1/machine-types/",
        "admin",
        ok=(201,),
        body=lambda ids: {
            "name": "acme-new",
            "provider_account": "acme-cloud",
            "server_type": "cx33",
            "cpus": 4,
            "memory_mb": 8192,
        },
    ),
    Endpoint(
        "change own machine type",
        "patch",
        "/api/v1/machine-types/{own_type}/",
        "admin",
        body=lambda ids: {"description": "ours", "limits": {"max_instances": 2}},
    ),
    Endpoint("delete own machine type", "delete", "/api/v1/machine-types/{own_type}/", "admin", ok=(204,)),
    Endpoint("hosts", "get", "/api/v1/hosts/", "viewer"),
    Endpoint("host", "get", "/api/v1/hosts/{host}/", "viewer"),
    Endpoint(
        "change host",
        "patch",
        "/api/v1/hosts/{host}/",
        "admin",
        body=lambda ids: {"monthly_price": "120.00", "labels": {"site": "fsn1", "rack": "2"}},
    ),
    Endpoint(
        "drain host", "post", "/api/v1/hosts/{host}/cordon/", "admin", body=lambda ids: {"drain_seconds": 600}
    ),
    Endpoint("uncordon host", "post", "/api/v1/hosts/{host}/uncordon/", "admin"),
    Endpoint("revoke host", "post", "/api/v1/hosts/{host}/revoke/", "admin"),
    Endpoint("enrolment tokens", "get", "/api/v1/enrolment-tokens/", "viewer"),
    Endpoint("enrolment token", "get", "/api/v1/enrolment-tokens/{enrolment_token}/", "viewer"),
    Endpoint(
        "create enrolment token",
        "post",
        "/api/v1/enrolment-tokens/",
        "admin",
        ok=(201,),
        body=lambda ids: {"provider_account": "hosts", "labels": {"site": "fsn1"}, "max_uses": 3},
    ),
    Endpoint("revoke enrolment token", "post", "/api/v1/enrolment-tokens/{enrolment_token}/revoke/", "admin"),
]
