"""AzureProvider against the fake Azure Resource Manager, through the real azure-identity and
azure-mgmt-compute clients (over TLS, as they insist)."""

from __future__ import annotations

import base64
import random
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

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
from catacloud.providers.azure import AzureProvider
from catacloud.providers.base import Bootstrap
from testkit.processes import free_port
from tests.fakes.azure_arm import (
    ARM_SCOPE,
    CLIENT_SECRET,
    LOCATION,
    RESOURCE_GROUP,
    SUBSCRIPTION_ID,
    FakeAzure,
)

INSTALLATION = {LABEL_INSTALLATION: "test-install"}
IMAGE = "Canonical:ubuntu-24_04-lts:server:latest"
SIZE = "Standard_D2as_v5"
WHEEL = "https://cc.example.com/api/agent/v1/dist/catacloud_agent-1.2.3-py3-none-any.whl#sha256=" + "ab" * 32


@pytest.fixture(scope="module")
def server() -> Iterator[FakeAzure]:
    with FakeAzure() as fake:
        yield fake


@pytest.fixture()
def fake(server: FakeAzure) -> FakeAzure:
    server.reset()
    server.lro_polls, server.lro_seconds, server.page_size = 1, 5.0, 50
    server.stall_seconds, server.notice_seconds, server.first_call_delay = 0.6, 30.0, 0.0
    return server


def make_provider(fake: FakeAzure, credentials: dict[str, str] | None = None, **config: Any) -> AzureProvider:
    defaults = {
        "poll_interval": 0.001,
        "max_attempts": 1,
        "retry_backoff": 0.001,
        "connect_timeout": 2,
        "read_timeout": 5,
    }
    settings = fake.provider_config(**{**defaults, **config})
    provider = build_provider("azure", config=settings, credentials=credentials or fake.credentials())
    assert isinstance(provider, AzureProvider)
    return provider


@pytest.fixture()
def provider(fake: FakeAzure) -> AzureProvider:
    return make_provider(fake)


def make_spec(instance_id: str | None = None, **fields: Any) -> MachineSpec:
    instance_id = instance_id or str(uuid.uuid4())
    labels = {**INSTALLATION, LABEL_INSTANCE: instance_id, **fields.pop("labels", {})}
    fields = {
        "server_type": SIZE,
        "image": IMAGE,
        "user_data": "#cloud-config\nruncmd: [[echo, hi]]\n",
        **fields,
    }
    return MachineSpec(instance_id=instance_id, labels=labels, **fields)


def put_body(fake: FakeAzure, name: str) -> dict[str, Any]:
    (body,) = [b for m, n, b in fake.request_bodies if m == "PUT" and n == name][:1]
    return body


