"""Images on the control plane's side: placement prefers a machine holding the job's image, a
pool's images reach its members at enrollment (and a change makes them outdated), the job's
payload names the digest its first attempt resolved and the organization's credentials for
that registry only, and an agent that cannot run images never gets an image job."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from apps.events.models import Event
from apps.jobs.choices import JobStatus
from apps.jobs.models import Job
from apps.jobs.selectors import job_payload
from apps.jobs.submission import job_submit
from apps.machines.models import MachineInstance
from apps.orgs.registries import registry_credential_set
from apps.pools.services import pool_create, pool_refill, pool_update
from testkit.builders import enroll, idle_machine, job_config, job_row, warming_instance
from tests.conftest import World
from tests.jobs.common import refresh, setup_type

pytestmark = pytest.mark.django_db
IMAGE = "registry.example.com/team/tool:1"
DIGEST = "sha256:" + "c" * 64


def test_placement_prefers_the_idle_machine_that_holds_the_jobs_image(world: World) -> None:
    mt, _ = setup_type(world)
    cfg = job_config(world.org, mt, "a", "true", image=IMAGE)
    same_config = idle_machine(world.org, mt, last_config=cfg, provider_id="f-1")
    holder = idle_machine(
        world.org, mt, images=[IMAGE, f"registry.example.com/team/tool@{DIGEST}"], provider_id="f-2"
    )
    MachineInstance.objects.filter(pk=same_config.pk).update(ready_at=timezone.now() - timedelta(minutes=5))
    job = job_submit(org=world.org, config=cfg)
    from apps.jobs.scheduler import schedule

    schedule()
    refresh(job)
    assert job.status == JobStatus.ASSIGNED and job.instance_id == holder.pk


def test_a_pools_images_reach_its_members_at_enrollment_and_a_change_rolls_them(world: World) -> None:
    pool = pool_create(
        org=world.org,
        name="hot",
        machine_type=world.machine_type,
        target_size=1,
        max_size=2,
        images=[IMAGE, "debian:12"],
    )
    assert pool.images == [IMAGE, "docker.io/library/debian:12"]
    registry_credential_set(org=world.org, registry="registry.example.com", username="u", password="p-secret")
    member = warming_instance(world.org, world.machine_type, pool=pool)
    enroll(member)
    member.refresh_from_db()
    assert member.pool_images_version == pool.images_version
    from rest_framework.test import APIClient

    from apps.machines.lifecycle import bootstrap_token_for

    other = warming_instance(world.org, world.machine_type, pool=pool)
    body = APIClient().post(
        "/api/agent/v1/enroll", {"bootstrap_token": bootstrap_token_for(other.pk)}, format="json"
    )
    images = body.json()["images"]
    assert [i["reference"] for i in images] == [IMAGE, "docker.io/library/debian:12"]
    assert images[0]["auth"] == {"username": "u", "password": "p-secret"} and images[1]["auth"] is None
    assert body.json()["image_store_bytes"] == world.machine_type.image_cache_mb * 10**6

    MachineInstance.objects.filter(pool=pool).update(status="ready", ready_at=timezone.now())
    pool_update(pool=pool, images=["registry.example.com/team/tool:2"], actor="test")
    pool_refill(pool_id=pool.pk)
    assert set(MachineInstance.objects.filter(pool=pool, outdated=True).values_list("pk", flat=True)) == {
        member.pk,
        other.pk,
    }
    assert Event.objects.filter(
        pool_id=pool.pk, kind="pool.updated", data__images=["registry.example.com/team/tool:2"]
    ).exists()


def test_the_payload_pins_the_resolved_digest_and_carries_only_that_registrys_credentials(
    world: World,
) -> None:
    cfg = job_config(world.org, world.machine_type, "a", "true", image=IMAGE)
    registry_credential_set(org=world.org, registry="registry.example.com", username="u", password="p-secret")
    registry_credential_set(org=world.org, registry="other.example.com", username="x", password="x-secret")
    registry_credential_set(
        org=world.other_org, registry="registry.example.com", username="r", password="rival"
    )
    job = job_row(cfg, status="assigned", image=IMAGE)
    image = job_payload(job)["image"]
    assert image["reference"] == IMAGE and image["auth"] == {"username": "u", "password": "p-secret"}
    job.image_digest = DIGEST
    image = job_payload(job)["image"]
    assert image["reference"] == f"registry.example.com/team/tool@{DIGEST}"  # a retry runs exactly it
    plain = job_row(job_config(world.org, world.machine_type, "b", "true"), status="assigned")
    assert job_payload(plain)["image"] is None
    assert job_payload(plain)["containers"] is False
    world.machine_type.containers = True  # the type's setting reaches the agent with each job
    world.machine_type.save(update_fields=["containers"])
    plain.refresh_from_db()
    assert job_payload(plain)["containers"] is True


def image_job_polled_by(world: World, machine: dict[str, Any] | None) -> Job:
    """An image job assigned to a machine whose agent enrolled with ``machine`` (its report),
    after that agent's poll."""
    instance = warming_instance(world.org, world.machine_type)
    client, _ = enroll(instance, **({"machine": machine} if machine is not None else {}))
    MachineInstance.objects.filter(pk=instance.pk).update(status="claimed")
    job = job_row(
        job_config(world.org, world.machine_type, "a", "true", image=IMAGE),
        status="assigned",
        instance=instance,
        image=IMAGE,
    )
    assert client.get("/api/agent/v1/work?wait=0").status_code == 204
    job.refresh_from_db()
    return job


