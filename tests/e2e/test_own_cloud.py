"""An organization brings its own cloud: its admin adds a Hetzner account (the real ``hcloud``
client against the fake Hetzner API, reached at the address the operator's setting names) and a
machine type on it; a job of its own is bought there by a real Celery worker, its machine's
agent enrols and the job is assigned to it. Another organization sees none of it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from apps.jobs.models import Job
from apps.machines.models import MachineInstance
from catacloud.providers import LABEL_INSTANCE, LABEL_ORG
from testkit.builders import enroll
from testkit.processes import wait_for
from tests.conftest import HETZNER_TOKEN, World
from tests.e2e.conftest import cloud_control_plane
from tests.fakes.hetzner_api import FakeHetzner

pytestmark = pytest.mark.django_db(transaction=True)


def test_an_organizations_job_runs_on_its_own_hetzner_account(
    tworld: World, live_server: Any, tmp_path: Path, fake_hetzner: FakeHetzner
) -> None:
    fake_hetzner.reset()
    operators = {"hetzner": {"api_endpoint": fake_hetzner.url, "poll_interval": 0.05, "timeout": 5}}
    admin = tworld.client("admin")
    with cloud_control_plane(live_server, tmp_path, CATACLOUD_ORG_PROVIDER_SETTINGS=operators):
        account = admin.post(
            "/api/v1/provider-accounts/",
            {
                "name": "ours",
                "kind": "hetzner",
                "config": {"location": "nbg1"},
                "credentials": {"token": HETZNER_TOKEN},
            },
            format="json",
        )
        assert account.status_code == 201, account.content
        own = admin.post(
            "/api/v1/machine-types/",
            {
                "name": "ours-cx23",
                "provider_account": "ours",
                "server_type": "cx23",
                "image": "ubuntu-24.04",
                "cpus": 2,
                "memory_mb": 4096,
                "price_per_hour": "0.0080",
                "limits": {"max_instances": 2},
            },
            format="json",
        )
        assert own.status_code == 201, own.content
        config = admin.post(
            "/api/v1/job-configs/",
            {"name": "on-ours", "machine_type": "ours-cx23", "command": "true"},
            format="json",
        )
        assert config.status_code == 201, config.content
        submitted = tworld.client("member").post("/api/v1/jobs/", {"config": "on-ours"}, format="json")
        assert submitted.status_code == 201, submitted.content
        job = Job.objects.get(pk=submitted.json()["id"])

        server = wait_for(
            lambda: next(iter(list(fake_hetzner.servers.values())), None), 20, "a server in the org's account"
        )
        machine = MachineInstance.objects.get(machine_type__name="ours-cx23")
        assert server["labels"][LABEL_INSTANCE] == str(machine.pk)
        assert server["labels"][LABEL_ORG] == str(tworld.org.pk)
        assert server["location"]["name"] == "nbg1"
        warming = wait_for(
            lambda: MachineInstance.objects.filter(pk=machine.pk, status="warming").first(),
            20,
            "its machine warming",
        )
        agent, _ = enroll(warming)
        assert agent.post("/api/agent/v1/heartbeat", {}, format="json").status_code == 200
        wait_for(
            lambda: Job.objects.filter(pk=job.pk, instance=machine, status="assigned").exists(),
            20,
            "the job assigned to the machine in the org's own account",
        )

    rival = tworld.client("outsider")
    assert rival.get(f"/api/v1/machine-types/{own.json()['id']}/").status_code == 404
    assert rival.get(f"/api/v1/provider-accounts/{account.json()['id']}/").status_code == 404
    assert rival.get(f"/api/v1/instances/{machine.pk}/").status_code == 404
