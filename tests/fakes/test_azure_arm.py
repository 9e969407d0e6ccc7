"""The fake Azure Resource Manager is as strict as the real one: what ARM, Entra ID and the
metadata service refuse, it refuses, with their codes (a driver tested against a lenient fake
would fail at Azure)."""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator
from typing import Any

import pytest
import requests

from tests.fakes.azure_arm import (
    ARM_SCOPE,
    CLIENT_ID,
    CLIENT_SECRET,
    RESOURCE_GROUP,
    SUBSCRIPTION_ID,
    TENANT_ID,
    FakeAzure,
)

VERSION = "2024-07-01"
GROUP = f"/subscriptions/{SUBSCRIPTION_ID}/resourceGroups/{RESOURCE_GROUP}"
VMS = f"{GROUP}/providers/Microsoft.Compute/virtualMachines"
KEY = "ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQC7 test"


@pytest.fixture(scope="module")
def server() -> Iterator[FakeAzure]:
    with FakeAzure() as fake:
        yield fake


@pytest.fixture()
def fake(server: FakeAzure) -> FakeAzure:
    server.reset()
    server.lro_polls, server.lro_seconds, server.first_call_delay = 2, 30.0, 0.0
    return server


class Arm:
    """A bare HTTP client of the fake: what the SDK does, spelled out."""

    def __init__(self, fake: FakeAzure) -> None:
        self.fake = fake
        self.session = requests.Session()
        self.session.verify = fake.ca_bundle
        self.session.trust_env = False  # else REQUESTS_CA_BUNDLE from the environment wins over verify
        self.token = self.login().json()["access_token"]

    def login(self, **form: str) -> requests.Response:
        data = {
            "grant_type": "client_credentials",
            "client_id": CLIENT_ID,
            "client_secret": CLIENT_SECRET,
            "scope": ARM_SCOPE,
            **form,
        }
        return self.session.post(f"{self.fake.url}/{TENANT_ID}/oauth2/v2.0/token", data=data)

    def call(
        self, method: str, path: str, *, version: str | None = VERSION, **kwargs: Any
    ) -> requests.Response:
        params = dict(kwargs.pop("params", {}))
        if version:
            params["api-version"] = version
        headers = {"Authorization": f"Bearer {self.token}", **kwargs.pop("headers", {})}
        url = path if path.startswith("https://") else self.fake.url + path
        return self.session.request(method, url, params=params, headers=headers, **kwargs)


@pytest.fixture()
def arm(fake: FakeAzure) -> Arm:
    return Arm(fake)


def vm_body(
    fake: FakeAzure, name: str, *, delete_option: str = "Delete", properties: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {
        "location": "westeurope",
        "tags": {"catacloud:instance": name},
        "properties": {
            "hardwareProfile": {"vmSize": "Standard_D2as_v5"},
            "storageProfile": {
                "imageReference": {
                    "publisher": "Canonical",
                    "offer": "ubuntu-24_04-lts",
                    "sku": "server",
                    "version": "latest",
                },
                "osDisk": {"createOption": "FromImage", "deleteOption": delete_option},
            },
            "osProfile": {
                "computerName": name,
                "adminUsername": "catacloud",
                "customData": base64.b64encode(b"#cloud-config\n").decode(),
                "linuxConfiguration": {
                    "disablePasswordAuthentication": True,
                    "ssh": {"publicKeys": [{"path": "/home/catacloud/.ssh/authorized_keys", "keyData": KEY}]},
                },
            },
            "networkProfile": {
                "networkApiVersion": "2020-11-01",
                "networkInterfaceConfigurations": [
                    {
                        "name": f"{name}-nic",
                        "properties": {
                            "primary": True,
                            "deleteOption": delete_option,
                            "ipConfigurations": [
                                {
                                    "name": "ipconfig1",
                                    "properties": {
                                        "subnet": {"id": fake.subnet_id},
                                        "publicIPAddressConfiguration": {
                                            "name": f"{name}-ip",
                                            "sku": {"name": "Standard"},
                                            "properties": {"deleteOption": delete_option},
                                        },
                                    },
                                }
                            ],
                        },
                    }
                ],
            },
            **(properties or {}),
        },
    }


def error_of(response: requests.Response) -> tuple[int, str]:
    return response.status_code, response.json()["error"]["code"]


# ---- what every ARM call needs ---------------------------------------------------------------------


def test_arm_refuses_calls_without_a_valid_bearer_token(fake: FakeAzure, arm: Arm) -> None:
    missing = requests.get(fake.url + VMS, params={"api-version": VERSION}, verify=fake.ca_bundle)
    assert error_of(missing) == (401, "AuthenticationFailed")
    assert "invalid_token" in missing.headers["WWW-Authenticate"]
    arm.token = "made-up"
    assert error_of(arm.call("GET", VMS)) == (401, "InvalidAuthenticationToken")
    arm.token = arm.login().json()["access_token"]
    fake.expire_tokens()
    assert error_of(arm.call("GET", VMS)) == (401, "ExpiredAuthenticationToken")


def test_arm_needs_an_api_version_on_every_call(arm: Arm) -> None:
    assert error_of(arm.call("GET", VMS, version=None)) == (400, "MissingApiVersionParameter")
    assert error_of(arm.call("GET", VMS, version="latest")) == (400, "InvalidApiVersionParameter")
    assert error_of(arm.call("GET", VMS, version="2016-04-30-preview")) == (400, "NoRegisteredProviderFound")


def test_the_subscription_and_resource_group_must_exist(arm: Arm) -> None:
    assert error_of(arm.call("GET", VMS.replace(RESOURCE_GROUP, "nope"))) == (404, "ResourceGroupNotFound")
    other = VMS.replace(SUBSCRIPTION_ID, "00000000-0000-4000-8000-000000000000")
    assert error_of(arm.call("GET", other)) == (404, "SubscriptionNotFound")


def test_a_role_without_an_action_is_refused(fake: FakeAzure, arm: Arm) -> None:
    fake.deny("Microsoft.Compute/virtualMachines/read")
    status, code = error_of(arm.call("GET", VMS))
    assert (status, code) == (403, "AuthorizationFailed")


# ---- Entra ID -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "form, status, error, aadsts",
    [
        ({"client_secret": "wrong"}, 401, "invalid_client", 7000215),
        ({"client_id": "someone-else"}, 400, "unauthorized_client", 700016),
        ({"scope": "https://vault.azure.net/.default"}, 400, "invalid_resource", 500011),
        ({"grant_type": "password"}, 400, "unsupported_grant_type", 70003),
    ],
)
def test_the_token_endpoint_answers_as_entra_does(
    arm: Arm, form: dict, status: int, error: str, aadsts: int
) -> None:
    response = arm.login(**form)
    body = response.json()
    assert (response.status_code, body["error"], body["error_codes"]) == (status, error, [aadsts])
    assert body["error_description"].startswith(f"AADSTS{aadsts}: ")


