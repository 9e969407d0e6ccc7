from __future__ import annotations

from dataclasses import dataclass

from django.db.models import Count, Prefetch, Q, QuerySet

from apps.core.ids import OrgId
from apps.machines.choices import INSTANCE_COUNTED, InstanceStatus
from apps.machines.models import Host, MachineInstance, MachineType, OrgMachineType, ProviderAccount
from apps.orgs.models import Organization

BOOTING = (InstanceStatus.PENDING, InstanceStatus.PROVISIONING, InstanceStatus.WARMING)


def machine_types_for_org(*, org: Organization) -> QuerySet[MachineType]:
    """Machine types granted to ``org``, each with ``org_grants`` = [its grant]."""
    return (
        MachineType.objects.filter(grants__org=org)
        .select_related("provider_account", "required_privilege")
        .prefetch_related(
            Prefetch("grants", queryset=OrgMachineType.objects.filter(org=org), to_attr="org_grants")
        )
    )


@dataclass(frozen=True)
class PaidCapacity:
    """Everything one organization pays for of one machine type, by what it can do next.
    Read without row locks: a row another transaction holds at this instant (a heartbeat,
    a commit in flight) is counted where it stands, never skipped."""

    counted: int  # every machine that costs money (terminating too): against max_instances
    idle: int  # ready outside every pool, current version: jobs take these first
    booting: int  # booting outside every pool: bought for jobs, not ready yet
    pool_ready: int  # ready pool members: jobs take these next (outside callers too)
    pool_booting: int  # booting pool members
    busy: int  # held by jobs: those of reusable jobs come back when the job ends


def paid_capacity(*, org_id: OrgId, machine_type: MachineType) -> PaidCapacity:
    """The one view of paid capacity placement and pool refills decide with (one query)."""
    outside, inside = Q(pool__isnull=True), Q(pool__isnull=False)
    ready, booting = Q(status=InstanceStatus.READY), Q(status__in=BOOTING)
    counts = MachineInstance.objects.filter(
        org_id=org_id, machine_type=machine_type, status__in=INSTANCE_COUNTED
    ).aggregate(
        counted=Count("id"),
        idle=Count("id", filter=outside & ready & Q(machine_type_version=machine_type.version)),
        booting=Count("id", filter=outside & booting),
        pool_ready=Count("id", filter=inside & ready),
        pool_booting=Count("id", filter=inside & booting),
        busy=Count("id", filter=Q(status=InstanceStatus.CLAIMED, claimed_for__startswith="job:")),
    )
    return PaidCapacity(**counts)


# ---- enrolled hosts, as an organization sees them ------------------------------------------------


def host_accounts_for_org(*, org: Organization) -> QuerySet[ProviderAccount]:
    """Provider accounts on which ``org`` holds a grant of a machine type (any kind): the ones
    whose shared hosts it sees, and, of kind ``hosts``, the ones it may enroll hosts on."""
    return ProviderAccount.objects.filter(
        pk__in=MachineType.objects.filter(grants__org=org).values("provider_account_id")
    )


def hosts_for_org(*, org: Organization) -> QuerySet[Host]:
    """The hosts ``org`` sees: its own, and the shared ones (enrolled by the operator) of an
    account where it holds a grant of a machine type; never another organization's."""
    shared = Q(org__isnull=True, provider_account_id__in=host_accounts_for_org(org=org).values("pk"))
    return Host.objects.filter(Q(org=org) | shared).select_related("org", "provider_account")
