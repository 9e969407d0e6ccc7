"""Reads of the jobs app that other layers ask for (through hooks) or show."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from apps.core.ids import MachineTypeId, OrgId
from apps.jobs.artifacts import checkpoint_info
from apps.jobs.choices import JobStatus
from apps.jobs.models import Job
from apps.resources.selectors import resource_endpoints


def job_cost_keys(job_ids: Iterable[str]) -> dict[str, dict[str, str | None]]:
    """{job id: {config, repository, workflow}}: what cost reports group a job's share by
    (the cost reports of ``apps.billing``; the attribution names jobs by their ids as strings)."""
    rows = Job.objects.filter(pk__in=job_ids).values_list("pk", "config__name", "labels")
    return {
        str(pk): {"config": name, "repository": labels.get("repository"), "workflow": labels.get("workflow")}
        for pk, name, labels in rows
    }


def jobs_waiting(*, org_id: OrgId, machine_type_id: MachineTypeId) -> int:
    """How many jobs of this grant wait for a machine (``hooks.jobs_waiting``: a pool's refill
    leaves them the machines outside pools)."""
    return Job.objects.filter(
        org_id=org_id, machine_type_id=machine_type_id, status=JobStatus.WAITING_FOR_MACHINE
    ).count()


def job_network(job: Job) -> dict[str, Any]:
    """What a job may reach besides the internet: its machine type's allow list and where the
    resources it holds live."""
    allow = [*(job.machine_type.network or {}).get("allow", []), *resource_endpoints(job_id=job.pk)]
    return {"allow": sorted(set(allow))} if allow else {}


def job_payload(job: Job) -> dict[str, Any]:
    """What an agent is handed to run ``job`` (``GET work``): its command, env (secrets on top,
    their names to mask), timeout, attempt, resources and checkpoint."""
    return {
        "id": str(job.pk),
        "command": job.command,
        # Plain env, then the secret values (the configuration's, then the job's own) on top.
        "env": {**job.env, **(secret := job.all_secret_env())},
        # The agent masks these values in the job's output (and its own log).
        "secret_env_names": sorted(secret),
        "timeout_seconds": job.timeout_seconds,
        "attempt": job.attempt,
        "resources": list(job.resources.values_list("resource_type_id", flat=True)),
        "checkpoint": checkpoint_info(job),
        # What the job may reach besides the internet, and the disk it may fill: its machine
        # type's (catacloud/agent/netns.py, catacloud/agent/disk.py).
        "network": job_network(job),
        "disk_limit_bytes": job.machine_type.disk_gb * 10**9 if job.machine_type.disk_gb else None,
    }
