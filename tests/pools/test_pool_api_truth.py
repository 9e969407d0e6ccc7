"""The pool and instance answers tell the truth: counts agree with members, a pool short of
ready members never reads ready, updated_at moves, provider_state follows the provider, and an
acquire says how to reach the machine."""

from __future__ import annotations

import pytest
from django.utils import timezone

from apps.machines import lifecycle
from apps.machines.api.serializers import instance_access
from apps.machines.choices import InstanceStatus
from apps.machines.models import MachineInstance, MachineType, ProviderAccount
from apps.machines.reconcile import reconcile_account
from apps.pools.models import InstancePool
from apps.pools.services import pool_claim, pool_create, pool_refill, pool_update
from catacloud.providers.fake import FakeProvider
from tests.concurrency import in_threads
from tests.conftest import World
from tests.pools.test_pools import ready_members

pytestmark = pytest.mark.django_db
S = InstanceStatus


@pytest.fixture
def fake_type(world: World) -> MachineType:
    FakeProvider.reset()
    account = ProviderAccount.objects.create(
        name="fake", kind="fake", config={"account": "truth", "initial_state": "provisioning"}
    )
    mt = MachineType.objects.create(
        name="f1", provider_account=account, server_type="cx22", location="fsn1", cpus=2, memory_mb=2048
    )
    world.org.machine_type_grants.create(machine_type=mt, max_pool_size=20, max_instances=20)
    return mt


def _pool(world: World, mt: MachineType, target: int = 3) -> InstancePool:
    return pool_create(org=world.org, name="ci", machine_type=mt, target_size=target, max_size=6)


def test_member_count_is_every_member_listed_including_claimed_ones(world: World, fake_type) -> None:
    pool = _pool(world, fake_type)
    ready_members(pool, 3)
    pool_claim(pool_id=pool.pk, acquired_by="runner")
    body = world.client("viewer").get(f"/api/v1/pools/{pool.pk}/").json()
    assert body["member_count"] == len(body["members"]) == 3
    assert body["counts"] == {"ready": 2, "claimed": 1}
    assert body["ready_count"] == 2
    listed = world.client("viewer").get("/api/v1/pools/").json()["results"][0]
    assert listed["member_count"] == 3 and listed["counts"] == {"ready": 2, "claimed": 1}


def test_a_pool_short_of_ready_members_never_reads_ready(world: World, fake_type) -> None:
    pool = _pool(world, fake_type)
    members = ready_members(pool, 3)
    pool_refill(pool_id=pool.pk)
    assert InstancePool.objects.get(pk=pool.pk).status == "ready"
    # Terminate one; the refill that records "replenishing" runs after commit, elsewhere.
    assert world.client("admin").post(f"/api/v1/instances/{members[0].pk}/terminate/").status_code == 202
    body = world.client("viewer").get(f"/api/v1/pools/{pool.pk}/").json()
    assert body["ready_count"] == 2 and body["status"] == "replenishing", body
    # A claim likewise (it writes nothing to the pool row).
    pool_refill(pool_id=pool.pk)  # requests the replacement
    pending = MachineInstance.objects.filter(pool=pool, status=S.PENDING)
    pending.update(status=S.READY, ready_at=timezone.now())
    pool_refill(pool_id=pool.pk)
    assert world.client("viewer").get(f"/api/v1/pools/{pool.pk}/").json()["status"] == "ready"
    pool_claim(pool_id=pool.pk)
    assert world.client("viewer").get(f"/api/v1/pools/{pool.pk}/").json()["status"] == "replenishing"


def test_updated_at_moves_with_status_sizes_and_limits(world: World, fake_type) -> None:
    pool = _pool(world, fake_type)
    created = InstancePool.objects.get(pk=pool.pk).updated_at
    ready_members(pool, 3)
    pool_refill(pool_id=pool.pk)  # warming -> ready: a compare-and-set update()
    after_status = InstancePool.objects.get(pk=pool.pk).updated_at
    assert after_status > created
    pool_update(pool=pool, target_size=5)
    after_resize = InstancePool.objects.get(pk=pool.pk).updated_at
    assert after_resize > after_status
    # A limit recorded by the refill: max_instances 4 with 3 members and 2 wanted.
    world.org.machine_type_grants.filter(machine_type=fake_type).update(max_instances=4)
    pool_refill(pool_id=pool.pk)
    reread = InstancePool.objects.get(pk=pool.pk)
    assert reread.limit_reason.startswith("quota_exceeded") and reread.updated_at > after_resize
    body = world.client("viewer").get(f"/api/v1/pools/{pool.pk}/").json()
    assert body["updated_at"].startswith(reread.updated_at.isoformat()[:19])