def test_an_unknown_tenant_has_no_discovery_document(fake: FakeAzure) -> None:
    response = requests.get(
        f"{fake.url}/contoso/v2.0/.well-known/openid-configuration", verify=fake.ca_bundle
    )
    assert (response.status_code, response.json()["error"]) == (400, "invalid_tenant")
    known = requests.get(
        f"{fake.url}/{TENANT_ID}/v2.0/.well-known/openid-configuration", verify=fake.ca_bundle
    )
    assert known.json()["token_endpoint"] == f"{fake.url}/{TENANT_ID}/oauth2/v2.0/token"


# ---- the long-running operations of a VM ------------------------------------------------------------


def test_a_create_is_an_operation_polled_until_it_succeeds(fake: FakeAzure, arm: Arm) -> None:
    created = arm.call("PUT", f"{VMS}/vm1", json=vm_body(fake, "vm1"))
    assert created.status_code == 201
    assert created.json()["properties"]["provisioningState"] == "Creating"
    operation = created.headers["Azure-AsyncOperation"]
    assert "/providers/Microsoft.Compute/locations/westeurope/operations/" in operation
    assert arm.call("GET", operation, version=None).json()["status"] == "InProgress"
    assert arm.call("GET", operation, version=None).json()["status"] == "Succeeded"
    vm = arm.call("GET", f"{VMS}/vm1", params={"$expand": "instanceView"}).json()
    assert vm["properties"]["provisioningState"] == "Succeeded"
    assert [s["code"] for s in vm["properties"]["instanceView"]["statuses"]] == [
        "ProvisioningState/succeeded",
        "PowerState/running",
    ]
    assert "customData" not in vm["properties"]["osProfile"]  # write-only


def test_work_goes_on_without_polls(fake: FakeAzure, arm: Arm) -> None:
    fake.lro_seconds = 0.1
    arm.call("PUT", f"{VMS}/vm1", json=vm_body(fake, "vm1"))
    time.sleep(0.2)
    assert arm.call("GET", f"{VMS}/vm1").json()["properties"]["provisioningState"] == "Succeeded"


def test_a_put_while_the_create_runs_is_refused(fake: FakeAzure, arm: Arm) -> None:
    arm.call("PUT", f"{VMS}/vm1", json=vm_body(fake, "vm1"))
    assert error_of(arm.call("PUT", f"{VMS}/vm1", json=vm_body(fake, "vm1"))) == (
        409,
        "AnotherOperationInProgress",
    )
    assert fake.created == ["vm1"]


