"""Azure end to end: a real Celery worker and beat buy a pool's machine and a job's machine on
Azure Virtual Machines through the real azure-identity and azure-mgmt-compute clients against the
fake Azure Resource Manager (tests/fakes/azure_arm.py, over TLS, with its long-running
operations and its token endpoint); their agents enrol, the job takes the pool's ready machine,
and a machine's end deletes its VM with its disk, NIC and public IP (nothing left billing)."""

from __future__ import annotations

from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from apps.jobs.models import Job
from apps.machines.models import MachineInstance
from apps.pools.services import pool_create
from catacloud.providers import LABEL_INSTANCE, LABEL_POOL
from catacloud.providers.azure import tag_name
from testkit.builders import enroll, granted_type, job_config, provider_account
from testkit.processes import wait_for
from tests.conftest import World
from tests.e2e.conftest import cloud_control_plane
from tests.fakes.azure_arm import FakeAzure

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def azure() -> Iterator[FakeAzure]:
    with FakeAzure() as fake:
        fake.lro_polls, fake.lro_seconds = 2, 2.0  # an operation ends after 2 polls or 2 s
        yield fake


def test_a_pool_and_a_job_on_azure(tworld: World, live_server: Any, tmp_path: Path, azure: FakeAzure) -> None:
    account = provider_account(
        "azure",
        "azure",
        azure.provider_config(poll_interval=0.05, max_attempts=2, retry_backoff=0.05),
        credentials=azure.credentials(),
    )
    mt, _ = granted_type(
        tworld.org,
        account,
        "d2as",
        server_type="Standard_D2as_v5",
        image="Canonical:ubuntu-24_04-lts:server:latest",
        cpus=2,
        memory_mb=8192,
        price_per_hour=Decimal("0.086"),
        billing_increment_seconds=1,
        grant={"max_instances": 3, "max_pool_size": 2},
    )
    with cloud_control_plane(live_server, tmp_path):
        pool = pool_create(org=tworld.org, name="warm", machine_type=mt, target_size=1, max_size=1)
        member = wait_for(
            lambda: MachineInstance.objects.filter(pool=pool, status="warming").first(),
            30,
            "the pool's VM made",
        )
        vm = azure.vm(member.provider_id)
        assert vm is not None and vm["name"] == f"cc-{member.pk}"
        assert vm["tags"][tag_name(LABEL_INSTANCE)] == str(member.pk)  # catacloud:instance
        assert vm["tags"][tag_name(LABEL_POOL)] == str(pool.pk)
        agent, _ = enroll(member)
        assert agent.post("/api/agent/v1/heartbeat", {}, format="json").status_code == 200
        wait_for(lambda: MachineInstance.objects.filter(pk=member.pk, status="ready").exists(), 20, "ready")

        config = job_config(tworld.org, mt, "on-azure", "true")
        answer = tworld.client("member").post("/api/v1/jobs/", {"config": config.name}, format="json")
        assert answer.status_code == 201, answer.content
        wait_for(
            lambda: Job.objects.filter(pk=answer.json()["id"], instance=member, status="assigned").exists(),
            20,
            "the job on the pool's Azure machine",
        )

        # The machine ends: its VM goes, and with it everything Azure bills for it.
        terminated = tworld.client("admin").post(f"/api/v1/instances/{member.pk}/terminate/")
        assert terminated.status_code == 202, terminated.content
        wait_for(lambda: azure.tick() or azure.vm(member.provider_id) is None, 30, "the VM deleted")

        def its_own() -> list[str]:  # (the pool's replacement VM has its own)
            return [name for names in azure.leftovers().values() for name in names if str(member.pk) in name]

        wait_for(lambda: azure.tick() or not its_own(), 10, "its disk, NIC and IP deleted")
