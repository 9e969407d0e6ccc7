"""Reads of the jobs app that other layers ask for (through hooks) or show."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from apps.core.ids import MachineTypeId, OrgId
from apps.jobs.artifacts import checkpoint_info
from apps.jobs.choices import JobStatus
from apps.jobs.models import Job
from apps.resources.selectors import job_resources
from catacloud.protocol import JobPayload, Network


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


def job_payload(job: Job) -> dict[str, Any]:
    """What an agent is handed to run ``job`` (``GET work``): catacloud.protocol's JobPayload."""
    secret = job.all_secret_env()
    resource_types, endpoints = job_resources(job_id=job.pk)
    mt = job.machine_type
    return JobPayload(
        id=str(job.pk),
        command=job.command,
        # Plain env, then the secret values (the configuration's, then the job's own) on top;
        # the agent masks their values in the job's output (and its own log).
        env={**job.env, **secret},
        secret_env_names=tuple(sorted(secret)),
        timeout_seconds=job.timeout_seconds,
        attempt=job.attempt,
        resources=tuple(resource_types),
        checkpoint=checkpoint_info(job),
        # What the job may reach besides the internet (its machine type's allow list, and where
        # the resources it holds live) and the disk it may fill (catacloud/agent/netns.py, disk.py).
        network=Network(allow=tuple(sorted({*(mt.network or {}).get("allow", []), *endpoints}))),
        disk_limit_bytes=mt.disk_gb * 10**9 if mt.disk_gb else None,
    ).to_json()