def wait_gone(provider: AzureProvider, provider_id: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            provider.get(provider_id)
        except NotFound:
            return
        time.sleep(0.05)
    raise AssertionError(f"{provider_id} is still there after {timeout} s")


# ---- create -------------------------------------------------------------------------------------


def test_create_makes_one_tagged_vm_with_its_user_data_and_size(
    fake: FakeAzure, provider: AzureProvider
) -> None:
    fake.lro_polls = 3
    spec = make_spec(labels={LABEL_POOL: "pool-1"})
    machine = provider.create(spec)

    assert machine.state is MachineState.RUNNING and machine.raw_state == "running"
    assert machine.provider_id == machine.name == f"cc-{spec.instance_id}"
    assert machine.labels == {**INSTALLATION, LABEL_INSTANCE: spec.instance_id, LABEL_POOL: "pool-1"}
    assert machine.public_ip.startswith("20.") and machine.private_ip.startswith("10.")
    vm = fake.vm(machine.name)
    assert vm is not None and fake.created == [machine.name]
    # Azure refuses '/' in tag names: the labels are tags with ':' instead.
    assert vm["tags"] == {
        "catacloud:installation": "test-install",
        "catacloud:instance": spec.instance_id,
        "catacloud:pool": "pool-1",
    }
    assert (vm["size"], vm["location"], vm["image"]) == (
        SIZE,
        LOCATION,
        {"publisher": "Canonical", "offer": "ubuntu-24_04-lts", "sku": "server", "version": "latest"},
    )
    assert fake.custom_data[machine.name] == spec.user_data  # what cloud-init reads on Azure
    assert vm["priority"] == "Regular"
    assert fake.count("GET", "/operations/{id}") == 3  # followed the create's operation to its end


def test_the_vm_brings_its_nic_ip_and_disk_and_deleting_it_leaves_nothing(
    fake: FakeAzure, provider: AzureProvider
) -> None:
    fake.lro_seconds = 0.2  # deletes end on their own, as Azure's do
    machine = provider.create(make_spec())
    assert {k: len(v) for k, v in fake.leftovers().items()} == {
        "disks": 1,
        "networkInterfaces": 1,
        "publicIPAddresses": 1,
    }
    body = put_body(fake, machine.name)["properties"]
    assert body["osProfile"]["linuxConfiguration"]["disablePasswordAuthentication"] is True
    assert "adminPassword" not in body["osProfile"]

    provider.delete(machine.provider_id)
    assert provider.get(machine.provider_id).state is MachineState.STOPPING  # being deleted
    provider.delete(machine.provider_id)  # again while it is being deleted: fine
    wait_gone(provider, machine.provider_id)
    provider.delete(machine.provider_id)  # gone: 204, still fine
    provider.delete("cc-never-was")
    provider.delete("not a name")
    assert fake.leftovers() == {"disks": [], "networkInterfaces": [], "publicIPAddresses": []}
    assert fake.count("DELETE", "/virtualMachines/{name}") == 4  # "not a name" was never sent


def test_without_a_public_ip_the_nic_has_none(fake: FakeAzure) -> None:
    machine = make_provider(fake, public_ip=False).create(make_spec())
    assert machine.public_ip == "" and machine.private_ip
    assert fake.leftovers()["publicIPAddresses"] == []


def test_a_create_still_running_after_create_timeout_is_returned_provisioning(fake: FakeAzure) -> None:
    fake.lro_polls = 1000
    provider = make_provider(fake, create_timeout=0.2, poll_interval=0.05)
    machine = provider.create(make_spec())
    assert (machine.state, machine.raw_state) == (MachineState.PROVISIONING, "creating")
    assert 2 <= fake.count("GET", "/operations/{id}") <= 6  # polled until the deadline, then no more


def test_create_twice_makes_one_vm(fake: FakeAzure, provider: AzureProvider) -> None:
    spec = make_spec()
    first = provider.create(spec)
    second = make_provider(fake).create(spec)
    assert second.provider_id == first.provider_id
    assert fake.created == [first.name]
    assert fake.count("PUT", "/virtualMachines/{name}") == 1  # the second found it by its name


@pytest.mark.parametrize("fault", ["drop_after", "stall"])
def test_a_create_whose_answer_is_lost_adopts_the_vm_on_retry(fake: FakeAzure, fault: str) -> None:
    provider = make_provider(fake, read_timeout=0.3)  # stall answers after 0.6 s: the client gives up
    fake.lro_seconds = 0.3  # an adopted create is followed by its VM's state, which Azure moves on
    spec = make_spec()
    fake.fail_next("PUT /virtualMachines/{name}", fault)

    with pytest.raises(Transient):
        provider.create(spec)
    assert fake.created == [spec.name]  # made nevertheless

    machine = provider.create(spec)  # the task's retry
    assert machine.state is MachineState.RUNNING and machine.instance_id == spec.instance_id
    assert fake.created == [spec.name]
    assert fake.count("PUT", "/virtualMachines/{name}") == 1


def test_a_put_retried_by_the_sdk_after_a_lost_answer_adopts_the_vm_being_made(fake: FakeAzure) -> None:
    provider = make_provider(fake, max_attempts=3)
    fake.lro_seconds = 0.3
    spec = make_spec()
    fake.fail_next("PUT /virtualMachines/{name}", "drop_after")

    machine = provider.create(spec)

    assert machine.state is MachineState.RUNNING
    assert fake.created == [spec.name]
    # azure-core sent the PUT again; ARM refused it (a create is under way) and the driver adopted.
    assert ("PUT", "/virtualMachines/{name}", 409) in fake.requests


def test_a_dropped_request_that_never_arrived_is_simply_retried(fake: FakeAzure) -> None:
    fake.fail_next("PUT /virtualMachines/{name}", "drop_before")
    machine = make_provider(fake, max_attempts=2).create(make_spec())
    assert machine.state is MachineState.RUNNING
    assert len(fake.created) == 1 and ("PUT", "/virtualMachines/{name}", 409) not in fake.requests


def test_a_name_taken_by_a_vm_that_is_not_ours_is_permanent(fake: FakeAzure, provider: AzureProvider) -> None:
    spec = make_spec()
    fake.add_vm(spec.name, {"catacloud:instance": "someone-else"})
    with pytest.raises(Permanent, match="not ours"):
        provider.create(spec)
    assert fake.vm(spec.name) is not None and fake.count("DELETE", "/virtualMachines/{name}") == 0


def test_a_leftover_failed_vm_of_ours_is_deleted_and_the_create_retried(
    fake: FakeAzure, provider: AzureProvider
) -> None:
    spec = make_spec()
    fake.add_vm(spec.name, {"catacloud:instance": spec.instance_id}, provisioning="Failed", power=None)
    with pytest.raises(Transient, match="leftover"):
        provider.create(spec)
    assert fake.count("DELETE", "/virtualMachines/{name}") == 1


def test_a_failed_create_deletes_its_vm_and_raises_the_operations_error(
    fake: FakeAzure, provider: AzureProvider
) -> None:
    fake.lro_seconds = 0.2
    fake.fail_next_operation("InternalExecutionError", "An internal execution error occurred.")
    spec = make_spec()
    with pytest.raises(Transient, match="InternalExecutionError"):
        provider.create(spec)
    assert fake.count("DELETE", "/virtualMachines/{name}") == 1
    wait_gone(provider, spec.name)
    assert fake.leftovers() == {"disks": [], "networkInterfaces": [], "publicIPAddresses": []}


def test_no_capacity_for_the_size_is_insufficient_capacity_from_the_failed_operation(
    fake: FakeAzure, provider: AzureProvider
) -> None:
    """Azure says so at the end of the create: the PUT was accepted, the operation failed."""
    fake.sell_out(SIZE, LOCATION)
    with pytest.raises(InsufficientCapacity, match="AllocationFailed"):
        provider.create(make_spec())
    assert ("PUT", "/virtualMachines/{name}", 201) in fake.requests
    assert len(fake.capacity_refusals) == 1
    assert fake.count("DELETE", "/virtualMachines/{name}") == 1  # the failed VM goes
    fake.sell_out(SIZE, LOCATION, sold_out=False)
    assert provider.create(make_spec()).state is MachineState.RUNNING


def test_no_spot_capacity_is_insufficient_capacity_at_once(fake: FakeAzure, provider: AzureProvider) -> None:
    fake.sell_out(SIZE, LOCATION)
    with pytest.raises(InsufficientCapacity, match="SkuNotAvailable"):
        provider.create(make_spec(spot=True))
    assert fake.created == []


# ---- errors and retries -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind, error",
    [
        ("throttled", RateLimited),
        ("internal_error", Transient),
        ("service_unavailable", Transient),
        ("gateway_timeout", Transient),
        ("quota", QuotaExceeded),
        ("sku_not_available", InsufficientCapacity),
        ("authorization_failed", Permanent),
        ("bad_request", Permanent),
    ],
)
def test_create_errors_are_typed(fake: FakeAzure, kind: str, error: type[ProviderError]) -> None:
    provider = make_provider(fake, max_attempts=2)
    fake.fail_next("PUT /virtualMachines/{name}", kind, times=2, retry_after=0)  # outlasts the retries
    with pytest.raises(error) as info:
        provider.create(make_spec())
    assert type(info.value) is error
    assert fake.created == []
    retried = error in (RateLimited, Transient)  # azure-core retries 429 and 5xx, nothing else
    assert fake.count("PUT", "/virtualMachines/{name}") == (2 if retried else 1)


