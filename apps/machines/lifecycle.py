"""The machine life-cycle saga: request, provision, terminate, lose; never leak a machine.

Crash safety: the instance row (and its UUID, the idempotency key) is committed before any
cloud call; no transaction is open across a provider call; the result is recorded in a new
transaction with a compare-and-set, and a machine created for a row that meanwhile ended is
deleted at once. Tasks call these functions; every one of them is safe to run twice.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from apps.core import hooks
from apps.core.actors import Actor
from apps.core.broker import enqueue_on_commit
from apps.core.causes import Cause
from apps.core.errors import Conflict, ErrorCode, InvalidTransition
from apps.core.errors import NotFound as DomainNotFound
from apps.core.ids import ClaimId, InstanceId, OrgId, PoolId, ProviderAccountId
from apps.core.selectors import installation_id
from apps.events.kinds import EventKind
from apps.events.services import event_record
from apps.machines import capacity
from apps.machines.agent_dist import agent_package
from apps.machines.choices import INSTANCE_LIVE, InstanceStatus, ProviderKind
from apps.machines.hosts import slot_host
from apps.machines.models import MachineInstance, MachineType, ProviderAccount
from apps.machines.owned import operator_settings
from apps.machines.services import INSTANCE_STATES
from apps.orgs.models import Organization
from catacloud.providers import (
    LABEL_INSTALLATION,
    LABEL_INSTANCE,
    LABEL_ORG,
    LABEL_POOL,
    MachineSpec,
    NotFound,
    Provider,
    ProviderMachine,
    build_provider,
    get_driver_class,
)
from catacloud.providers.base import Bootstrap

log = logging.getLogger(__name__)

# The machines app's tasks (apps/machines/tasks.py), sent by their registered names: the tasks
# import this module, never the other way round.
PROVISION_TASK = "apps.machines.tasks.provision_instance_task"
TERMINATE_TASK = "apps.machines.tasks.terminate_instance_task"
DESTROY_MACHINE_TASK = "apps.machines.tasks.destroy_machine_task"
REFRESH_PROVIDER_STATE_TASK = "apps.machines.tasks.refresh_provider_state_task"

# ---- providers ------------------------------------------------------------------------------

_providers: dict[tuple[str, str], Provider] = {}


def provider_for(account: ProviderAccount) -> Provider:
    """The driver for ``account`` (cached per process until the account changes). Keyed by
    what the driver is built from, not ``updated_at``: a change saved without touching it
    (``update_fields``, a queryset update) must still reach the next machine."""
    # An organization's own account: the operator's settings for its kind on top (endpoints...).
    operators = operator_settings(account.kind) if account.org_id is not None else {}
    built_from = json.dumps(
        [account.kind, account.name, account.config, account.credentials_encrypted, operators], default=str
    )
    key = (str(account.pk), hashlib.sha256(built_from.encode()).hexdigest())
    provider = _providers.get(key)
    if provider is None:
        for old in [k for k in _providers if k[0] == key[0]]:  # the account's outdated driver
            del _providers[old]
        config = {**account.config, **operators}
        if account.kind == ProviderKind.HOSTS:  # its slots are this account's (apps.machines.hostdriver)
            config["account_id"] = str(account.pk)
        if get_driver_class(account.kind).needs_state_dir:
            config.setdefault("state_dir", str(Path(settings.CATACLOUD_HOME) / "machines" / account.name))
        provider = build_provider(account.kind, config=config, credentials=account.credentials)
        _providers[key] = provider
    return provider


def owner_labels() -> dict[str, str]:
    """Labels that select every machine of this installation at any provider."""
    return {LABEL_INSTALLATION: installation_id()}


# ---- bootstrap tokens -----------------------------------------------------------------------


def bootstrap_token_for(instance_id: InstanceId) -> str:
    """The single-use, expiring token a machine's agent enrolls with (``bootstrap.py``)."""
    from apps.machines.bootstrap import token_for

    return token_for(instance_id)


def bootstrap_token_instance(token: str) -> str | None:
    """The instance id a genuine, unexpired bootstrap token belongs to, or None."""
    from apps.machines.bootstrap import token_instance

    return token_instance(token)


# ---- request ---------------------------------------------------------------------------------


