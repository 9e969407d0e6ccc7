"""Writes that must look across layers: ending a grant checks machines, pools and jobs."""

from __future__ import annotations

from django.db import transaction

from apps.core.errors import Conflict, ErrorCode
from apps.events.kinds import EventKind
from apps.events.services import event_record
from apps.jobs.choices import JOB_LIVE
from apps.jobs.models import Job
from apps.machines.choices import INSTANCE_LIVE
from apps.machines.models import MachineInstance, OrgMachineType
from apps.machines.services import grant_lock
from apps.orgs.models import Organization
from apps.pools.choices import PoolStatus
from apps.pools.models import InstancePool


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
def grant_delete(*, grant: OrgMachineType, actor: str = "") -> None:
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