def test_throttling_reports_retry_after(fake: FakeAzure, provider: AzureProvider) -> None:
    fake.fail_next("GET /virtualMachines", "throttled", retry_after=17)
    with pytest.raises(RateLimited) as info:
        provider.list(INSTALLATION)
    assert info.value.retry_after == 17


def test_retryable_errors_are_retried_then_succeed(fake: FakeAzure) -> None:
    provider = make_provider(fake, max_attempts=3)
    fake.fail_next("PUT /virtualMachines/{name}", "throttled", retry_after=0)
    fake.fail_next("PUT /virtualMachines/{name}", "service_unavailable")
    fake.fail_next("GET /operations/{id}", "internal_error")
    machine = provider.create(make_spec())
    assert machine.state is MachineState.RUNNING
    assert fake.count("PUT", "/virtualMachines/{name}") == 3 and len(fake.created) == 1


def test_the_regional_vcpu_quota_is_quota_exceeded(fake: FakeAzure, provider: AzureProvider) -> None:
    fake.regional_cores, fake.spot_cores = 2, 0
    provider.create(make_spec())
    with pytest.raises(QuotaExceeded, match="Total Regional Cores quota"):
        provider.create(make_spec())
    with pytest.raises(QuotaExceeded, match="Low-priority vCPUs quota"):  # Spot has a quota of its own
        provider.create(make_spec(spot=True))
    assert len(fake.created) == 1