def instance_request(
    *,
    org: Organization | OrgId,
    machine_type: MachineType,
    pool: PoolId | None = None,
    actor: Actor = Actor.UNNAMED,
    reason: str = "",
) -> MachineInstance:
    """Commit a ``pending`` instance and enqueue its provisioning after commit. A slot of an
    enrolled host gets its host now, under the hosts' locks (the caller holds the grant's):
    :class:`apps.machines.hosts.NoHostRoom` when none has room."""
    org_id = org.pk if isinstance(org, Organization) else org
    with transaction.atomic():
        host = None
        if machine_type.provider_account.kind == ProviderKind.HOSTS:
            host = slot_host(org_id=org_id, machine_type=machine_type)
        instance = MachineInstance.objects.create(
            org_id=org_id,
            machine_type=machine_type,
            machine_type_version=machine_type.version,
            provider_account_id=machine_type.provider_account_id,
            pool_id=pool,
            host=host,
        )
        event_record(
            kind=EventKind.POOL_MEMBER_REQUESTED if instance.pool_id else EventKind.INSTANCE_REQUESTED,
            org=instance.org_id,
            pool=instance.pool_id,
            instance=instance,
            actor=actor,
            reason=reason,
        )
        enqueue_on_commit(PROVISION_TASK, str(instance.pk))
    return instance


def machine_spec(instance: MachineInstance) -> MachineSpec:
    mt = instance.machine_type
    token = bootstrap_token_for(instance.pk)
    url = settings.CATACLOUD_AGENT_URL
    labels = {
        **owner_labels(),
        LABEL_INSTANCE: str(instance.pk),
        LABEL_ORG: str(instance.org_id),
        LABEL_POOL: str(instance.pool_id) if instance.pool_id else "none",
    }
    return MachineSpec(
        instance_id=str(instance.pk),
        labels=labels,
        server_type=mt.server_type,
        image=mt.image,
        location=mt.location,
        cpus=mt.cpus,
        memory_mb=mt.memory_mb,
        gpus=mt.gpus,
        spot=mt.spot,
        disk_gb=mt.disk_gb,
        containers=mt.containers,
        bootstrap=Bootstrap(agent_url=url, token=token, package=agent_package(url)),
    )


def instance_provision(*, instance_id: InstanceId) -> None:
    """Body of the provision task: create the machine at the provider, record it → warming.

    Provider errors propagate (typed) so the task can retry the retryable ones.
    """
    instance = (
        MachineInstance.objects.select_related("machine_type", "provider_account")
        .filter(pk=instance_id)
        .first()
    )
    if instance is None or instance.status not in (InstanceStatus.PENDING, InstanceStatus.PROVISIONING):
        return  # gone, or already past provisioning: nothing to do (task ran twice)
    if instance.status == InstanceStatus.PENDING:
        provisioning = INSTANCE_STATES.try_move(
            instance.pk,
            to=InstanceStatus.PROVISIONING,
            from_=[InstanceStatus.PENDING],
            actor=Actor.PROVISIONER,
            event=EventKind.POOL_MEMBER_PROVISIONING if instance.pool_id else EventKind.INSTANCE_PROVISIONING,
        )
        if provisioning is None:
            return  # another run moved it first
    provider = provider_for(instance.provider_account)
    machine = provider.create(machine_spec(instance))  # no transaction open here
    with transaction.atomic():
        recorded = MachineInstance.objects.filter(pk=instance.pk, status=InstanceStatus.PROVISIONING).update(
            provider_id=machine.provider_id,
            provider_state=machine.raw_state[:32],
            public_ip=machine.public_ip,
            private_ip=machine.private_ip,
            provider_checked_at=timezone.now(),
        )
        if recorded:
            INSTANCE_STATES.move(
                instance.pk,
                to=InstanceStatus.WARMING,
                from_=[InstanceStatus.PROVISIONING],
                actor=Actor.PROVISIONER,
                event=EventKind.POOL_MEMBER_PROVISIONED
                if instance.pool_id
                else EventKind.INSTANCE_PROVISIONED,
                provider_id=machine.provider_id,
            )
    if not recorded:
        current = MachineInstance.objects.filter(pk=instance.pk).values("status", "provider_id").first()
        if current and current["status"] in INSTANCE_LIVE and current["provider_id"] == machine.provider_id:
            return  # a second run of this task (re-driven) found the machine the first one recorded
        # The row ended (terminated, failed, lost) while we were creating: do not leak.
        log.info("instance %s ended during provisioning; deleting its machine", instance.pk)
        MachineInstance.objects.filter(pk=instance.pk, provider_id="").update(provider_id=machine.provider_id)
        provider.delete(machine.provider_id)


