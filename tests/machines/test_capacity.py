"""Candidates: a job configuration's requirements choose the cheapest granted machine type that
meets them; a machine type's alternatives are candidates too; a provider's capacity error cools
a type down, its waiting jobs move to the next candidate, and nothing of it is bought (by
placement or a pool) until the cool-down ends. Services and task bodies are called directly;
the fake provider stands in for the cloud (the fall-over through a real worker against the fake
Hetzner API and moto is tests/e2e/test_capacity.py)."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.utils import timezone

from apps.events.models import Event
from apps.jobs.choices import JobStatus
from apps.jobs.models import JobConfiguration
from apps.jobs.scheduler import schedule
from apps.jobs.submission import job_submit
from apps.machines.choices import InstanceStatus
from apps.machines.models import MachineInstance, MachineType
from apps.machines.services import machine_type_upsert
from apps.machines.tasks import provision_instance_task
from apps.pools.models import InstancePool
from apps.pools.services import pool_create, pool_refill
from catacloud.providers import InsufficientCapacity
from catacloud.providers.fake import FakeProvider
from testkit.builders import granted_type, job_config, provider_account
from tests.conftest import World

pytestmark = pytest.mark.django_db

GRANT = {"max_concurrent_jobs": 50, "max_instances": 50, "max_pool_size": 5}


def sizes(world: World) -> dict[str, MachineType]:
    """Three sizes on the fake cloud, the bigger the dearer (the world's own ``small`` type, 2
    cpus at 0.01, is granted too)."""
    FakeProvider.reset()
    account = provider_account("fake", "fake", {"account": "sizes"})
    types = {}
    for name, cpus, memory, price in (
        ("c2", 2, 4096, "0.005"),
        ("c8", 8, 16384, "0.03"),
        ("c32", 32, 65536, "0.12"),
    ):
        types[name] = granted_type(
            world.org, account, name, cpus=cpus, memory_mb=memory, price_per_hour=Decimal(price), grant=GRANT
        )[0]
    return types


def post_config(world: World, name: str, **body: Any) -> Any:
    return world.client("admin").post(
        "/api/v1/job-configs/", {"name": name, "command": "true", **body}, format="json"
    )


def test_requirements_choose_the_cheapest_type_that_fits_and_too_much_is_a_400_naming_the_largest(
    world: World,
) -> None:
    sizes(world)
    for name, cpus, expected in (("two", 2, "c2"), ("six", 6, "c8"), ("thirty", 30, "c32")):
        answer = post_config(world, name, requirements={"cpus": cpus})
        assert answer.status_code == 201, answer.content
        assert answer.json()["machine_type_name"] == expected
        assert answer.json()["requirements"] == {"cpus": cpus}
        job = job_submit(org=world.org, config=JobConfiguration.objects.get(org=world.org, name=name))
        assert job.machine_type.name == expected

    memory = post_config(world, "roomy", requirements={"cpus": 1, "memory_mb": 10000})
    assert memory.json()["machine_type_name"] == "c8"

    too_big = post_config(world, "huge", requirements={"cpus": 64})
    assert too_big.status_code == 400, too_big.content
    assert too_big.json()["code"] == "no_machine_type_fits"
    assert "the largest is c32 (32 cpus" in too_big.json()["detail"]
    assert not JobConfiguration.objects.filter(name="huge").exists()

    for bad in ({"cores": 2}, {"cpus": -1}, {"cpus": "2"}, ["cpus"], {"cpus": True}):
        answer = post_config(world, "bad", requirements=bad)
        assert answer.status_code == 400, (bad, answer.content)
        assert answer.json()["code"] == "invalid"
    both = post_config(world, "both", requirements={"cpus": 2}, machine_type="c8")
    assert both.status_code == 400 and "machine_type" in both.json()["fields"]
    neither = post_config(world, "neither")
    assert neither.status_code == 400 and "machine_type" in neither.json()["fields"]
    empty = post_config(world, "empty", requirements={"labels": {}})  # states nothing
    assert empty.status_code == 400 and "machine_type" in empty.json()["fields"]
    # a configuration that states requirements names a type only once it states none
    admin, url = world.client("admin"), f"/api/v1/job-configs/{JobConfiguration.objects.get(name='six').pk}/"
    assert admin.patch(url, {"machine_type": "c32"}, format="json").status_code == 400
    named = admin.patch(url, {"machine_type": "c32", "requirements": {}}, format="json")
    assert named.status_code == 200 and named.json()["machine_type_name"] == "c32"


def test_requirements_may_ask_an_arch_and_labels(world: World) -> None:
    types = sizes(world)
    MachineType.objects.filter(pk=types["c8"].pk).update(labels={"disk": "nvme"})
    MachineType.objects.filter(pk=types["c32"].pk).update(
        arch="arm64", labels={"disk": "nvme", "gpu": "a4000"}
    )
    cases = (
        ({"cpus": 2, "labels": {"disk": "nvme"}}, "c8"),
        ({"cpus": 2, "arch": "arm64"}, "c32"),
        ({"labels": {"gpu": "a4000"}}, "c32"),
        ({"cpus": 2, "arch": "x86_64"}, "c2"),
    )
    for i, (requirements, expected) in enumerate(cases):
        answer = post_config(world, f"r{i}", requirements=requirements)
        assert answer.status_code == 201, answer.content
        assert answer.json()["machine_type_name"] == expected, requirements
    none = post_config(world, "none", requirements={"arch": "arm64", "labels": {"disk": "hdd"}})
    assert none.status_code == 400 and "arch arm64, labels disk=hdd" in none.json()["detail"]
    for bad in ({"arch": "sparc"}, {"labels": ["gpu"]}, {"labels": {"gpu": None}}):
        answer = post_config(world, "bad", requirements=bad)
        assert answer.status_code == 400 and answer.json()["code"] == "invalid", (bad, answer.content)


def test_a_type_another_org_may_not_use_is_no_candidate(world: World) -> None:
    types = sizes(world)
    types["c8"].grants.filter(org=world.org).delete()
    answer = post_config(world, "six", requirements={"cpus": 6})
    assert answer.json()["machine_type_name"] == "c32"  # c8 exists, but not for this org


def capacity_error(instance: MachineInstance) -> None:
    """The provider answers the machine's create with a capacity error (the task's body)."""
    FakeProvider.fail_next("create", InsufficientCapacity("no c8 left in this zone"))
    provision_instance_task.run(str(instance.pk))


def test_a_capacity_error_cools_the_type_and_its_waiting_job_falls_over_to_the_next_candidate(
    world: World,
) -> None:
    types = sizes(world)
    config = job_config(world.org, types["c8"], "six", "true", requirements={"cpus": 6})
    job = job_submit(org=world.org, config=config)
    schedule()
    bought = MachineInstance.objects.get(machine_type=types["c8"])
    capacity_error(bought)

    bought.refresh_from_db()
    types["c8"].refresh_from_db()
    assert bought.status == InstanceStatus.FAILED
    assert types["c8"].capacity_cooling_until > timezone.now() + timedelta(seconds=170)
    assert "insufficient_capacity: no c8 left" in types["c8"].capacity_error
    assert Event.objects.filter(kind="machine_type.capacity_error", data__machine_type="c8").exists()

    schedule()  # what the failure enqueued: the job moves on, and is placed on c32
    job.refresh_from_db()
    assert job.machine_type_id == types["c32"].pk
    moved = Event.objects.get(job_id=job.pk, kind="job.fell_over")
    assert (moved.data["from"], moved.data["to"]) == ("c8", "c32")
    assert moved.data["error"] == "insufficient_capacity: no c8 left in this zone"
    schedule()
    assert MachineInstance.objects.filter(machine_type=types["c32"]).count() == 1
    assert MachineInstance.objects.filter(machine_type=types["c8"]).count() == 1  # none bought again

    # A new job meanwhile skips the cooling type; after the cool-down it is the cheapest again.
    assert job_submit(org=world.org, config=config).machine_type_id == types["c32"].pk
    MachineType.objects.filter(pk=types["c8"].pk).update(capacity_cooling_until=timezone.now())
    assert job_submit(org=world.org, config=config).machine_type_id == types["c8"].pk


def test_machines_already_booting_keep_their_jobs_when_a_later_buy_hits_a_capacity_error(
    world: World,
) -> None:
    """Three jobs bought three machines; two were made, the third refused: two jobs wait for the
    two booting machines, only the third moves on (a machine nobody waits for is money lost)."""
    types = sizes(world)
    config = job_config(world.org, types["c8"], "six", "true", requirements={"cpus": 6})
    for _ in range(3):
        job_submit(org=world.org, config=config)
    schedule()
    bought = list(MachineInstance.objects.filter(machine_type=types["c8"]).order_by("created_at"))
    assert len(bought) == 3
    MachineInstance.objects.filter(pk__in=[m.pk for m in bought[:2]]).update(
        status=InstanceStatus.PROVISIONING
    )
    capacity_error(bought[2])
    schedule()
    schedule()
    on = sorted(MachineType.objects.get(pk=j.machine_type_id).name for j in JobConfiguration.objects.get(
        pk=config.pk).jobs.all())  # fmt: skip
    assert on == ["c32", "c8", "c8"]
    assert MachineInstance.objects.filter(machine_type=types["c32"]).count() == 1


def test_when_every_candidate_cools_the_job_waits_saying_so_and_buys_nothing(world: World) -> None:
    types = sizes(world)
    config = job_config(world.org, types["c32"], "thirty", "true", requirements={"cpus": 30})
    job = job_submit(org=world.org, config=config)
    schedule()
    capacity_error(MachineInstance.objects.get(machine_type=types["c32"]))
    schedule()
    schedule()
    job.refresh_from_db()
    assert job.status == JobStatus.WAITING_FOR_MACHINE
    assert job.pending_reason.startswith("every candidate is cooling down after a capacity error: c32 until ")
    assert MachineInstance.objects.filter(machine_type=types["c32"]).count() == 1


def test_alternatives_are_candidates_the_cheapest_first_spot_before_on_demand(world: World) -> None:
    types = sizes(world)
    account = types["c8"].provider_account
    spot, _ = granted_type(
        world.org,
        account,
        "c8-spot",
        cpus=8,
        memory_mb=16384,
        spot=True,
        price_per_hour=Decimal("0.01"),
        grant=GRANT,
    )
    MachineType.objects.filter(pk=types["c8"].pk).update(alternatives=["c8-spot", "missing", "c32"])
    config = job_config(world.org, MachineType.objects.get(pk=types["c8"].pk), "eight", "true")
    assert job_submit(org=world.org, config=config).machine_type_id == spot.pk  # the cheapest
    MachineType.objects.filter(pk=spot.pk).update(
        capacity_cooling_until=timezone.now() + timedelta(minutes=3)
    )
    assert job_submit(org=world.org, config=config).machine_type_id == types["c8"].pk  # on-demand
    shown = world.client("member").get("/api/v1/machine-types/", {"name": "c8-spot"}).json()["results"][0]
    assert shown["capacity_cooling_until"] is not None and shown["spot"] is True
    spot.grants.all().delete()
    MachineType.objects.filter(pk=spot.pk).update(capacity_cooling_until=None)
    assert job_submit(org=world.org, config=config).machine_type_id == types["c8"].pk  # not granted
    # The API names only the alternatives the caller's organization may use.
    shown = world.client("member").get("/api/v1/machine-types/", {"name": "c8"}).json()["results"][0]
    assert shown["alternatives"] == ["c32"]


def test_a_pool_of_a_cooling_type_buys_nothing_and_says_why(world: World) -> None:
    types = sizes(world)
    pool = pool_create(org=world.org, name="warm", machine_type=types["c2"], target_size=2, max_size=2)
    pool_refill(pool_id=pool.pk)
    members = list(MachineInstance.objects.filter(pool=pool))
    assert len(members) == 2
    capacity_error(members[0])
    requested = pool_refill(pool_id=pool.pk)
    pool.refresh_from_db()
    assert requested == 0
    assert pool.limit_reason.startswith("capacity_cooling: every candidate is cooling down")
    assert Event.objects.filter(kind="pool.capacity_cooling", pool_id=pool.pk).count() == 1
    MachineType.objects.filter(pk=types["c2"].pk).update(capacity_cooling_until=timezone.now())
    assert pool_refill(pool_id=pool.pk) == 1  # the cool-down ended: the member is replaced
    assert InstancePool.objects.get(pk=pool.pk).limit_reason == ""


def test_alternatives_are_checked_when_the_catalog_sets_them(world: World) -> None:
    account = provider_account("fake", "fake", {"account": "catalog"})
    from apps.core.errors import ValidationFailed

    with pytest.raises(ValidationFailed):
        machine_type_upsert(
            name="x", provider_account=account, server_type="f", cpus=1, memory_mb=1, alternatives="y"
        )
    mt, _ = machine_type_upsert(
        name="x", provider_account=account, server_type="f", cpus=1, memory_mb=1, alternatives=["y", "y", "z"]
    )
    assert mt.alternatives == ["y", "z"]
    version = mt.version
    mt, _ = machine_type_upsert(
        name="x", provider_account=account, server_type="f", cpus=1, memory_mb=1, alternatives=["z"]
    )
    assert mt.version == version  # a candidate list does not make machines outdated
