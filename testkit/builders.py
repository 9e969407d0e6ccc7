"""Builders for the rows tests and benchmarks set up over and over: provider accounts, machine
types with their grant, ready (idle or pooled) instances, warming instances with an enrolled
agent, job configurations. Each writes rows directly, the state they would be in once the real
services ran; the services under test are never bypassed for what a test is about.

Models are imported inside the functions: this module is importable before ``django.setup()``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rest_framework.test import APIClient

    from apps.jobs.models import Job, JobConfiguration
    from apps.machines.models import MachineInstance, MachineType, OrgMachineType, ProviderAccount
    from apps.pools.models import InstancePool
    from apps.resources.models import ResourceInstance


def provider_account(
    kind: str,
    name: str,
    config: Mapping[str, Any],
    credentials: Mapping[str, Any] | None = None,
    *,
    org: Any = None,
) -> ProviderAccount:
    """A provider account: the operator's, or ``org``'s own."""
    from apps.machines.models import ProviderAccount

    account = ProviderAccount(name=name, kind=kind, config=dict(config), org=org)
    if credentials is not None:
        account.credentials = dict(credentials)
    account.save()
    return account


def granted_type(
    org: Any,
    account: ProviderAccount,
    name: str,
    *,
    cpus: int = 2,
    memory_mb: int = 2048,
    server_type: str | None = None,
    grant: Mapping[str, Any] | None = None,
    **fields: Any,
) -> tuple[MachineType, OrgMachineType]:
    """A machine type on ``account`` (``server_type`` ``local`` on a local account, ``f``
    elsewhere unless given) and its grant to ``org`` (``grant``: the quota fields)."""
    from apps.machines.models import MachineType, OrgMachineType

    mt = MachineType.objects.create(
        name=name,
        provider_account=account,
        server_type=server_type or ("local" if account.kind == "local" else "f"),
        cpus=cpus,
        memory_mb=memory_mb,
        **fields,
    )
    return mt, OrgMachineType.objects.create(org=org, machine_type=mt, **(grant or {}))


def fake_machine_type(
    org: Any,
    *,
    account: str = "fake",
    name: str = "f1",
    grant: Mapping[str, Any] | None = None,
    **fields: Any,
) -> tuple[MachineType, OrgMachineType]:
    """A machine type of the fake provider (the fake cloud emptied first), granted to ``org``."""
    from catacloud.providers.fake import FakeProvider

    FakeProvider.reset()
    fake = provider_account("fake", "fake", {"account": account})
    return granted_type(org, fake, name, grant=grant, **fields)


def ready_instance(
    machine_type: MachineType,
    *,
    org: Any = None,
    pool: InstancePool | None = None,
    now: datetime | None = None,
    **fields: Any,
) -> MachineInstance:
    """A ready machine with a live agent, not saved: idle (``org``) or a member of ``pool``."""
    from django.utils import timezone

    from apps.machines.models import MachineInstance

    now = now or timezone.now()
    mt = machine_type
    return MachineInstance(
        **{
            "org_id": org.pk if org is not None else pool.org_id,  # type: ignore[union-attr]
            "machine_type": mt,
            "provider_account_id": mt.provider_account_id,
            "machine_type_version": mt.version,
            "pool": pool,
            "status": "ready",
            "ready_at": now,
            "provisioning_started_at": now,
            "last_heartbeat_at": now,
            **fields,
        }
    )


def idle_machine(org: Any, machine_type: MachineType, **fields: Any) -> MachineInstance:
    """A saved ready machine outside any pool (``provider_id`` ``f-1`` unless given)."""
    instance = ready_instance(machine_type, org=org, **{"provider_id": "f-1", **fields})
    instance.save()
    return instance


def instance_row(org: Any, machine_type: MachineType, **fields: Any) -> MachineInstance:
    """A saved machine of ``machine_type`` in the state ``fields`` give (``status``, ``pool``,
    timestamps), written directly: a row for what a test does to it next."""
    from apps.machines.models import MachineInstance

    return MachineInstance.objects.create(
        **{
            "org": org,
            "machine_type": machine_type,
            "provider_account_id": machine_type.provider_account_id,
            "machine_type_version": machine_type.version,
            **fields,
        }
    )


def pool_row(org: Any, machine_type: MachineType, name: str = "p", **fields: Any) -> InstancePool:
    """A saved pool in the state ``fields`` give, without its members (``pool_create`` would
    request them)."""
    from apps.pools.models import InstancePool

    return InstancePool.objects.create(
        **{"org": org, "name": name, "machine_type": machine_type, "target_size": 1, "max_size": 1, **fields}
    )


def resource_row(
    org: Any, type_id: str = "token", well: str = "api_token", **fields: Any
) -> ResourceInstance:
    """A saved resource of type ``type_id`` (created with ``well`` if missing) in the state
    ``fields`` give."""
    from apps.resources.models import ResourceInstance, ResourceType

    rtype, _ = ResourceType.objects.get_or_create(id=type_id, defaults={"well": well})
    return ResourceInstance.objects.create(resource_type=rtype, org=org, **fields)


def ready_members(
    pool: InstancePool, n: int, *, provider_ids: str = "", batch_size: int | None = None, **fields: Any
) -> list[MachineInstance]:
    """``n`` ready members of ``pool`` in one insert, ready one microsecond apart (the oldest
    first); ``provider_ids`` prefixes a numbered provider id."""
    from django.utils import timezone

    now = timezone.now()
    return bulk_create(
        (
            ready_instance(
                pool.machine_type,
                pool=pool,
                now=now,
                **{
                    "ready_at": now + timedelta(microseconds=i),
                    **({"provider_id": f"{provider_ids}{i}"} if provider_ids else {}),
                    **fields,
                },
            )
            for i in range(n)
        ),
        batch_size=batch_size,
    )


def bulk_create(instances: Iterable[MachineInstance], batch_size: int | None = None) -> list[MachineInstance]:
    from apps.machines.models import MachineInstance

    return MachineInstance.objects.bulk_create(instances, batch_size=batch_size)


def warming_instance(org: Any, machine_type: MachineType, **fields: Any) -> MachineInstance:
    """A saved machine whose agent has not enrolled yet."""
    from django.utils import timezone

    from apps.machines.models import MachineInstance

    return MachineInstance.objects.create(
        **{
            "org": org,
            "machine_type": machine_type,
            "provider_account_id": machine_type.provider_account_id,
            "status": "warming",
            "provisioning_started_at": timezone.now(),
            "provider_id": "p-1",
            **fields,
        }
    )


def enroll(instance: MachineInstance, **body: Any) -> tuple[APIClient, str]:
    """Enroll ``instance``'s agent with its bootstrap token (and hostname ``box`` unless
    ``body`` says): a client that speaks as that agent, and its agent token."""
    from rest_framework.test import APIClient

    from apps.machines.lifecycle import bootstrap_token_for

    client = APIClient()
    answer = client.post(
        "/api/agent/v1/enroll",
        {"bootstrap_token": bootstrap_token_for(instance.pk), "hostname": "box", **body},
        format="json",
    )
    assert answer.status_code == 200, answer.content
    token = answer.json()["agent_token"]
    client.credentials(HTTP_AUTHORIZATION=f"Agent {token}")
    return client, token


def enrolled_agent(org: Any, machine_type: MachineType, **fields: Any) -> tuple[APIClient, MachineInstance]:
    """A warming machine whose agent has enrolled: the agent's client and the machine."""
    instance = warming_instance(org, machine_type, **fields)
    return enroll(instance)[0], instance


def job_config(
    org: Any,
    machine_type: MachineType,
    name: str = "train",
    command: str = "run",
    *,
    resource_types: Iterable[str] = (),
    **fields: Any,
) -> JobConfiguration:
    from apps.jobs.models import JobConfiguration

    config = JobConfiguration.objects.create(
        org=org, name=name, machine_type=machine_type, command=command, **fields
    )
    if resource_types:
        config.resource_types.set(resource_types)
    return config


def job_row(config: JobConfiguration, **fields: Any) -> Job:
    """A job of ``config`` written directly, in the state ``fields`` give (``status``,
    ``instance``, timestamps), without going through submission."""
    from apps.jobs.models import Job

    defaults = {"org_id": config.org_id, "machine_type_id": config.machine_type_id, "command": config.command}
    return Job.objects.create(config=config, **{**defaults, **fields})