def test_a_wrong_secret_is_permanent_with_entras_message_and_no_secret(fake: FakeAzure) -> None:
    wrong = "not-the-secret-0123456789"
    provider = make_provider(fake, credentials=fake.credentials(client_secret=wrong))
    with pytest.raises(Permanent) as info:
        provider.create(make_spec())
    assert "AADSTS7000215" in str(info.value) and "Invalid client secret" in str(info.value)
    assert wrong not in str(info.value) and CLIENT_SECRET not in str(info.value)
    assert fake.created == []


@pytest.mark.parametrize(
    "credentials, code",
    [
        ({"client_id": "00000000-0000-4000-8000-000000000000"}, "AADSTS700016"),
        # MSAL reads the tenant's discovery document first and says so when there is none.
        ({"tenant_id": "contoso-x"}, "Unable to get authority configuration for .*/contoso-x"),
    ],
)
def test_an_unknown_application_or_tenant_is_permanent(
    fake: FakeAzure, credentials: dict[str, str], code: str
) -> None:
    provider = make_provider(fake, credentials=fake.credentials(**credentials))
    with pytest.raises(Permanent, match=code):
        provider.list(INSTALLATION)


def test_a_role_without_the_subnet_is_permanent_naming_the_missing_permission(
    fake: FakeAzure, provider: AzureProvider
) -> None:
    fake.deny("Microsoft.Network/virtualNetworks/subnets/join/action")
    with pytest.raises(Permanent, match="LinkedAuthorizationFailed.*subnets/join/action"):
        provider.create(make_spec())


def test_unreachable_login_or_arm_is_transient(fake: FakeAzure) -> None:
    closed = f"https://127.0.0.1:{free_port()}"
    with pytest.raises(Transient):
        make_provider(fake, authority=closed).list(INSTALLATION)
    with pytest.raises(Transient):
        make_provider(fake, endpoint=closed, token_scope=ARM_SCOPE).list(INSTALLATION)


def test_missing_configuration_or_credentials_is_permanent(fake: FakeAzure) -> None:
    config = fake.provider_config()
    with pytest.raises(Permanent, match="'subnet_id'"):
        build_provider("azure", config={**config, "subnet_id": ""}, credentials=fake.credentials())
    with pytest.raises(Permanent, match="'client_secret'"):
        build_provider("azure", config=config, credentials=fake.credentials(client_secret=""))
    with pytest.raises(Permanent, match="ssh-rsa"):
        build_provider(
            "azure", config={**config, "ssh_public_key": "ssh-ed25519 AAAA"}, credentials=fake.credentials()
        )


@pytest.mark.parametrize(
    "image, message",
    [
        ("ubuntu-24.04", "neither publisher:offer:sku:version"),
        ("Canonical:nothing:here:latest", "PlatformImageNotFound"),
    ],
)
def test_a_bad_image_is_permanent(provider: AzureProvider, image: str, message: str) -> None:
    with pytest.raises(Permanent, match=message):
        provider.create(make_spec(image=image))


