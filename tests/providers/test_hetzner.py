"""HetznerProvider against the fake Hetzner API, through the real hcloud client."""

from __future__ import annotations

import random
import socket
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hcloud.servers import Server

from catacloud.providers import (
    LABEL_INSTALLATION,
    LABEL_INSTANCE,
    LABEL_POOL,
    InsufficientCapacity,
    MachineSpec,
    MachineState,
    NotFound,
    Offering,
    Permanent,
    ProviderError,
    QuotaExceeded,
    RateLimited,
    Transient,
    build_provider,
)
from catacloud.providers.hetzner import HetznerProvider
from tests.fakes.hetzner_api import FakeHetzner

TOKEN = "hz-secret-token-0123456789"
INSTALLATION = {LABEL_INSTALLATION: "test-install"}


@pytest.fixture(scope="module")
def server() -> Iterator[FakeHetzner]:
    with FakeHetzner(token=TOKEN) as fake:
        yield fake


@pytest.fixture()
def fake(server: FakeHetzner) -> FakeHetzner:
    server.reset()
    server.action_polls = 1
    server.stall_seconds = 0.5
    server.server_limit = None
    return server


def make_provider(fake: FakeHetzner, token: str = TOKEN, **config: Any) -> HetznerProvider:
    settings = {
        "api_endpoint": fake.url,
        "location": "fsn1",
        "poll_interval": 0.001,
        "retry_backoff": 0.001,
        "retry_max_delay": 0.01,
        "timeout": 2,
        **config,
    }
    provider = build_provider("hetzner", config=settings, credentials={"token": token})
    assert isinstance(provider, HetznerProvider)
    return provider


@pytest.fixture()
def provider(fake: FakeHetzner) -> HetznerProvider:
    return make_provider(fake)


def make_spec(instance_id: str | None = None, **labels: str) -> MachineSpec:
    instance_id = instance_id or str(uuid.uuid4())
    return MachineSpec(
        instance_id=instance_id,
        labels={**INSTALLATION, LABEL_INSTANCE: instance_id, **labels},
        server_type="cx23",
        image="ubuntu-24.04",
        user_data="#cloud-config\nruncmd: [[echo, hi]]\n",
    )


def servers_named(fake: FakeHetzner, name: str) -> list[dict]:
    return [s for s in fake.servers.values() if s["name"] == name]


# ---- create -------------------------------------------------------------------------------------


def test_create_sends_the_spec_and_returns_once_running(fake: FakeHetzner, provider: HetznerProvider) -> None:
    fake.action_polls = 3
    spec = make_spec(**{LABEL_POOL: "pool-1"})
    machine = provider.create(spec)

    assert machine.state is MachineState.RUNNING
    assert machine.name == f"cc-{spec.instance_id}"
    assert machine.instance_id == spec.instance_id
    assert machine.public_ip
    stored = fake.servers[int(machine.provider_id)]
    assert stored["labels"] == {**INSTALLATION, LABEL_INSTANCE: spec.instance_id, LABEL_POOL: "pool-1"}
    assert (stored["server_type"]["name"], stored["image"]["name"], stored["location"]["name"]) == (
        "cx23",
        "ubuntu-24.04",
        "fsn1",
    )
    assert fake.user_data[stored["id"]] == spec.user_data
    assert fake.count("GET", "/actions/") == 3  # polled until the create action finished


def test_create_twice_makes_one_server(fake: FakeHetzner, provider: HetznerProvider) -> None:
    spec = make_spec()
    first = provider.create(spec)
    second = make_provider(fake).create(spec)
    assert second.provider_id == first.provider_id
    assert len(fake.servers) == 1
    assert ("POST", "/servers", 409) in fake.requests  # the second create was adopted via 409


@pytest.mark.parametrize("fault", ["drop_after", "stall"])
def test_a_lost_create_response_is_retried_and_adopts_the_server(fake: FakeHetzner, fault: str) -> None:
    provider = make_provider(fake, timeout=0.2)  # stall answers after 0.5 s: the client times out
    spec = make_spec()
    fake.fail_next("POST /servers", fault)

    machine = provider.create(spec)

    assert machine.state is MachineState.RUNNING
    assert len(servers_named(fake, spec.name)) == 1
    assert fake.created_names.count(spec.name) == 1
    assert fake.count("POST", "/servers") == 2


def test_adopting_a_server_that_is_still_booting_waits_for_it(
    fake: FakeHetzner, provider: HetznerProvider
) -> None:
    fake.action_polls = 3
    fake.fail_next("POST /servers", "drop_after")
    machine = provider.create(make_spec())
    assert machine.state is MachineState.RUNNING
    assert fake.count("GET", f"/servers/{machine.provider_id}/actions") == 1


