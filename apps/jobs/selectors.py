"""Reads of the jobs app that other layers ask for (through hooks) or show."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from django.conf import settings
from django.db.models import Exists, OuterRef, QuerySet

from apps.core.ids import MachineTypeId, OrgId
from apps.jobs.artifacts import checkpoint_info, stored_checkpoint
from apps.jobs.choices import JobStatus
from apps.jobs.models import Job, JobConfiguration, needs_resources
from apps.machines.models import OrgMachineType
from apps.orgs.registries import registry_auth_for, registry_logins_for
from apps.resources.models import ResourceInstance
from apps.resources.selectors import job_resources
from catacloud.agent.reference import parse
from catacloud.protocol import ImagePull, JobPayload, Network, RegistryAuth, RegistryLogin


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


def configs_to_submit(org_id: OrgId) -> QuerySet[JobConfiguration]:
    """An organization's configurations with what a submit checks besides each one's row, in
    the statement that finds it: its machine type, whether the organization holds a grant of
    that type, whether it needs resources (most: none, and then nothing more is asked)."""
    return (
        JobConfiguration.objects.filter(org_id=org_id)
        .select_related("machine_type")
        .annotate(
            granted=Exists(
                OrgMachineType.objects.filter(
                    org_id=OuterRef("org_id"), machine_type_id=OuterRef("machine_type_id")
                )
            ),
            needs_resources=needs_resources(OuterRef("pk")),
        )
    )


def with_payload_facts(jobs: QuerySet[Job]) -> QuerySet[Job]:
    """``jobs`` with what :func:`job_payload` reads besides each job's row in the same statement:
    its configuration, its machine type, whether it has a stored checkpoint and whether it holds
    resources (most jobs: neither, and then nothing more is asked). The poll's hand-out is on
    every job's way to its first instruction."""
    return jobs.select_related("config", "machine_type").annotate(
        has_checkpoint=Exists(stored_checkpoint(OuterRef("pk"))),
        holds_resources=Exists(ResourceInstance.objects.filter(job=OuterRef("pk"))),
    )


def job_payload(job: Job) -> dict[str, Any]:
    """What an agent is handed to run ``job`` (``GET work``): catacloud.protocol's JobPayload.
    A job loaded :func:`with_payload_facts` costs no statement more here (unless it holds
    resources or has an image)."""
    secret = job.all_secret_env()
    holds = getattr(job, "holds_resources", True)
    resource_types, endpoints = job_resources(job_id=job.pk) if holds else ([], [])
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
        checkpoint=checkpoint_info(job, available=getattr(job, "has_checkpoint", None)),
        # What the job may reach besides the internet (its machine type's allow list, and where
        # the resources it holds live) and the disk it may fill (catacloud/agent/netns.py, disk.py).
        network=Network(allow=tuple(sorted({*(mt.network or {}).get("allow", []), *endpoints}))),
        disk_limit_bytes=mt.disk_gb * 10**9 if mt.disk_gb else None,
        image=job_image_pull(job),
        containers=mt.containers,
        registries=tuple(
            RegistryLogin(registry=host, username=user, password=password)
            for host, user, password in (registry_logins_for(org_id=job.org_id) if mt.containers else ())
        ),
        traceparent=job.traceparent,
        final_output=True,  # apps.jobs.reports.job_finished stores it
    ).to_json()


def image_pull(*, org_id: OrgId, reference: str) -> ImagePull:
    """What an agent is told to pull: the reference, the organization's credentials for its
    registry host (if it has some), the pull's deadline."""
    auth = registry_auth_for(org_id=org_id, reference=reference)
    return ImagePull(
        reference=reference,
        auth=RegistryAuth(username=auth[0], password=auth[1]) if auth else None,
        timeout_seconds=float(settings.CATACLOUD_IMAGE_PULL_TIMEOUT),
    )


def job_image_pull(job: Job) -> ImagePull | None:
    """The job's image: exactly the digest its first attempt resolved, once it has one (a tag
    that moved since changes nothing), else the reference it was submitted with."""
    if not job.image:
        return None
    reference = str(parse(job.image).pinned(job.image_digest)) if job.image_digest else job.image
    return image_pull(org_id=job.org_id, reference=reference)