def test_no_capacity_fails_the_operation_not_the_put(fake: FakeAzure, arm: Arm) -> None:
    fake.sell_out("Standard_D2as_v5")
    created = arm.call("PUT", f"{VMS}/vm1", json=vm_body(fake, "vm1"))
    assert created.status_code == 201
    operation = created.headers["Azure-AsyncOperation"]
    arm.call("GET", operation, version=None)
    done = arm.call("GET", operation, version=None).json()
    assert (done["status"], done["error"]["code"]) == ("Failed", "AllocationFailed")
    vm = arm.call("GET", f"{VMS}/vm1", params={"$expand": "instanceView"}).json()
    assert vm["properties"]["provisioningState"] == "Failed"
    assert (
        vm["properties"]["instanceView"]["statuses"][0]["code"] == "ProvisioningState/failed/AllocationFailed"
    )


def test_a_delete_is_accepted_then_done_and_nothing_there_is_204(fake: FakeAzure, arm: Arm) -> None:
    fake.lro_polls = 1
    arm.call("PUT", f"{VMS}/vm1", json=vm_body(fake, "vm1"))
    deleted = arm.call("DELETE", f"{VMS}/vm1")
    assert deleted.status_code == 202 and deleted.headers["Location"].endswith("&monitor=true")
    assert arm.call("GET", f"{VMS}/vm1").json()["properties"]["provisioningState"] == "Deleting"
    assert (
        arm.call("GET", deleted.headers["Azure-AsyncOperation"], version=None).json()["status"] == "Succeeded"
    )
    assert error_of(arm.call("GET", f"{VMS}/vm1")) == (404, "ResourceNotFound")
    assert arm.call("DELETE", f"{VMS}/vm1").status_code == 204
    assert fake.leftovers() == {"disks": [], "networkInterfaces": [], "publicIPAddresses": []}


def test_resources_made_with_the_default_delete_option_outlive_the_vm(fake: FakeAzure, arm: Arm) -> None:
    """deleteOption defaults to Detach: a driver that forgets it leaves a disk, a NIC and an IP billing."""
    fake.lro_polls = 1
    arm.call("PUT", f"{VMS}/vm1", json=vm_body(fake, "vm1", delete_option="Detach"))
    deleted = arm.call("DELETE", f"{VMS}/vm1")
    arm.call("GET", deleted.headers["Azure-AsyncOperation"], version=None)
    assert {k: len(v) for k, v in fake.leftovers().items()} == {
        "disks": 1,
        "networkInterfaces": 1,
        "publicIPAddresses": 1,
    }


def test_a_list_is_paged_by_next_link(fake: FakeAzure, arm: Arm) -> None:
    fake.page_size = 2
    for i in range(5):
        fake.add_vm(f"vm{i}")
    names: list[str] = []
    url: str | None = VMS
    while url:
        page = arm.call("GET", url, version=None if "api-version" in url else VERSION).json()
        names += [vm["name"] for vm in page["value"]]
        url = page.get("nextLink")
    assert names == [f"vm{i}" for i in range(5)]


# ---- what a create must get right -------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, status, code",
    [
        (lambda b: b["tags"].update({"catacloud/instance": "x"}), 400, "InvalidTagNameCharacters"),
        (lambda b: b.update(location="mars"), 400, "LocationNotAvailableForResourceType"),
        (
            lambda b: b["properties"]["storageProfile"]["imageReference"].update(sku="nope"),
            404,
            "PlatformImageNotFound",
        ),
        (lambda b: b["properties"]["osProfile"].update(adminUsername="root"), 400, "InvalidParameter"),
        (
            lambda b: b["properties"]["osProfile"]["linuxConfiguration"].update(ssh={}),
            400,
            "InvalidParameter",
        ),
        (lambda b: b["properties"]["osProfile"].update(customData="#cloud-config"), 400, "InvalidParameter"),
        (lambda b: b["properties"]["networkProfile"].pop("networkApiVersion"), 400, "InvalidParameter"),
        (
            lambda b: b["properties"].update(evictionPolicy="Delete"),
            400,
            "EvictionPolicyCanBeSetOnlyOnAzureSpotVirtualMachines",
        ),
        (
            lambda b: b["properties"].update(priority="Spot", billingProfile={"maxPrice": 0}),
            400,
            "MaxPriceValueInvalid",
        ),
    ],
)
def test_a_create_azure_would_refuse_is_refused(
    fake: FakeAzure, arm: Arm, change: Any, status: int, code: str
) -> None:
    body = vm_body(fake, "vm1")
    change(body)
    assert error_of(arm.call("PUT", f"{VMS}/vm1", json=body)) == (status, code)
    assert fake.created == []