def instance_fail(*, instance_id: InstanceId, reason: str, actor: Actor = Actor.PROVISIONER) -> None:
    """Give up on an instance (provider refused it); its pool sees the deficit."""
    instance = INSTANCE_STATES.try_move(
        instance_id, to=InstanceStatus.FAILED, actor=actor, reason=reason, failure_reason=reason[:2000]
    )
    if instance is None:
        return
    if instance.pool_id:
        hooks.pool_member_left(instance.pool_id)  # the pool sees the deficit


def instance_no_capacity(*, instance_id: InstanceId, reason: str) -> None:
    """The provider has no capacity for the instance's type now, or refuses every machine of it
    (a quota, a credential or setting it refuses): the type cools down (nothing of it bought
    meanwhile), the instance has failed, and its grant's waiting jobs are placed again at once,
    on their next candidate (apps.jobs.placement). Not retried in place: the cool-down is the
    wait, and another candidate may serve sooner."""
    row = MachineInstance.objects.filter(pk=instance_id).values("org_id", "machine_type_id").first()
    if row is None:
        return
    with transaction.atomic():
        capacity.cool_down(machine_type_id=row["machine_type_id"], reason=reason)
        instance_fail(instance_id=instance_id, reason=reason)
        hooks.machine_available(org_id=row["org_id"], machine_type_id=row["machine_type_id"])


# ---- terminate -------------------------------------------------------------------------------


def instance_terminate(
    *,
    instance_id: InstanceId,
    actor: Actor = Actor.UNNAMED,
    reason: str = "",
    cause: Cause = Cause.MACHINE_TERMINATED,
    only_idle: bool = False,
) -> MachineInstance:
    """Move a live instance to ``terminating`` and enqueue its destruction after commit.

    Raises InvalidTransition when it is not live (with ``only_idle``: unless it is still ready
    outside every pool, so a retirement never takes a machine a job or a pool just took). Its
    pool (if any) refills after commit. A job still on the machine is requeued with ``cause``
    once the machine is gone (or when its agent reports it killed), never while it may still
    run there.
    """
    with transaction.atomic():
        row = MachineInstance.objects.filter(pk=instance_id).values("pool_id").first()
        event = EventKind.POOL_MEMBER_TERMINATED if row and row["pool_id"] else None
        instance = INSTANCE_STATES.move(
            instance_id,
            to=InstanceStatus.TERMINATING,
            from_=[InstanceStatus.READY] if only_idle else None,
            where={"pool": None} if only_idle else None,
            actor=actor,
            reason=reason,
            event=event,
            end_cause=cause,
            lease_expires_at=None,
        )
        enqueue_on_commit(TERMINATE_TASK, str(instance_id))
    if instance.pool_id:
        hooks.pool_member_left(instance.pool_id)
    return instance


def instance_release_claim(
    *, instance_id: InstanceId, claim_id: ClaimId | None = None, actor: Actor = Actor.UNNAMED
) -> MachineInstance:
    """End a claim made through a pool acquire: the machine is terminated (a used machine
    never returns to ``ready``) and its pool refills. Idempotent: releasing a claim already
    released answers the machine as it is. A machine held by a job is the job's to end."""
    with transaction.atomic():
        instance = MachineInstance.objects.select_for_update().filter(pk=instance_id).first()
        if instance is None:
            raise DomainNotFound("instance not found")
        if claim_id is not None and instance.claim_id is not None and str(instance.claim_id) != str(claim_id):
            raise Conflict("this machine is held by another claim", code=ErrorCode.CLAIM_MISMATCH)
        if instance.status != InstanceStatus.CLAIMED:
            if instance.end_cause == Cause.CLAIM_RELEASED:
                return instance  # a repeated release
            raise InvalidTransition("Instance", instance.pk, instance.status, "released")
        if instance.claimed_for.startswith("job:"):
            raise Conflict(
                "this machine runs a job; cancel the job to release it", code=ErrorCode.HELD_BY_JOB
            )
        return instance_terminate(
            instance_id=instance.pk, actor=actor, reason="claim released", cause=Cause.CLAIM_RELEASED
        )