def test_an_agent_that_cannot_run_images_never_gets_an_image_job(world: World) -> None:
    job = image_job_polled_by(world, None)  # an agent from before images: its report has no "images"
    assert (job.status, job.failure_code) == (JobStatus.FAILED, "image_unusable")
    assert "upgrade catacloud-agent" in job.failure_reason


def test_an_image_job_on_a_machine_without_the_sandbox_fails_saying_why(world: World) -> None:
    """The uid-only fallback runs no image (the store's root is closed to every other uid): the
    job's reason is the machine's own, not an upgrade hint that would not help."""
    said = "this machine cannot run images: its jobs run without the bubblewrap sandbox"
    job = image_job_polled_by(world, {"isolation": {"jobs": "uid", "images": "", "images_detail": said}})
    assert (job.status, job.failure_code) == (JobStatus.FAILED, "image_unusable")
    assert "without the bubblewrap sandbox" in job.failure_reason and "upgrade" not in job.failure_reason


def test_the_job_records_its_digest_and_the_pull(world: World) -> None:
    instance = warming_instance(world.org, world.machine_type)
    client, _ = enroll(instance, machine={"isolation": {"images": "skopeo+umoci"}})
    job = job_row(
        job_config(world.org, world.machine_type, "a", "true", image=IMAGE),
        status="running",
        instance=instance,
        image=IMAGE,
    )
    report = {
        "pulls": [{"reference": IMAGE, "digest": DIGEST, "pulled": True, "bytes": 1234, "seconds": 0.5}],
        "held": [{"digest": DIGEST, "references": [IMAGE], "bytes": 5000}],
    }
    bad = client.post(
        f"/api/agent/v1/jobs/{job.pk}/image", {"pulls": [{"reference": IMAGE, "digest": "x"}]}, format="json"
    )
    assert bad.status_code == 400
    assert client.post(f"/api/agent/v1/jobs/{job.pk}/image", report, format="json").status_code == 200
    job.refresh_from_db()
    instance.refresh_from_db()
    assert job.image_digest == DIGEST and set(instance.images) == {IMAGE, DIGEST}
    pulled = Event.objects.get(job_id=job.pk, kind="job.image_pulled")
    assert pulled.data["bytes"] == 1234 and pulled.data["digest"] == DIGEST