def test_a_dropped_request_that_never_arrived_is_simply_retried(
    fake: FakeHetzner, provider: HetznerProvider
) -> None:
    fake.fail_next("POST /servers", "drop_before")
    spec = make_spec()
    assert provider.create(spec).state is MachineState.RUNNING
    assert len(fake.servers) == 1
    assert ("POST", "/servers", 409) not in fake.requests


def test_a_name_taken_by_a_server_that_is_not_ours_is_permanent(
    fake: FakeHetzner, provider: HetznerProvider
) -> None:
    spec = make_spec()
    foreign = fake.add_server(spec.name, {LABEL_INSTANCE: "someone-else"})
    with pytest.raises(Permanent, match="not ours"):
        provider.create(spec)
    assert list(fake.servers) == [foreign]  # left alone


def test_a_failed_create_action_deletes_the_server(fake: FakeHetzner, provider: HetznerProvider) -> None:
    fake.fail_next_action(code="server_create_failed", message="host crashed")
    with pytest.raises(Transient, match="host crashed"):
        provider.create(make_spec())
    assert fake.servers == {}
    assert fake.count("DELETE", "/servers/") == 1


def test_a_failed_action_is_mapped_by_its_error_code(fake: FakeHetzner, provider: HetznerProvider) -> None:
    fake.fail_next_action(code="resource_unavailable", message="no capacity")
    with pytest.raises(InsufficientCapacity):
        provider.create(make_spec())
    assert fake.servers == {}


# ---- errors and retries -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind, error",
    [
        ("invalid_input", Permanent),
        ("resource_unavailable", InsufficientCapacity),
        ("resource_limit_exceeded", QuotaExceeded),
        ("unauthorized", Permanent),
        ("rate_limit", RateLimited),
        ("bad_gateway", Transient),
        ("gateway_timeout", Transient),
        ("server_error", Transient),
        ("unavailable", Transient),
    ],
)
def test_create_errors_are_typed(fake: FakeHetzner, kind: str, error: type[ProviderError]) -> None:
    provider = make_provider(fake, retry_attempts=2)
    fake.fail_next("POST /servers", kind, times=3)  # outlasts the retries
    with pytest.raises(error) as info:
        provider.create(make_spec())
    assert type(info.value) is error
    assert fake.servers == {}
    retried = error in (RateLimited, Transient)
    assert fake.count("POST", "/servers") == (3 if retried else 1)


def test_rate_limit_reports_retry_after(fake: FakeHetzner) -> None:
    provider = make_provider(fake, retry_attempts=0)
    fake.fail_next("GET /servers", "rate_limit", retry_after=7)
    with pytest.raises(RateLimited) as given:
        provider.list(INSTALLATION)
    assert given.value.retry_after == 7
    fake.fail_next("GET /servers", "rate_limit")  # no Retry-After, RateLimit-Remaining: 0
    with pytest.raises(RateLimited) as refill:
        provider.list(INSTALLATION)
    assert refill.value.retry_after == 1.0


@pytest.mark.parametrize("kind", ["rate_limit", "bad_gateway", "gateway_timeout", "server_error"])
def test_retryable_errors_are_retried_then_succeed(
    fake: FakeHetzner, provider: HetznerProvider, kind: str
) -> None:
    fake.fail_next("POST /servers", kind, times=2)
    fake.fail_next("GET /actions/{id}", kind)
    machine = provider.create(make_spec())
    assert machine.state is MachineState.RUNNING
    assert fake.count("POST", "/servers") == 3
    assert len(fake.servers) == 1


def test_retries_wait_with_backoff(fake: FakeHetzner) -> None:
    provider = make_provider(fake, retry_attempts=3, retry_backoff=0.05, retry_max_delay=1)
    fake.fail_next("GET /servers", "server_error", times=3)
    started = time.monotonic()
    assert provider.list(INSTALLATION) == []
    assert time.monotonic() - started >= 0.05 + 0.1 + 0.2


def test_wrong_token_is_permanent_and_the_token_is_not_in_the_message(fake: FakeHetzner) -> None:
    provider = make_provider(fake, token="not-the-right-token-xyz")
    with pytest.raises(Permanent) as info:
        provider.create(make_spec())
    assert "unauthorized" in str(info.value)
    assert "not-the-right-token-xyz" not in str(info.value)
    assert TOKEN not in str(info.value)


def test_project_server_limit_is_quota_exceeded(fake: FakeHetzner, provider: HetznerProvider) -> None:
    fake.server_limit = 1
    provider.create(make_spec())
    with pytest.raises(QuotaExceeded):
        provider.create(make_spec())
    assert len(fake.servers) == 1


