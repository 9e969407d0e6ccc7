"""The deadlock scenario with real workers: resource R/1 (max 1) and machine type T/1 (max 1
machine), jobs J/1 and J/2 each needing both, submitted together in random order, many times:
every run finishes both jobs."""

from __future__ import annotations

import random
import sys

import pytest

from apps.jobs.models import Job, JobConfiguration
from apps.machines.models import OrgMachineType
from apps.resources.models import ResourceInstance, ResourceType
from tests.e2e.conftest import Stack

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def test_two_jobs_needing_the_same_resource_and_machine_always_both_finish(stack: Stack) -> None:
    world = stack.world
    OrgMachineType.objects.filter(org=world.org, machine_type=world.machine_type).update(max_instances=1)
    ResourceType.objects.create(id="r1", well="api_token", max_instances=1)
    # Inside the job, the resource's metadata comes from the agent (job-meta), never from a file.
    command = f"{sys.executable} -m catacloud.agent job-meta r1 | grep -c api_url; sleep 0.5"
    configs = []
    for name in ("j1", "j2"):
        config = JobConfiguration.objects.create(
            org=world.org, name=name, machine_type=world.machine_type, command=command, timeout_seconds=60
        )
        config.resource_types.set(["r1"])
        configs.append(str(config.pk))
    rng = random.Random(11)
    member = stack.api("member")
    for run in range(4):
        rng.shuffle(configs)
        ids = [member.post("/api/v1/jobs/", {"config": c}, format="json").json()["id"] for c in configs]
        stack.wait(
            lambda ids=ids: all(Job.objects.get(pk=j).status == "succeeded" for j in ids),
            90,
            f"both jobs of run {run + 1} to finish",
        )
        for job_id in ids:
            text = stack.api("viewer").get(f"/api/v1/jobs/{job_id}/logs/").json()["text"]
            assert text.strip().startswith("1"), text  # job-meta printed the token's metadata
    stack.wait(
        lambda: not ResourceInstance.objects.exclude(status="destroyed").exists(),
        30,
        "every resource to be destroyed",
    )
    assert ResourceInstance.objects.count() == 8