def test_labels_azure_could_not_take_back_are_refused(provider: AzureProvider) -> None:
    with pytest.raises(Permanent, match="cannot be a tag name"):
        provider.list({"catacloud:pool": "x"})
    with pytest.raises(Permanent, match="cannot be a tag name"):
        provider.create(make_spec(labels={"team?": "x"}))


# ---- get / list ---------------------------------------------------------------------------------


def test_get_maps_states_and_unknown_ids(fake: FakeAzure, provider: AzureProvider) -> None:
    cases = {
        "creating": ("Creating", None, MachineState.PROVISIONING),
        "starting": ("Succeeded", "starting", MachineState.PROVISIONING),
        "running": ("Succeeded", "running", MachineState.RUNNING),
        "deallocated": ("Succeeded", "deallocated", MachineState.STOPPING),
        "deleting": ("Deleting", "stopping", MachineState.STOPPING),
        "failed": ("Failed", None, MachineState.ERROR),
    }
    for raw, (provisioning, power, state) in cases.items():
        fake.add_vm(f"vm-{raw}", provisioning=provisioning, power=power)
        machine = provider.get(f"vm-{raw}")
        assert (machine.raw_state, machine.state) == (raw, state)
    group = f"/subscriptions/{SUBSCRIPTION_ID}/resourceGroups/{RESOURCE_GROUP}"
    arm_id = f"{group}/providers/Microsoft.Compute/virtualMachines/vm-running"
    assert provider.get(arm_id).state is MachineState.RUNNING
    for missing in ("cc-424242", "not a vm name", arm_id.replace(RESOURCE_GROUP, "other-group")):
        with pytest.raises(NotFound):
            provider.get(missing)


def test_state_map_covers_every_provisioning_and_power_state() -> None:
    power = {"starting", "running", "stopping", "stopped", "deallocating", "deallocated", "unknown"}
    provisioning = {
        "creating",
        "migrating",
        "failed",
        "deleting",
    }  # Updating/Succeeded: the power state tells
    assert set(AzureProvider.STATE_MAP) == power | provisioning
    assert AzureProvider.map_state("failed") is MachineState.ERROR


def test_list_follows_pages_and_filters_by_all_labels(fake: FakeAzure, provider: AzureProvider) -> None:
    fake.page_size = 20
    tags = {"catacloud:installation": "test-install", "catacloud:pool": "p1"}
    mine = {fake.add_vm(f"cc-{i}", {**tags, "catacloud:instance": f"i{i}"})["name"] for i in range(45)}
    fake.add_vm("other-pool", {**tags, "catacloud:pool": "p2"})
    fake.add_vm("other-install", {"catacloud:installation": "elsewhere", "catacloud:pool": "p1"})
    fake.add_vm("untagged")

    found = provider.list({**INSTALLATION, LABEL_POOL: "p1"})

    assert {m.provider_id for m in found} == mine
    assert fake.count("GET", "/virtualMachines") == 3  # 48 VMs at 20 a page, nextLink followed
    assert len(provider.list(INSTALLATION)) == 46
    adopted = provider.find_by_instance("i3", INSTALLATION)
    assert adopted is not None and adopted.name == "cc-3"


# ---- spot -----------------------------------------------------------------------------------------


def test_spot_is_priority_spot_deleted_on_eviction_never_for_price(
    fake: FakeAzure, provider: AzureProvider
) -> None:
    machine = provider.create(make_spec(spot=True))
    properties = put_body(fake, machine.name)["properties"]
    assert (properties["priority"], properties["evictionPolicy"], properties["billingProfile"]) == (
        "Spot",
        "Delete",
        {"maxPrice": -1},
    )
    on_demand = provider.create(make_spec())
    assert "priority" not in put_body(fake, on_demand.name)["properties"]


def unit_of(fake: FakeAzure, name: str) -> str:
    document = yaml.safe_load(fake.custom_data[name])
    return next(f["content"] for f in document["write_files"] if f["path"].endswith(".service"))


