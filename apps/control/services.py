"""Grants, written in one place: granting a machine type to an org (with its quotas) and taking
it away, which must look across layers (machines, pools and jobs still using it)."""

from __future__ import annotations

from typing import Any

from django.db import transaction

from apps.core.actors import Actor
from apps.core.errors import Conflict, ErrorCode
from apps.events.kinds import EventKind
from apps.events.services import event_record
from apps.jobs.choices import JOB_LIVE
from apps.jobs.models import Job
from apps.machines.choices import INSTANCE_LIVE
from apps.machines.models import MachineInstance, MachineType, OrgMachineType
from apps.machines.services import grant_check_owner, grant_check_privilege, grant_clean_quota, grant_lock
from apps.orgs.models import Organization
from apps.pools.choices import PoolStatus
from apps.pools.models import InstancePool


@transaction.atomic
def grant_upsert(
    *, org: Organization, machine_type: MachineType, **quota: Any
) -> tuple[OrgMachineType, bool]:
    """Grant ``machine_type`` to ``org`` with the given quotas (create or update)."""
    grant_clean_quota(quota)
    grant_check_owner(org=org, machine_type=machine_type)
    grant_check_privilege(org=org, machine_type=machine_type)
    grant = grant_lock(org_id=org.pk, machine_type_id=machine_type.pk)
    if grant is None:
        grant = OrgMachineType.objects.create(org=org, machine_type=machine_type, **quota)
        event_record(
            kind=EventKind.ORG_GRANT_CREATED,
            org=org,
            actor=Actor.CATALOG,
            machine_type=machine_type.name,
            **quota,
        )
        return grant, True
    changed = {k: v for k, v in quota.items() if getattr(grant, k) != v}
    if changed:
        for k, v in changed.items():
            setattr(grant, k, v)
        grant.save()
        event_record(
            kind=EventKind.ORG_GRANT_UPDATED,
            org=org,
            actor=Actor.CATALOG,
            machine_type=machine_type.name,
            **changed,
        )
    return grant, bool(changed)


def in_use_summary(**scope: object) -> str:
    """What still depends on an org (or a grant): "" when nothing does."""
    machines = MachineInstance.objects.filter(status__in=INSTANCE_LIVE, **scope).count()
    pools = InstancePool.objects.filter(**scope).exclude(status=PoolStatus.DRAINED).count()
    jobs = Job.objects.filter(status__in=JOB_LIVE, **scope).count()
    parts = [
        f"{n} {what}" for n, what in ((machines, "live machines"), (pools, "pools"), (jobs, "live jobs")) if n
    ]
    return ", ".join(parts)


@transaction.atomic
def grant_delete(*, grant: OrgMachineType, actor: Actor = Actor.UNNAMED) -> None:
    """Take a machine type away from an org: refused (409 ``in_use``) while the org still has
    live machines, undrained pools or live jobs of it (drain, terminate or cancel first)."""
    locked = grant_lock(org_id=grant.org_id, machine_type_id=grant.machine_type_id)
    if locked is None:
        return
    used = in_use_summary(org_id=grant.org_id, machine_type_id=grant.machine_type_id)
    if used:
        raise Conflict(
            f"{grant} is still in use ({used}); drain, terminate or cancel first", code=ErrorCode.IN_USE
        )
    event_record(
        kind=EventKind.ORG_GRANT_DELETED, org=grant.org_id, actor=actor, machine_type=str(grant.machine_type)
    )
    OrgMachineType.objects.filter(pk=locked.pk).delete()


def org_in_use(*, org: Organization) -> str:
    return in_use_summary(org_id=org.pk)