def instance_destroy(*, instance_id: InstanceId) -> None:
    """Body of the terminate task: delete the machine at the provider, then → terminated."""
    instance = MachineInstance.objects.select_related("provider_account").filter(pk=instance_id).first()
    if instance is None or instance.status != InstanceStatus.TERMINATING:
        return
    provider = provider_for(instance.provider_account)
    provider_id = instance.provider_id
    if not provider_id:  # created but not recorded yet (or never created): find it by label
        found = provider.find_by_instance(str(instance.pk), owner_labels())
        provider_id = found.provider_id if found else ""
    if provider_id:
        with contextlib.suppress(NotFound):
            provider.delete(provider_id)
    with transaction.atomic():
        ended = INSTANCE_STATES.try_move(
            instance.pk,
            to=InstanceStatus.TERMINATED,
            from_=[InstanceStatus.TERMINATING],
            actor=Actor.TERMINATOR,
        )
        if ended is None:
            return
        instance_gone(ended)


def instance_gone(instance: MachineInstance) -> None:
    """The machine no longer exists: a job still on it goes back to the queue (with the
    instance's ``end_cause``), its pool refills and the scheduler may buy a replacement."""
    hooks.machine_gone(
        instance_id=instance.pk,
        cause=Cause.of(instance.end_cause, Cause.MACHINE_TERMINATED),
        detail=instance.failure_reason,
    )
    if instance.pool_id:
        hooks.pool_member_left(instance.pool_id)
    hooks.machine_available(org_id=instance.org_id, machine_type_id=instance.machine_type_id)


def instance_mark_lost(
    *, instance_id: InstanceId, actor: Actor, reason: str, restart: bool = False
) -> MachineInstance | None:
    """The machine vanished or its agent went silent: → lost, requeue its job, destroy what is
    left of the machine (a silent machine may still be billing), and refill its pool.
    ``restart``: it ended with the previous run of the control plane (its event says so)."""
    with transaction.atomic():
        row = MachineInstance.objects.filter(pk=instance_id).values("pool_id").first()
        instance = INSTANCE_STATES.try_move(
            instance_id,
            to=InstanceStatus.LOST,
            from_=INSTANCE_LIVE,
            actor=actor,
            reason=reason,
            event=EventKind.POOL_MEMBER_LOST if row and row["pool_id"] else None,
            event_data={"restart": True} if restart else None,
            failure_reason=reason[:2000],
            end_cause=Cause.MACHINE_LOST,
        )
        if instance is None:
            return None
        hooks.machine_gone(instance_id=instance.pk, cause=Cause.MACHINE_LOST, detail=reason)
        enqueue_on_commit(
            DESTROY_MACHINE_TASK, str(instance.provider_account_id), instance.provider_id, str(instance.pk)
        )
    if instance.pool_id:
        hooks.pool_member_left(instance.pool_id)
    return instance


def machine_destroy(*, account_id: ProviderAccountId, provider_id: str, instance_id: str) -> None:
    """Delete a machine whose row already ended (lost): idempotent, by id or by label."""
    account = ProviderAccount.objects.get(pk=account_id)
    provider = provider_for(account)
    if not provider_id:
        found = provider.find_by_instance(instance_id, owner_labels())
        provider_id = found.provider_id if found else ""
    if provider_id:
        with contextlib.suppress(NotFound):
            provider.delete(provider_id)


def now() -> Any:
    return timezone.now()


def provider_facts(machine: ProviderMachine) -> dict[str, Any]:
    """What a provider's answer says about a machine, as instance row fields."""
    return {
        "provider_state": machine.raw_state[:32],
        "public_ip": machine.public_ip[:64],
        "private_ip": machine.private_ip[:64],
        "provider_checked_at": timezone.now(),
    }


def instance_refresh_provider_state(*, instance_id: InstanceId) -> bool:
    """Ask the provider about one live machine and record what it says (state, addresses).
    No transaction is open across the cloud call. Returns whether the row was updated."""
    row = (
        MachineInstance.objects.filter(pk=instance_id, status__in=INSTANCE_LIVE)
        .exclude(provider_id="")
        .select_related("provider_account")
        .first()
    )
    if row is None:
        return False
    try:
        machine = provider_for(row.provider_account).get(row.provider_id)
    except NotFound:
        return False  # the reconciler decides what a vanished machine means
    return bool(
        MachineInstance.objects.filter(pk=row.pk, status__in=INSTANCE_LIVE).update(**provider_facts(machine))
    )