def test_unreachable_api_is_transient() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens here once closed
    provider = build_provider(
        "hetzner",
        config={"api_endpoint": f"http://127.0.0.1:{port}/v1", "retry_attempts": 1, "retry_backoff": 0.001},
        credentials={"token": TOKEN},
    )
    with pytest.raises(Transient):
        provider.get("1")


def test_missing_token_is_permanent() -> None:
    with pytest.raises(Permanent, match="token"):
        build_provider("hetzner", config={}, credentials={})


# ---- get / delete / list ----------------------------------------------------------------------------


def test_get_maps_states_and_unknown_ids(fake: FakeHetzner, provider: HetznerProvider) -> None:
    booting = fake.add_server("a", status="initializing")
    off = fake.add_server("b", status="off")
    assert provider.get(str(booting)).state is MachineState.PROVISIONING
    assert provider.get(str(off)).state is MachineState.STOPPING
    assert provider.get(str(off)).raw_state == "off"
    with pytest.raises(NotFound):
        provider.get("424242")
    with pytest.raises(NotFound):
        provider.get("not-a-number")


def test_state_map_covers_every_hcloud_server_status() -> None:
    statuses = {v for k, v in vars(Server).items() if k.startswith("STATUS_")}
    assert statuses == set(HetznerProvider.STATE_MAP)


def test_delete_is_idempotent(fake: FakeHetzner, provider: HetznerProvider) -> None:
    machine = provider.create(make_spec())
    fake.fail_next("DELETE /servers/{id}", "bad_gateway")
    provider.delete(machine.provider_id)
    assert fake.servers == {}
    provider.delete(machine.provider_id)  # 404: already done
    provider.delete("999999")
    provider.delete("not-a-number")
    with pytest.raises(NotFound):
        provider.get(machine.provider_id)


def test_list_follows_pagination_and_filters_by_all_labels(
    fake: FakeHetzner, provider: HetznerProvider
) -> None:
    mine = {
        fake.add_server(f"cc-{i}", {**INSTALLATION, LABEL_POOL: "p1", LABEL_INSTANCE: f"i{i}"})
        for i in range(57)
    }
    fake.add_server("other-pool", {**INSTALLATION, LABEL_POOL: "p2"})
    fake.add_server("other-install", {LABEL_INSTALLATION: "elsewhere", LABEL_POOL: "p1"})

    found = provider.list({**INSTALLATION, LABEL_POOL: "p1"})

    assert {int(m.provider_id) for m in found} == mine
    assert fake.count("GET", "/servers") == 2  # hcloud asks 50 per page: two pages
    assert len(provider.list(INSTALLATION)) == 58
    assert provider.find_by_instance("i3", INSTALLATION) is not None


def test_list_refuses_labels_that_would_widen_the_selector(provider: HetznerProvider) -> None:
    with pytest.raises(Permanent):
        provider.list({LABEL_INSTALLATION: "x,!catacloud/pool"})


# ---- soak ---------------------------------------------------------------------------------------------

FAULTS = [
    ("POST /servers", "rate_limit"),
    ("POST /servers", "bad_gateway"),
    ("POST /servers", "gateway_timeout"),
    ("POST /servers", "server_error"),
    ("POST /servers", "drop_after"),
    ("POST /servers", "drop_before"),
    ("POST /servers", "resource_unavailable"),
    ("GET /actions/{id}", "bad_gateway"),
    ("GET /actions/{id}", "drop_before"),
    ("GET /servers/{id}", "server_error"),
    ("GET /servers", "rate_limit"),
    ("DELETE /servers/{id}", "bad_gateway"),
    ("DELETE /servers/{id}", "drop_after"),
    ("DELETE /servers/{id}", "rate_limit"),
]


