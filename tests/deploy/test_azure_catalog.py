"""deploy/catalog/azure.yaml against the fake Azure Resource Manager (the real azure-identity and
azure-mgmt-compute): as shipped its placeholder subscription is refused; pointed at a
subscription it applies, checked against the region's VM sizes and images; and a spot machine it
buys is a tagged VM whose agent installs from the control plane and watches Scheduled Events."""

from __future__ import annotations

from collections.abc import Iterator
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
import yaml
from django.core.management import call_command
from django.core.management.base import CommandError

from apps.machines import lifecycle
from apps.machines.models import MachineInstance, MachineType, ProviderAccount
from apps.machines.tasks import provision_instance_task
from tests.fakes.azure_arm import RESOURCE_GROUP, SUBSCRIPTION_ID, FakeAzure
from tests.machines.test_lifecycle import serve_an_agent_wheel

pytestmark = pytest.mark.django_db
CATALOG = Path(__file__).resolve().parents[2] / "deploy" / "catalog" / "azure.yaml"
PLACEHOLDER = "00000000-0000-0000-0000-000000000000"


@pytest.fixture(scope="module")
def azure() -> Iterator[FakeAzure]:
    with FakeAzure(lro_seconds=0.2) as fake:
        yield fake


@pytest.fixture
def environment(azure: FakeAzure, monkeypatch: pytest.MonkeyPatch) -> FakeAzure:
    azure.reset()
    for name, value in zip(
        ("AZURE_TENANT_ID", "AZURE_CLIENT_ID", "AZURE_CLIENT_SECRET"),
        azure.credentials().values(),
        strict=True,
    ):
        monkeypatch.setenv(name, value)
    return azure


def pointed(azure: FakeAzure, tmp_path: Path, *, subscription: bool) -> Path:
    """The shipped catalog with its account's config pointed at the fake: its endpoint, login and
    CA; with ``subscription``, the operator's subscription and subnet put in for the placeholders."""
    text = CATALOG.read_text()
    assert text.count("    config:\n") == 1
    extra = (
        f"      endpoint: '{azure.url}'\n      authority: '{azure.url}'\n"
        f"      connection_verify: '{azure.ca_bundle}'\n      max_attempts: 1\n      poll_interval: 0.01\n"
    )
    text = text.replace("    config:\n", "    config:\n" + extra)
    if subscription:
        account = yaml.safe_load(text)["provider_accounts"][0]["config"]
        text = text.replace(account["subnet_id"], azure.subnet_id).replace(PLACEHOLDER, SUBSCRIPTION_ID)
        text = text.replace("resource_group: catacloud-machines", f"resource_group: {RESOURCE_GROUP}")
    copy = tmp_path / "azure.yaml"
    copy.write_text(text)
    return copy


def test_as_shipped_the_placeholder_subscription_is_refused_and_nothing_changes(
    environment: FakeAzure, tmp_path: Path
) -> None:
    with pytest.raises(CommandError, match="SubscriptionNotFound"):
        call_command("apply", str(pointed(environment, tmp_path, subscription=False)), verbosity=0)
    assert not MachineType.objects.exists()


def test_the_catalog_applies_checked_against_the_regions_sizes_and_images(
    environment: FakeAzure, tmp_path: Path
) -> None:
    call_command(
        "apply", str(pointed(environment, tmp_path, subscription=True)), verbosity=0, stderr=StringIO()
    )
    assert environment.count("GET", "/skus") == 1  # one list of the region's VM sizes
    assert environment.count("GET", "/images") == 4  # the two images: their versions, and the newest's arch
    spot = MachineType.objects.get(name="az-d2as-v5-spot")
    assert spot.spot and spot.alternatives == ["az-d2as-v5"]
    assert MachineType.objects.get(name="az-d2ps-v6").arch == "arm64"
    assert ProviderAccount.objects.get(name="azure").kind == "azure"


def test_an_arm_image_on_an_x64_size_is_refused_naming_both(environment: FakeAzure, tmp_path: Path) -> None:
    catalog = pointed(environment, tmp_path, subscription=True)
    catalog.write_text(
        catalog.read_text().replace("server_type: Standard_D2ps_v6", "server_type: Standard_D2as_v5")
    )
    with pytest.raises(CommandError) as refused:
        call_command("apply", str(catalog), verbosity=0)
    assert (
        "machine type az-d2ps-v6 (account azure): azure: VM size Standard_D2as_v5 is x86_64, not arm64"
        in str(refused.value)
    )


def test_a_spot_machine_of_the_catalog_watches_scheduled_events(
    environment: FakeAzure, tmp_path: Path, settings: Any
) -> None:
    serve_an_agent_wheel(settings, tmp_path)
    settings.CATACLOUD_AGENT_URL = "https://catacloud.example.com"
    call_command(
        "apply", str(pointed(environment, tmp_path, subscription=True)), verbosity=0, stderr=StringIO()
    )
    spot = MachineType.objects.get(name="az-d2as-v5-spot")

    member = lifecycle.instance_request(org=spot.grants.get().org, machine_type=spot)
    provision_instance_task(str(member.pk))

    instance = MachineInstance.objects.get(pk=member.pk)
    vm = environment.vm(instance.provider_id)
    assert vm is not None and vm["priority"] == "Spot"
    assert vm["tags"]["catacloud:instance"] == str(instance.pk)
    assert instance.public_ip and instance.provider_state == "running"
    user_data = yaml.safe_load(environment.custom_data[instance.provider_id])
    unit = next(f["content"] for f in user_data["write_files"] if f["path"].endswith(".service"))
    assert "--imds-url http://169.254.169.254 --imds-kind azure" in unit
    install = [c for c in user_data["runcmd"] if "install" in c]
    assert install and install[0][-1].startswith("https://catacloud.example.com/api/agent/v1/dist/")
