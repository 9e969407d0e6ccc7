"""Reads of the jobs app that other layers ask for (through hooks) or show."""

from __future__ import annotations

from collections.abc import Iterable

from apps.core.ids import MachineTypeId, OrgId
from apps.jobs.choices import JobStatus
from apps.jobs.models import Job


def job_config_names(job_ids: Iterable[str]) -> dict[str, str]:
    """{job id: its configuration's name} (``hooks.job_config_names``: cost reports, whose
    attribution names jobs by their ids as strings)."""
    rows = Job.objects.filter(pk__in=job_ids).values_list("pk", "config__name")
    return {str(pk): name for pk, name in rows}


def jobs_waiting(*, org_id: OrgId, machine_type_id: MachineTypeId) -> int:
    """How many jobs of this grant wait for a machine (``hooks.jobs_waiting``: a pool's refill
    leaves them the machines outside pools)."""
    return Job.objects.filter(
        org_id=org_id, machine_type_id=machine_type_id, status=JobStatus.WAITING_FOR_MACHINE
    ).count()
