"""A provider's capacity error falls over in seconds: a real Celery worker and beat, the real
hcloud client against the fake Hetzner API and the real boto3 against moto (behind a proxy that
answers EC2's InsufficientInstanceCapacity for a sold-out type and zone). The first candidate
refuses; the job's machine is bought of the second within 5 s of the refusal (not after a
scheduler tick or a retry's backoff); the first cools down and is bought again after it."""

from __future__ import annotations

import time
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from apps.events.models import Event
from apps.jobs.models import Job
from apps.machines.models import MachineInstance, MachineType
from testkit.builders import enroll, granted_type, job_config, provider_account
from testkit.processes import wait_for
from testkit.servers import Ec2Capacity, moto_client, moto_server
from tests.conftest import HETZNER_TOKEN, World
from tests.e2e.conftest import cloud_control_plane
from tests.fakes.hetzner_api import FakeHetzner

pytestmark = pytest.mark.django_db(transaction=True)

COOLDOWN = 6.0  # CATACLOUD_CAPACITY_COOLDOWN for the worker (180 s by default)
FALLOVER_WITHIN = 5.0  # the bound: the next candidate's create this soon after the error


def submit(world: World, config_name: str) -> Job:
    answer = world.client("member").post("/api/v1/jobs/", {"config": config_name}, format="json")
    assert answer.status_code == 201, answer.content
    return Job.objects.get(pk=answer.json()["id"])


def falls_over(
    world: World,
    first: MachineType,
    second: MachineType,
    refusals: Callable[[], list[float]],
    launched: Callable[[str], bool],
) -> None:
    """The scenario, for any provider: ``refusals()`` the times the cloud refused ``first``;
    ``launched(location)`` whether the cloud made a machine there."""
    config = job_config(world.org, first, "build", "true")
    job = submit(world, config.name)
    wait_for(lambda: refusals(), 20, "the cloud's capacity error for the first candidate", interval=0.02)
    refused_at = refusals()[0]
    wait_for(lambda: launched(second.location), 20, "a machine of the second candidate", interval=0.02)
    fell_over_in = time.time() - refused_at
    assert fell_over_in <= FALLOVER_WITHIN, (
        f"the next candidate was bought {fell_over_in:.1f} s after the error"
    )

    job.refresh_from_db()
    assert job.machine_type_id == second.pk
    moved = Event.objects.get(job_id=job.pk, kind="job.fell_over")
    assert (moved.data["from"], moved.data["to"]) == (first.name, second.name)
    assert "capacity" in moved.reason or "capacity" in job.pending_reason or moved.data["error"]
    first.refresh_from_db()
    assert first.capacity_cooling_until is not None and "insufficient_capacity" in first.capacity_error
    assert not launched(first.location), "nothing of a cooling type is bought"

    # The machine of the second candidate boots: its agent enrols and beats; the job is its.
    machine = wait_for(
        lambda: MachineInstance.objects.filter(machine_type=second, status="warming").first(),
        20,
        "the second candidate's machine warming",
    )
    agent, _ = enroll(machine)
    assert agent.post("/api/agent/v1/heartbeat", {}, format="json").status_code == 200
    wait_for(
        lambda: Job.objects.filter(pk=job.pk, instance=machine, status="assigned").exists(),
        20,
        "the job assigned to the second candidate's machine",
    )

    # After the cool-down the first (cheaper) candidate is bought again.
    first.refresh_from_db()
    assert first.capacity_cooling_until is not None
    time.sleep(max(0.0, (first.capacity_cooling_until.timestamp() - time.time()) + 0.2))
    later = submit(world, config.name)
    assert later.machine_type_id == first.pk
    wait_for(lambda: launched(first.location), 20, "a machine of the first candidate after its cool-down")


def test_hetzner_capacity_error_falls_over_to_the_next_location_and_cools_down(
    tworld: World, live_server: Any, tmp_path: Path, fake_hetzner: FakeHetzner
) -> None:
    fake_hetzner.reset()
    account = provider_account(
        "hetzner",
        "hz",
        {"api_endpoint": fake_hetzner.url, "location": "fsn1", "poll_interval": 0.05, "timeout": 5},
        credentials={"token": HETZNER_TOKEN},
    )
    common = {
        "server_type": "cx23",
        "image": "ubuntu-24.04",
        "memory_mb": 4096,
        "grant": {"max_instances": 5},
    }
    first, _ = granted_type(
        tworld.org, account, "cx23-fsn1", location="fsn1", price_per_hour=Decimal("0.006"),
        alternatives=["cx23-nbg1"], **common,
    )  # fmt: skip
    second, _ = granted_type(
        tworld.org, account, "cx23-nbg1", location="nbg1", price_per_hour=Decimal("0.0065"), **common
    )
    fake_hetzner.sell_out("cx23", "fsn1")

    def launched(location: str) -> bool:
        return any(s["location"]["name"] == location for s in list(fake_hetzner.servers.values()))

    def refusals() -> list[float]:
        return [at for _, _, at in fake_hetzner.capacity_refusals]

    with cloud_control_plane(live_server, tmp_path, cooldown=COOLDOWN):
        # restocked once refused: only the cool-down keeps the type unused
        def refused_then_restocked() -> list[float]:
            if fake_hetzner.capacity_refusals:
                fake_hetzner.sell_out("cx23", "fsn1", sold_out=False)
            return refusals()

        falls_over(tworld, first, second, refused_then_restocked, launched)


def test_ec2_insufficient_capacity_falls_over_to_the_next_zone_and_cools_down(
    tworld: World, live_server: Any, tmp_path: Path
) -> None:
    with moto_server() as moto_url:
        ec2 = Ec2Capacity(moto_url)
        try:
            ami = moto_client("ec2", moto_url, "eu-central-1").describe_images(Owners=["amazon"])["Images"][0]
            account = provider_account(
                "aws",
                "aws",
                {"region": "eu-central-1", "endpoint_url": ec2.url, "max_attempts": 1},
                credentials={"access_key_id": "test", "secret_access_key": "test"},
            )
            common = {
                "server_type": "t3.micro",
                "image": ami["ImageId"],
                "memory_mb": 1024,
                "billing_increment_seconds": 1,
                "min_billed_seconds": 60,
                "grant": {"max_instances": 5},
            }
            first, _ = granted_type(
                tworld.org, account, "t3-a", location="eu-central-1a", price_per_hour=Decimal("0.0104"),
                alternatives=["t3-b"], **common,
            )  # fmt: skip
            second, _ = granted_type(
                tworld.org,
                account,
                "t3-b",
                location="eu-central-1b",
                price_per_hour=Decimal("0.0110"),
                **common,
            )
            ec2.sell_out("t3.micro", "eu-central-1a")

            def refused_then_restocked() -> list[float]:
                if ec2.refusals:
                    ec2.sell_out("t3.micro", "eu-central-1a", sold_out=False)
                return [at for _, _, at in ec2.refusals]

            def launched(zone: str) -> bool:
                return any(z == zone for _, z, _ in ec2.launches)

            with cloud_control_plane(live_server, tmp_path, cooldown=COOLDOWN):
                falls_over(tworld, first, second, refused_then_restocked, launched)
        finally:
            ec2.close()