def test_provider_state_follows_the_provider(world: World, fake_type) -> None:
    pool = _pool(world, fake_type, target=1)
    pool_refill(pool_id=pool.pk)
    instance = MachineInstance.objects.get(pool=pool)
    lifecycle.instance_provision(instance_id=instance.pk)
    instance.refresh_from_db()
    assert instance.provider_state == "provisioning" and instance.provider_checked_at is not None
    first_check = instance.provider_checked_at

    # The machine boots: asked again (as when it becomes ready), the row says what it is now.
    FakeProvider.set_state(instance.provider_id, "running", account="truth")
    assert lifecycle.instance_refresh_provider_state(instance_id=instance.pk)
    instance.refresh_from_db()
    assert instance.provider_state == "running" and instance.provider_checked_at > first_check

    # The reconciler (every reaper tick) records a change too.
    FakeProvider.set_state(instance.provider_id, "stopping", account="truth")
    reconcile_account(account=fake_type.provider_account)
    body = world.client("viewer").get(f"/api/v1/instances/{instance.pk}/").json()
    assert body["provider_state"] == "stopping" and body["access"]["provider_state"] == "stopping"


def test_acquire_answers_how_to_reach_the_machine(world: World, fake_type) -> None:
    account = fake_type.provider_account
    account.config = {**account.config, "ssh_user": "ubuntu"}
    account.save()
    pool = _pool(world, fake_type, target=1)
    ready_members(pool, 1, provider_id="fake-77", provider_state="running", public_ip="192.0.2.7")
    response = world.client("member").post(f"/api/v1/pools/{pool.pk}/acquire/", {}, format="json")
    assert response.status_code == 201, response.content
    access = response.json()["instance"]["access"]
    assert access == {
        **access,
        "host": "192.0.2.7",
        "public_ip": "192.0.2.7",
        "ssh_user": "ubuntu",
        "ssh": "ssh ubuntu@192.0.2.7",
        "provider": "fake",
        "provider_id": "fake-77",
        "provider_state": "running",
        "server_type": "cx22",
        "location": "fsn1",
    }
    # The same in the instance answer.
    instance_id = response.json()["instance"]["id"]
    detail = world.client("member").get(f"/api/v1/instances/{instance_id}/").json()["access"]
    assert detail == access


def test_access_defaults_per_provider(world: World, fake_type) -> None:
    hetzner = ProviderAccount(kind="hetzner", config={})
    aws = ProviderAccount(kind="aws", config={})
    local = ProviderAccount(kind="local", config={})
    mt = MachineType(server_type="cx22", location="fsn1")
    for account, user, ssh in (
        (hetzner, "root", "ssh root@198.51.100.4"),
        (aws, None, None),  # depends on the AMI: say so, never guess
        (local, None, None),
    ):
        row = MachineInstance(provider_account=account, machine_type=mt, public_ip="198.51.100.4")
        access = instance_access(row)
        assert (access["ssh_user"], access["ssh"]) == (user, ssh), account.kind
    assert instance_access(MachineInstance(provider_account=local, machine_type=mt))["host"] == "127.0.0.1"


@pytest.mark.django_db(transaction=True)
def test_deleting_a_drained_pool_while_a_member_finishes_terminating_is_no_deadlock(tworld: World) -> None:
    """README's walkthrough hit a 500 (deadlock detected): DELETE held the pool row and set its
    members' pool to NULL while a member's termination held that member and wanted the pool."""
    import threading
    import time

    from django.db import close_old_connections, transaction

    from apps.pools.services import pool_delete, pool_drain

    FakeProvider.reset()
    account = ProviderAccount.objects.create(name="fake", kind="fake", config={"account": "truth-d"})
    mt = MachineType.objects.create(name="f1", provider_account=account, server_type="f", cpus=1, memory_mb=1)
    tworld.org.machine_type_grants.create(machine_type=mt, max_pool_size=20, max_instances=20)
    pool = _pool(tworld, mt, target=1)
    (member,) = ready_members(pool, 1)
    pool_drain(pool=pool, terminate_members=True)
    errors: list[BaseException] = []
    member_locked = threading.Event()

    def finishing_termination() -> None:  # member row first, then the pool row
        try:
            with transaction.atomic():
                list(MachineInstance.objects.select_for_update().filter(pk=member.pk))
                member_locked.set()
                time.sleep(0.5)
                list(InstancePool.objects.select_for_update().filter(pk=pool.pk))
        except BaseException as exc:
            errors.append(exc)

    def delete() -> None:
        try:
            member_locked.wait(5)
            pool_delete(pool=pool)
        except BaseException as exc:
            errors.append(exc)

    in_threads(finishing_termination, delete)
    close_old_connections()
    assert errors == []
    assert not InstancePool.objects.filter(pk=pool.pk).exists()
    assert MachineInstance.objects.get(pk=member.pk).pool_id is None