@pytest.mark.timeout(120)
def test_soak_random_faults_then_reconcile_leaves_exactly_the_live_machines(fake: FakeHetzner) -> None:
    """500 create/delete cycles under random faults; a simple reconcile then converges."""
    rng = random.Random(20261122)
    provider = make_provider(fake, retry_attempts=2)
    live: dict[str, str] = {}  # instance id -> provider id: what the database believes is live
    operations = errors = 0

    for _ in range(500):
        if rng.random() < 0.35:
            endpoint, kind = rng.choice(FAULTS)
            fake.fail_next(endpoint, kind, times=rng.randint(1, 3))
        if rng.random() < 0.03:
            fake.fail_next_action()
        if live and rng.random() < 0.45:
            instance_id = rng.choice(sorted(live))
            provider_id = live.pop(instance_id)  # the row leaves the live states first
            operations += 1
            try:
                provider.delete(provider_id)
            except ProviderError:
                errors += 1  # the reconciler will finish the job
            continue
        spec = make_spec()
        for _attempt in range(2):  # the task retries retryable errors once
            operations += 1
            try:
                machine = provider.create(spec)
            except ProviderError as exc:
                errors += 1
                # Every injected fault is retryable: anything else means the driver mishandled one.
                assert exc.retryable, repr(exc)
            else:
                assert machine.state is MachineState.RUNNING
                assert machine.instance_id == spec.instance_id
                live[spec.instance_id] = machine.provider_id
                break

    fake.clear_faults()
    # Never two servers for one instance (lost responses and 409s were adopted, not duplicated).
    instance_labels = [s["labels"][LABEL_INSTANCE] for s in fake.servers.values()]
    assert len(instance_labels) == len(set(instance_labels))
    assert set(live) <= set(instance_labels)
    # Reconcile: labelled machines without a live row are deleted.
    extras = [m for m in provider.list(INSTALLATION) if m.instance_id not in live]
    for machine in extras:
        provider.delete(machine.provider_id)

    assert {m.provider_id for m in provider.list(INSTALLATION)} == set(live.values())
    assert {str(sid) for sid in fake.servers} == set(live.values())
    assert all(fake.servers[int(pid)]["labels"][LABEL_INSTANCE] == iid for iid, pid in live.items())
    assert operations >= 500
    assert errors > 0 and extras  # the faults really bit, and reconcile had work to do
    assert ("POST", "/servers", 409) in fake.requests  # lost responses were adopted


# ---- a catalog's offerings against Hetzner's lists ----------------------------------------------


def test_offerings_are_checked_against_the_lists_with_one_call_each(
    fake: FakeHetzner, provider: HetznerProvider
) -> None:
    """Given what a catalog names, when checked, then cx22 (gone at the end of 2025), a type not
    sold at a location, an unknown image and location are refused, and the current ones pass;
    each list was read once (paged), not once per offering."""
    offerings = [
        Offering("cx23", "ubuntu-24.04"),  # at the account's location, fsn1
        Offering("cx22", "ubuntu-24.04", "fsn1"),
        Offering("cx23", "ubuntu-24.04", "ash"),
        Offering("ccx13", "debian-12", "ash"),
        Offering("cx33", "ubuntu-42.04", "nbg1"),
        Offering("cx33", "161547269", "mars1"),  # an image by id
    ]
    problems = provider.check_offerings(offerings)
    by = {(p.offering, p.refused): p.message for p in problems}
    assert all(p.refused for p in problems)
    assert "no server type 'cx22' is sold (sold: ccx13, cx23, cx33)" in by[(offerings[1], True)]
    assert "server type cx23 is not sold at ash (sold at: fsn1, hel1, nbg1)" in by[(offerings[2], True)]
    assert "no image 'ubuntu-42.04'" in by[(offerings[4], True)]
    assert "no location 'mars1'" in by[(offerings[5], True)]
    assert {p.offering for p in problems} == {offerings[1], offerings[2], offerings[4], offerings[5]}
    assert [fake.count("GET", path) for path in ("/server_types", "/images", "/locations")] == [1, 1, 1]


def test_an_offering_whose_arch_is_not_the_server_types_is_refused(provider: HetznerProvider) -> None:
    """A machine type that says arm64 on an x86 server type would be chosen for arm jobs."""
    (refusal,) = provider.check_offerings([Offering("cx23", "ubuntu-24.04", "fsn1", "arm64")])
    assert (
        refusal.refused
        and "server type cx23 is x86_64, not arm64 as its machine type says" in refusal.message
    )
    assert provider.check_offerings([Offering("cx23", "ubuntu-24.04", "fsn1", "x86_64")]) == []


def test_a_type_deprecated_at_a_location_is_a_warning_until_it_is_gone(
    fake: FakeHetzner, provider: HetznerProvider
) -> None:
    soon = datetime.now(UTC) + timedelta(days=60)
    fake.deprecate("cx33", location="fsn1", unavailable_after=soon)
    (warning,) = provider.check_offerings([Offering("cx33", "ubuntu-24.04", "fsn1")])
    assert not warning.refused
    until = f"sold until {soon:%Y-%m-%d}, pick its successor"
    assert warning.message == f"hetzner: server type cx33 is deprecated at fsn1: {until}"
    assert provider.check_offerings([Offering("cx33", "ubuntu-24.04", "nbg1")]) == []

    fake.deprecate("cx33", location="fsn1", unavailable_after=datetime.now(UTC) - timedelta(days=1))
    (refusal,) = provider.check_offerings([Offering("cx33", "ubuntu-24.04", "fsn1")])
    assert refusal.refused and "is no longer sold at fsn1" in refusal.message


def test_checking_offerings_with_a_wrong_token_is_a_permanent_error(fake: FakeHetzner) -> None:
    with pytest.raises(Permanent, match="unauthorized"):
        make_provider(fake, token="wrong").check_offerings([Offering("cx23", "ubuntu-24.04")])
