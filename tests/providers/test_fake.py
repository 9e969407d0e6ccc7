"""The driver registry and the in-memory FakeProvider."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from catacloud.providers import (
    DRIVERS,
    LABEL_INSTALLATION,
    LABEL_INSTANCE,
    LABEL_POOL,
    InsufficientCapacity,
    MachineSpec,
    MachineState,
    NotFound,
    Provider,
    Transient,
    build_provider,
    get_driver_class,
)
from catacloud.providers.fake import FakeProvider


@pytest.fixture(autouse=True)
def clean_fake() -> Iterator[None]:
    FakeProvider.reset()
    yield
    FakeProvider.reset()


def make_spec(**labels: str) -> MachineSpec:
    instance_id = str(uuid.uuid4())
    return MachineSpec(
        instance_id=instance_id,
        labels={LABEL_INSTALLATION: "test", LABEL_INSTANCE: instance_id, **labels},
        server_type="small",
        image="img",
    )


def fake(account: str = "default", **config: str) -> Provider:
    return build_provider("fake", config={"account": account, **config}, credentials={})


# ---- registry -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(DRIVERS))
def test_every_registered_driver_loads_and_is_a_provider(kind: str) -> None:
    cls = get_driver_class(kind)
    assert issubclass(cls, Provider)
    assert cls.kind == kind
    assert f"{cls.__module__}.{cls.__name__}" == DRIVERS[kind]


def test_unknown_kind_is_a_value_error_naming_the_known_kinds() -> None:
    with pytest.raises(ValueError, match="unknown provider kind 'gcp'.*hetzner"):
        get_driver_class("gcp")


def test_build_provider_passes_config_and_credentials() -> None:
    provider = build_provider("fake", config={"account": "a1"}, credentials={"token": "x"})
    assert isinstance(provider, FakeProvider)
    assert provider.account == "a1"
    assert provider.credentials == {"token": "x"}


@pytest.mark.parametrize("kind", sorted(DRIVERS))
def test_every_driver_maps_unknown_raw_states_to_unknown(kind: str) -> None:
    cls = get_driver_class(kind)
    assert cls.map_state("no-such-state") is MachineState.UNKNOWN
    assert MachineState.RUNNING in cls.STATE_MAP.values()


# ---- fake provider --------------------------------------------------------------------------------


def test_create_is_idempotent_by_instance_id() -> None:
    spec = make_spec()
    first = fake().create(spec)
    again = fake().create(spec)  # another instance (another task), same account
    assert again.provider_id == first.provider_id
    assert len(FakeProvider.machines_of("default")) == 1
    assert first.name == f"cc-{spec.instance_id}"
    assert first.instance_id == spec.instance_id


def test_accounts_are_isolated_and_instances_share_state() -> None:
    spec = make_spec()
    fake("a").create(spec)
    assert [m.instance_id for m in fake("a").list({LABEL_INSTALLATION: "test"})] == [spec.instance_id]
    assert fake("b").list({LABEL_INSTALLATION: "test"}) == []


def test_calls_are_recorded_in_order() -> None:
    provider = fake("rec")
    spec = make_spec()
    machine = provider.create(spec)
    provider.get(machine.provider_id)
    provider.delete(machine.provider_id)
    calls = FakeProvider.calls_for("rec")
    assert [c.method for c in calls] == ["create", "get", "delete"]
    assert calls[0].arg == spec
    assert [c.arg for c in FakeProvider.calls_for("rec", "delete")] == [machine.provider_id]


def test_fail_next_raises_once_then_succeeds() -> None:
    FakeProvider.fail_next("create", InsufficientCapacity("no cx22 in fsn1"))
    spec = make_spec()
    with pytest.raises(InsufficientCapacity, match="no cx22"):
        fake().create(spec)
    assert FakeProvider.machines_of() == []  # failed before acting
    assert fake().create(spec).state is MachineState.RUNNING


def test_fail_next_is_scoped_to_an_account_when_asked() -> None:
    FakeProvider.fail_next("list", Transient(), account="b", times=2)
    assert fake("a").list({}) == []
    for _ in range(2):
        with pytest.raises(Transient):
            fake("b").list({})
    assert fake("b").list({}) == []


def test_lost_response_creates_the_machine_and_a_retry_adopts_it() -> None:
    FakeProvider.fail_next("create", Transient("timeout"), after_effect=True)
    spec = make_spec()
    with pytest.raises(Transient):
        fake().create(spec)
    assert len(FakeProvider.machines_of()) == 1
    adopted = fake().create(spec)
    assert len(FakeProvider.machines_of()) == 1
    assert adopted.instance_id == spec.instance_id


def test_delete_is_idempotent_and_get_after_delete_is_not_found() -> None:
    provider = fake()
    machine = provider.create(make_spec())
    provider.delete(machine.provider_id)
    provider.delete(machine.provider_id)
    provider.delete("never-existed")
    with pytest.raises(NotFound):
        provider.get(machine.provider_id)


def test_list_filters_by_all_owner_labels() -> None:
    provider = fake()
    a = provider.create(make_spec(**{LABEL_POOL: "p1"}))
    provider.create(make_spec(**{LABEL_POOL: "p2"}))
    assert [m.provider_id for m in provider.list({LABEL_INSTALLATION: "test", LABEL_POOL: "p1"})] == [
        a.provider_id
    ]
    assert len(provider.list({LABEL_INSTALLATION: "test"})) == 2


def test_warming_state_and_vanishing_machine() -> None:
    provider = fake(initial_state="provisioning")
    spec = make_spec()
    machine = provider.create(spec)
    assert machine.state is MachineState.PROVISIONING
    FakeProvider.set_state(machine.provider_id, "running")
    assert provider.get(machine.provider_id).state is MachineState.RUNNING
    assert provider.find_by_instance(spec.instance_id, {LABEL_INSTALLATION: "test"}) is not None
    FakeProvider.vanish(machine.provider_id)
    with pytest.raises(NotFound):
        provider.get(machine.provider_id)
    assert provider.find_by_instance(spec.instance_id, {LABEL_INSTALLATION: "test"}) is None