def test_spot_has_its_own_refusals(fake: FakeAzure, arm: Arm) -> None:
    spot = {"priority": "Spot", "evictionPolicy": "Delete", "billingProfile": {"maxPrice": -1}}
    b_series = vm_body(fake, "vm1", properties=spot)
    b_series["properties"]["hardwareProfile"]["vmSize"] = "Standard_B2s"
    assert error_of(arm.call("PUT", f"{VMS}/vm1", json=b_series)) == (
        400,
        "AzureSpotIsNotSupportedForThisVMSize",
    )
    fake.sell_out("Standard_D2as_v5")
    assert error_of(arm.call("PUT", f"{VMS}/vm2", json=vm_body(fake, "vm2", properties=spot))) == (
        409,
        "SkuNotAvailable",
    )


def test_resource_skus_take_a_location_filter_only(fake: FakeAzure, arm: Arm) -> None:
    skus = f"/subscriptions/{SUBSCRIPTION_ID}/providers/Microsoft.Compute/skus"
    fake.restrict("Standard_NC4as_T4_v3")
    listed = arm.call(
        "GET", skus, version="2021-07-01", params={"$filter": "location eq 'westeurope'"}
    ).json()
    by_name = {s["name"]: s for s in listed["value"]}
    assert by_name["Standard_NC4as_T4_v3"]["restrictions"][0]["reasonCode"] == "NotAvailableForSubscription"
    assert {"name": "CpuArchitectureType", "value": "Arm64"} in by_name["Standard_D2ps_v6"]["capabilities"]
    wrong = arm.call("GET", skus, version="2021-07-01", params={"$filter": "name eq 'Standard_B2s'"})
    assert error_of(wrong) == (400, "InvalidFilter")


# ---- the metadata service: Scheduled Events ---------------------------------------------------------


LINK_LOCAL = requests.Session()
LINK_LOCAL.trust_env = False  # as every IMDS client must: never through a proxy


def imds(
    fake: FakeAzure, vm: str, *, headers: dict | None = None, version: str = "2020-07-01"
) -> requests.Response:
    params = {"api-version": version}
    headers = {"Metadata": "true"} if headers is None else headers
    return LINK_LOCAL.get(f"{fake.imds_url}/{vm}/metadata/scheduledevents", params=params, headers=headers)


def test_imds_needs_the_metadata_header_and_an_api_version(fake: FakeAzure) -> None:
    fake.add_vm("vm1")
    assert imds(fake, "vm1", headers={}).status_code == 400
    assert imds(fake, "vm1", headers={"Metadata": "true", "X-Forwarded-For": "10.0.0.9"}).status_code == 400
    assert imds(fake, "vm1", version="").status_code == 400
    assert imds(fake, "vm1").json() == {"DocumentIncarnation": 1, "Events": []}


def test_imds_allows_five_requests_a_second(fake: FakeAzure) -> None:
    fake.add_vm("vm1")
    answers = [imds(fake, "vm1").status_code for _ in range(6)]
    assert answers == [200] * 5 + [429]


def test_an_eviction_is_announced_to_a_vm_that_asked_then_it_is_deleted(fake: FakeAzure) -> None:
    fake.add_vm("spot1", priority="Spot")
    fake.add_vm("spot2", priority="Spot")
    imds(fake, "spot1")  # enables Scheduled Events for spot1; spot2 never asked
    fake.evict("spot1", notice=0.3)
    fake.evict("spot2", notice=0.3)
    (event,) = imds(fake, "spot1").json()["Events"]
    assert (event["EventType"], event["EventStatus"], event["Resources"]) == (
        "Preempt",
        "Scheduled",
        ["spot1"],
    )
    assert event["NotBefore"].endswith(" GMT")
    assert imds(fake, "spot2").json()["Events"] == []  # not delivered: it never asked
    time.sleep(0.6)
    assert imds(fake, "spot1").status_code == 404  # gone
    assert fake.vm("spot1") is None and fake.vm("spot2") is None


def test_approving_an_eviction_starts_it_at_once(fake: FakeAzure) -> None:
    fake.add_vm("spot1", priority="Spot")
    imds(fake, "spot1")
    event = fake.evict("spot1", notice=60)
    url = f"{fake.imds_url}/spot1/metadata/scheduledevents"
    approve = {"StartRequests": [{"EventId": event["EventId"]}]}
    posted = LINK_LOCAL.post(
        url, params={"api-version": "2020-07-01"}, headers={"Metadata": "true"}, json=approve
    )
    assert posted.status_code == 200
    (started,) = imds(fake, "spot1").json()["Events"]
    assert (started["EventStatus"], started["NotBefore"]) == ("Started", "")


def test_only_spot_vms_are_evicted(fake: FakeAzure) -> None:
    fake.add_vm("regular")
    with pytest.raises(ValueError, match="not a Spot VM"):
        fake.evict("regular")
