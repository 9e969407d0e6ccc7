"""Validation users expect from the catalog services."""

from __future__ import annotations

import pytest

from apps.control.services import grant_upsert
from apps.core.errors import MissingPrivilege, ValidationFailed
from apps.machines.services import machine_type_upsert, provider_account_upsert
from apps.orgs.models import Privilege
from apps.pools.services import pool_create
from tests.conftest import World

pytestmark = pytest.mark.django_db


def test_unknown_provider_kind_is_refused() -> None:
    with pytest.raises(ValidationFailed) as exc:
        provider_account_upsert(name="x", kind="openstack")
    assert exc.value.fields == {"kind": [exc.value.fields["kind"][0]]}
    assert "unknown provider kind" in exc.value.detail


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("price_per_hour", "-0.01"),
        ("price_per_hour", "abc"),
        ("cpus", 0),
        ("memory_mb", -5),
        ("billing_increment_seconds", 0),
        ("gpus", -1),
        ("disk_gb", 0),
        ("containers", "yes"),
        ("containers", 1),
        ("network", {"allow": ["cache.internal:3128"]}),
        ("network", {"allow": ["127.0.0.1"]}),
        ("network", {"allow": ["10.0.0.5:70000"]}),
        ("network", {"allow": "10.0.0.5:3128"}),
        ("network", {"deny": ["10.0.0.5"]}),
    ],
)
def test_machine_type_values_are_checked(world: World, field: str, value: object) -> None:
    fields = {"server_type": "cx22", "cpus": 2, "memory_mb": 2048, field: value}
    with pytest.raises(ValidationFailed) as exc:
        machine_type_upsert(name="bad", provider_account=world.account, **fields)
    assert field in exc.value.fields


def test_a_machine_type_needing_a_privilege_cannot_be_granted_without_it(world: World) -> None:
    gpu = Privilege.objects.create(name="gpu")
    mt, _ = machine_type_upsert(
        name="gpu-box",
        provider_account=world.account,
        required_privilege=gpu,
        server_type="g",
        cpus=8,
        memory_mb=32768,
        gpus=1,
    )
    with pytest.raises(MissingPrivilege):
        grant_upsert(org=world.org, machine_type=mt, max_instances=1)
    world.org.privileges.add(gpu)
    grant, created = grant_upsert(org=world.org, machine_type=mt, max_instances=1)
    assert created and grant.max_instances == 1


@pytest.mark.parametrize(
    ("sizes", "code"),
    [
        ({"target_size": 5, "min_size": 6, "max_size": 8}, "invalid_sizes"),
        ({"target_size": 9, "min_size": 0, "max_size": 8}, "invalid_sizes"),
        ({"target_size": 5, "min_size": 0, "max_size": 11}, "quota_exceeded"),
        ({"target_size": -1, "min_size": 0, "max_size": 1}, "invalid"),
    ],
)
def test_pool_sizes_must_be_ordered_and_within_quota(world: World, sizes: dict, code: str) -> None:
    with pytest.raises(ValidationFailed) as exc:
        pool_create(org=world.org, name="p", machine_type=world.machine_type, **sizes)
    assert exc.value.code == code
    assert not world.org.pools.exists()


def test_a_valid_pool_starts_warming_with_an_event(world: World) -> None:
    from apps.events.models import Event

    pool = pool_create(org=world.org, name="ci", machine_type=world.machine_type, target_size=3, max_size=5)
    assert (pool.status, pool.min_size, pool.target_size, pool.max_size) == ("warming", 0, 3, 5)
    assert Event.objects.filter(kind="pool.created", pool_id=pool.pk).exists()


def test_a_bad_network_allow_entry_is_refused_by_name(world: World) -> None:
    with pytest.raises(ValidationFailed) as exc:
        machine_type_upsert(
            name="lan",
            provider_account=world.account,
            server_type="cx22",
            cpus=2,
            memory_mb=2048,
            network={"allow": ["10.0.0.5:3128", "cache.internal:3128"]},
        )
    assert exc.value.status == 400 and exc.value.code == "invalid"
    assert "cache.internal:3128" in exc.value.fields["network"][0]
    assert "not a host name" in exc.value.fields["network"][0]


def test_network_allow_entries_are_kept_in_one_spelling(world: World) -> None:
    mt, _ = machine_type_upsert(
        name="lan",
        provider_account=world.account,
        server_type="cx22",
        cpus=2,
        memory_mb=2048,
        disk_gb=20,
        network={"allow": ["localhost:8765", "10.0.0.0/24", "10.0.0.5:3128", "10.0.0.5:3128"]},
    )
    assert mt.network == {"allow": ["10.0.0.0/24", "10.0.0.5:3128", "127.0.0.1:8765"]}
    assert mt.disk_gb == 20
    same = {"allow": ["10.0.0.5:3128", "10.0.0.0/24", "127.0.0.1:8765"]}
    _, changed = machine_type_upsert(name="lan", provider_account=world.account, network=same)
    assert not changed  # the same list, written another way, is no change