def test_a_spot_machines_agent_watches_scheduled_events_an_on_demand_ones_does_not(
    fake: FakeAzure, provider: AzureProvider
) -> None:
    bootstrap = Bootstrap(agent_url="https://cc.example.com", token="bt_0123456789abcdefXYZ", package=WHEEL)
    spot = provider.create(make_spec(spot=True, user_data="", bootstrap=bootstrap))
    regular = provider.create(make_spec(user_data="", bootstrap=bootstrap))
    assert "--imds-url http://169.254.169.254 --imds-kind azure" in unit_of(fake, spot.name)
    assert "--imds-url" not in unit_of(fake, regular.name)
    custom = put_body(fake, spot.name)["properties"]["osProfile"]["customData"]
    assert base64.b64decode(custom).decode() == fake.custom_data[spot.name]


def test_an_evicted_spot_machine_is_seen_going_then_gone(fake: FakeAzure, provider: AzureProvider) -> None:
    machine = provider.create(make_spec(spot=True))
    fake.evict(machine.name, notice=0.2)
    assert provider.get(machine.provider_id).state is MachineState.RUNNING  # announced, not yet started
    wait_gone(provider, machine.provider_id)  # the event started and the VM was deleted, NIC and disk too
    assert fake.leftovers() == {"disks": [], "networkInterfaces": [], "publicIPAddresses": []}


# ---- the account: credentials and offerings -------------------------------------------------------


def test_a_provider_per_task_logs_in_once(fake: FakeAzure) -> None:
    """Tasks build a provider each: the service principal's token is kept across them."""
    for _ in range(3):
        make_provider(fake, read_timeout=7).list(INSTALLATION)  # (a timeout of its own: a fresh credential)
    assert fake.count("POST", "/token") == 1
    assert fake.count("GET", "/virtualMachines") == 3


def test_check_credentials_is_one_cheap_read(fake: FakeAzure, provider: AzureProvider) -> None:
    provider.check_credentials()
    arm = [r for r in fake.requests if r[1] not in ("/token", "/openid-configuration")]
    assert arm == [("GET", "/virtualMachines", 200)]


@pytest.mark.parametrize(
    "change, message",
    [
        ({"credentials": {"client_secret": "wrong-secret-value"}}, "AADSTS7000215"),
        ({"config": {"resource_group": "no-such-group"}}, "ResourceGroupNotFound"),
        ({"config": {"subscription_id": "00000000-0000-4000-8000-000000000000"}}, "SubscriptionNotFound"),
        ({"deny": "Microsoft.Compute/virtualMachines/read"}, "AuthorizationFailed"),
    ],
)
def test_check_credentials_fails_permanently_saying_why(
    fake: FakeAzure, change: dict[str, Any], message: str
) -> None:
    if "deny" in change:
        fake.deny(change["deny"])
    provider = make_provider(
        fake, credentials=fake.credentials(**change.get("credentials", {})), **change.get("config", {})
    )
    with pytest.raises(Permanent, match=message):
        provider.check_credentials()


def test_offerings_are_checked_against_the_regions_skus_and_images(
    fake: FakeAzure, provider: AzureProvider
) -> None:
    fake.restrict("Standard_NC4as_T4_v3", LOCATION)
    offerings = [
        Offering(SIZE, IMAGE),  # at the account's location
        Offering("Standard_D2ps_v6", "Canonical:ubuntu-24_04-lts:server-arm64:latest", LOCATION, "arm64"),
        Offering("Standard_D2as_v9", IMAGE),
        Offering("Standard_NC4as_T4_v3", IMAGE),
        Offering(SIZE, IMAGE, "", "arm64"),
        Offering("Standard_D2ps_v6", IMAGE),  # an x64 image on an Arm64 size
        Offering(SIZE, "Canonical:ubuntu-24_04-lts:server:24.04.190001010"),
        Offering(SIZE, "ubuntu-24.04"),
        Offering(SIZE, IMAGE, "marsnorth"),
    ]
    problems = provider.check_offerings(offerings)
    by: dict[Offering, str] = {}
    for p in problems:
        by[p.offering] = by.get(p.offering, "") + p.message
    assert all(p.refused for p in problems) and set(by) == set(offerings[2:])
    assert by[offerings[2]] == f"azure: no VM size 'Standard_D2as_v9' is offered at {LOCATION}"
    assert (
        "not available to this subscription at westeurope (NotAvailableForSubscription)" in by[offerings[3]]
    )
    assert "VM size Standard_D2as_v5 is x86_64, not arm64 as its machine type says" in by[offerings[4]]
    assert "is x86_64: Standard_D2ps_v6 cannot run it" in by[offerings[5]]
    assert "no image 'Canonical:ubuntu-24_04-lts:server:24.04.190001010'" in by[offerings[6]]
    assert "neither publisher:offer:sku:version" in by[offerings[7]]
    assert (
        by[offerings[8]]
        == "azure: no VM sizes are offered at 'marsnorth' to this subscription (is the location right?)"
    )
    assert fake.count("GET", "/skus") == 2  # one list per location, not per offering


