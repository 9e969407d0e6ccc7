from __future__ import annotations

from django.db.models import Prefetch, QuerySet

from apps.machines.models import MachineType, OrgMachineType
from apps.orgs.models import Organization


def machine_types_for_org(*, org: Organization) -> QuerySet[MachineType]:
    """Machine types granted to ``org``, each with ``org_grants`` = [its grant]."""
    return (
        MachineType.objects.filter(grants__org=org)
        .select_related("provider_account", "required_privilege")
        .prefetch_related(
            Prefetch("grants", queryset=OrgMachineType.objects.filter(org=org), to_attr="org_grants")
        )
    )