def test_checking_offerings_with_a_refused_secret_is_permanent(fake: FakeAzure) -> None:
    provider = make_provider(fake, credentials=fake.credentials(client_secret="wrong"))
    with pytest.raises(Permanent, match="AADSTS7000215"):
        provider.check_offerings([Offering(SIZE, IMAGE)])


# ---- soak -----------------------------------------------------------------------------------------

FAULTS = [
    ("PUT /virtualMachines/{name}", "throttled"),
    ("PUT /virtualMachines/{name}", "internal_error"),
    ("PUT /virtualMachines/{name}", "service_unavailable"),
    ("PUT /virtualMachines/{name}", "drop_after"),
    ("PUT /virtualMachines/{name}", "drop_before"),
    ("GET /virtualMachines/{name}", "gateway_timeout"),
    ("GET /operations/{id}", "internal_error"),
    ("GET /operations/{id}", "drop_before"),
    ("GET /networkInterfaces", "throttled"),
    ("DELETE /virtualMachines/{name}", "service_unavailable"),
    ("DELETE /virtualMachines/{name}", "drop_after"),
]


@pytest.mark.timeout(240)
def test_soak_random_faults_then_reconcile_leaves_exactly_the_live_machines(fake: FakeAzure) -> None:
    """Create/delete cycles under random faults and sold-out sizes (>= 300 operations); a simple
    reconcile then converges, and nothing (disk, NIC, IP) is left of the deleted machines."""
    rng = random.Random(20261203)
    fake.lro_seconds = 0.05
    provider = make_provider(fake)
    live: dict[str, str] = {}  # instance id -> provider id: what the database believes is live
    operations = errors = 0
    while operations < 300:
        if rng.random() < 0.3:
            endpoint, kind = rng.choice(FAULTS)
            fake.fail_next(endpoint, kind, retry_after=0)
        if rng.random() < 0.03:
            fake.fail_next_operation("AllocationFailed", "Allocation failed.")
        if live and rng.random() < 0.45:
            operations += 1
            try:
                provider.delete(live.pop(rng.choice(sorted(live))))  # the row leaves the live states first
            except ProviderError as exc:
                errors += 1
                assert exc.retryable, repr(exc)
            continue
        spec = make_spec()
        for _attempt in range(3):  # the task retries retryable errors
            operations += 1
            try:
                machine = provider.create(spec)
            except ProviderError as exc:
                errors += 1
                assert exc.retryable, repr(exc)  # every injected fault is retryable
            else:
                assert machine.instance_id == spec.instance_id
                live[spec.instance_id] = machine.provider_id
                break

    fake.clear_faults()
    listed = provider.list(INSTALLATION)
    assert max(Counter(m.instance_id for m in listed if m.alive).values()) == 1
    for machine in listed:
        if live.get(machine.instance_id or "") != machine.provider_id:
            provider.delete(machine.provider_id)
    deadline = time.monotonic() + 10
    while {m.provider_id for m in provider.list(INSTALLATION)} != set(live.values()):
        assert time.monotonic() < deadline, "the reconcile did not converge"
        time.sleep(0.05)
    assert {vm["name"] for vm in fake.vms.values()} == set(live.values())
    leftovers = fake.leftovers()
    assert len(leftovers["disks"]) == len(leftovers["networkInterfaces"]) == len(live)
    assert errors > 0 and len(fake.created) > len(live)  # the faults bit, and reconcile had work to do
